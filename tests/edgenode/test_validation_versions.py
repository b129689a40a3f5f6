"""The validation split and evaluation, the kept parameter versions and the device facts, alone."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

from edgenode.devicefacts import DeviceFacts
from edgenode.errors import NodeError
from edgenode.store import Samples, split_key
from edgenode.validation import DIVERGED, evaluate
from edgenode.versions import ParamVersions


def test_split_key_is_stable_uniform_and_content_based():
    rng = np.random.default_rng(0)
    rows = [rng.random(64, dtype=np.float32).tobytes() for _ in range(4000)]
    keys = np.array([split_key(r) for r in rows])
    assert keys.min() >= 0 and keys.max() < 1
    assert [split_key(r) for r in rows[:50]] == list(keys[:50])  # same bytes, same side, every time
    share = (keys < 0.2).mean()
    assert 0.18 < share < 0.22, share  # about the configured share
    # Raising the share only moves samples into validation, never out of it.
    assert set(np.flatnonzero(keys < 0.2)) <= set(np.flatnonzero(keys < 0.3))


def _softmax_ce_reference(logits, y):
    # float64 reference, written the textbook way
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return float(-np.log(p[np.arange(len(y)), y]).mean())


def test_evaluate_matches_a_reference_over_several_batches():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(8, 5))
    x = rng.normal(size=(700, 8)).astype(np.float32)
    y = rng.integers(0, 5, 700)
    s = Samples({"x": x}, y)
    v = evaluate(lambda inp: inp["x"] @ w, s, loss="ce", version=3, batch=256)
    logits = x.astype(np.float64) @ w
    assert v.loss == pytest.approx(_softmax_ce_reference(logits, y), rel=1e-9)
    assert v.accuracy == pytest.approx((logits.argmax(1) == y).mean())
    assert (v.samples, v.model_version) == (700, 3)
    t = rng.normal(size=(700, 5)).astype(np.float32)
    r = evaluate(lambda inp: inp["x"] @ w, Samples({"x": x}, t), loss="mse")
    assert r.accuracy is None and r.loss == pytest.approx(((logits - t) ** 2).mean(), rel=1e-6)
    assert evaluate(lambda inp: inp["x"], Samples({"x": x[:0]}, y[:0]), loss="ce") is None


def test_evaluate_of_a_diverged_model_is_worst_but_valid_json():
    x = np.ones((4, 3), np.float32)
    v = evaluate(lambda inp: np.full((4, 3), np.nan), Samples({"x": x}, np.zeros(4, np.int64)), loss="ce")
    assert v.loss == DIVERGED and math.isfinite(v.loss) and v.accuracy == 0.0
    v.model_dump_json()  # no NaN in the payload


def test_versions_keep_the_newest_and_roll_back(tmp_path):
    shipped = [np.zeros((2, 2), np.float32), np.zeros(2, np.float32)]
    pv = ParamVersions(tmp_path / "versions", keep=3, shipped=lambda: shipped)
    assert pv.available() == [0]
    for v in range(1, 6):
        pv.save(v, [np.full((2, 2), v, np.float32), np.full(2, v, np.float32)])
    assert pv.available() == [0, 3, 4, 5]
    assert float(pv.load(4)[0][0, 0]) == 4.0 and float(pv.load(0)[1][0]) == 0.0
    with pytest.raises(NodeError, match="not kept"):
        pv.load(2)
    pv.drop_after(3)
    assert pv.available() == [0, 3]
    # A damaged file is refused, not half-loaded.
    raw = (tmp_path / "versions" / "v3.npz").read_bytes()
    (tmp_path / "versions" / "v3.npz").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(NodeError, match="unreadable"):
        pv.load(3)
    again = ParamVersions(tmp_path / "versions", keep=3, shipped=lambda: shipped)  # a restart
    assert again.available() == [0, 3]


def test_device_facts(tmp_path):
    facts = DeviceFacts(tmp_path)
    t_end = time.process_time() + 0.2
    while time.process_time() < t_end:  # 0.2 s of CPU time
        pass
    h = facts.health()
    assert h.uptime_s >= 0 and h.cpu_percent > 0 and h.mem_rss_bytes > 10 << 20
    assert 0 < h.mem_percent < 100
    st = os.statvfs(tmp_path)
    assert abs(h.disk_free_bytes - st.f_bavail * st.f_frsize) < 1 << 30  # others write to this disk too
