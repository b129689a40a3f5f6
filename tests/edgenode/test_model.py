"""ModelHolder: atomic parameter swap under concurrent inference, persistence across restarts."""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from edgenode.model import ModelHolder
from federation.steps import flatten, unflatten
from tests.edgenode.fakes import NumpyArtifact


def versioned(k: int) -> list[np.ndarray]:
    """W = k everywhere, b = 1000 k: logits of a one-hot input decode as (W part, b part)."""
    return [np.full((64, 10), k, np.float32), np.full(10, 1000 * k, np.float32)]


def test_no_inference_sees_a_mixed_snapshot(tmp_path):
    art = NumpyArtifact(infer_delay=0.0005)  # reads W, sleeps, then reads b
    holder = ModelHolder(art, tmp_path)
    holder.commit(versioned(1), 1)
    x = np.zeros((1, 64), np.float32)
    x[0, 0] = 1.0
    stop = threading.Event()
    seen: list[tuple[int, int]] = []
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            v = float(holder.infer({"x": x})["logits"][0, 0])
            b, w = divmod(int(round(v)), 1000)
            seen.append((w, b))
            if w != b:
                errors.append(f"mixed snapshot: W from version {w}, b from version {b}")

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for k in range(2, 60):
        holder.commit(versioned(k), k)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len({w for w, _ in seen}) > 3  # readers really overlapped many swaps


def test_snapshot_arrays_are_read_only(tmp_path):
    holder = ModelHolder(NumpyArtifact(), tmp_path)
    assert not holder.snapshot.params[0].flags.writeable


def test_params_sha256_is_sha_of_concatenated_float32(tmp_path):
    holder = ModelHolder(NumpyArtifact(), tmp_path)
    p = versioned(3)
    snap = holder.commit(p, 3)
    assert snap.sha256 == hashlib.sha256(p[0].tobytes() + p[1].tobytes()).hexdigest()


def test_persisted_and_restored(tmp_path):
    art = NumpyArtifact()
    holder = ModelHolder(art, tmp_path)
    assert holder.version == 0
    initial = holder.sha256
    snap = holder.commit(versioned(7), 7)
    again = ModelHolder(NumpyArtifact(), tmp_path)  # a restart
    assert again.version == 7 and again.sha256 == snap.sha256 != initial
    np.testing.assert_array_equal(again.snapshot.params[1], versioned(7)[1])
    assert not list(tmp_path.glob(".params.npz.tmp*"))  # the temp file was renamed away


def test_corrupt_or_foreign_params_fall_back_to_artifact(tmp_path):
    holder = ModelHolder(NumpyArtifact(), tmp_path)
    holder.commit(versioned(2), 2)
    data = bytearray((tmp_path / "params.npz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "params.npz").write_bytes(bytes(data))
    fresh = ModelHolder(NumpyArtifact(), tmp_path)
    assert fresh.version == 0 and fresh.sha256 == ModelHolder(NumpyArtifact(), tmp_path / "x").sha256
    fresh.commit(versioned(2), 2)
    other = ModelHolder(NumpyArtifact(n_out=3), tmp_path)  # another model: do not load its params
    assert other.version == 0


def test_flatten_roundtrip():
    p = versioned(4)
    back = unflatten(flatten(p), p)
    for a, b in zip(p, back, strict=True):
        np.testing.assert_array_equal(a, b)
