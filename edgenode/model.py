"""The node's model: the loaded artifact plus the CURRENT parameters, swapped atomically.

The parameters live in one immutable :class:`ParamsSnapshot` (a tuple of read-only arrays, a
version and their sha256). Readers grab the reference once and use only that object, so an
inference never sees half of round N and half of round N+1; writers build a whole new snapshot
and replace the reference under a lock. Committed parameters are persisted atomically
(temp + fsync + rename) in ``data_dir/params.npz`` and restored on restart.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import InputError
from edgenode.common import get_logger, params_sha256
from edgenode.errors import InvalidInput, NodeError
from edgenode.ports import Engine
from edgenode.versions import ParamVersions
from fractal.files import atomic_write, replace_durably

__all__ = ["ParamsSnapshot", "ModelHolder"]

log = get_logger("model")
_PARAMS_FORMAT = 1


@dataclass(frozen=True)
class ParamsSnapshot:
    """One committed parameter set. ``params`` arrays are read-only; never mutate them."""

    params: tuple[np.ndarray, ...]
    version: int
    sha256: str
    # The artifact's device-side copy of ``params`` (``Artifact.prepare_params``), built once per
    # commit so a request does not re-upload every weight; None for artifacts without it.
    prepared: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def make(cls, params: list[np.ndarray] | tuple[np.ndarray, ...], version: int) -> ParamsSnapshot:
        frozen = []
        for p in params:
            a = np.array(p, dtype=np.float32, copy=True, order="C")
            a.setflags(write=False)
            frozen.append(a)
        return cls(tuple(frozen), int(version), params_sha256(frozen))


class ModelHolder:
    """Holds ``artifact`` and its current parameters; see the module docstring for the contract."""

    def __init__(self, artifact: Engine, data_dir: str | Path, *, keep_versions: int = 5) -> None:
        self.artifact = artifact
        self.path = Path(data_dir) / "params.npz"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._swapping = False
        self._shapes = [tuple(np.shape(p)) for p in artifact.params]
        # Staged parameters of a round whose decision this node never applied (it died between
        # prepare and commit): discard them; the next round's start-version rule resyncs us.
        if self.prepared_path.exists():
            log.warning("discarding %s left by an interrupted commit", self.prepared_path)
            self.prepared_path.unlink()
        # Earlier versions for a swarm-wide rollback (version 0 is the artifact's own parameters).
        self.versions = ParamVersions(Path(data_dir) / "versions", keep=keep_versions,
                                      shipped=lambda: artifact.params)
        self._snap = self._prepare(self._restore() or ParamsSnapshot.make(list(artifact.params), 0))
        if not self.versions.has(self._snap.version):  # data from before versions were kept
            self.versions.save(self._snap.version, self._snap.params)

    # -- reading -------------------------------------------------------------------------------
    @property
    def snapshot(self) -> ParamsSnapshot:
        """The current committed parameters (one atomic reference read)."""
        return self._snap

    @property
    def swapping(self) -> bool:
        """True while a new parameter set is being prepared, persisted and published."""
        return self._swapping

    @property
    def version(self) -> int:
        return self._snap.version

    @property
    def sha256(self) -> str:
        return self._snap.sha256

    def infer(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the artifact on one consistent parameter snapshot."""
        snap = self._snap  # read once: a concurrent commit replaces the reference, not our tuple
        try:
            return self.artifact.infer(inputs, params=snap.prepared if snap.prepared is not None
                                       else list(snap.params))
        except InputError as exc:  # the compiler validates inputs; the node's error says the same
            raise InvalidInput(str(exc), hint=exc.hint) from exc

    def infer_shipped(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the artifact on its own shipped parameters (version 0), whatever the node has
        learned since: what the boot health check compares with the image's reference output."""
        try:
            return self.artifact.infer(inputs, params=list(self.artifact.params))
        except InputError as exc:
            raise InvalidInput(str(exc), hint=exc.hint) from exc

    # -- writing -------------------------------------------------------------------------------
    def commit(self, params: list[np.ndarray], version: int) -> ParamsSnapshot:
        """Persist then publish ``params`` as ``version``; returns the new snapshot.

        Persist first: if the node dies between the two, the restart shows the new parameters,
        which is what the round already reported as DONE.
        """
        shapes = [tuple(np.shape(p)) for p in params]
        if shapes != self._shapes:
            raise NodeError(f"parameter shapes {shapes} do not match the artifact's {self._shapes}")
        with self._lock:
            self._swapping = True  # readiness: the node says "not ready" while parameters change
            try:
                snap = self._prepare(ParamsSnapshot.make(params, version))
                self._persist(snap)
                self._snap = snap
            finally:
                self._swapping = False
            self.versions.save(snap.version, snap.params)
        log.info("committed params version %d sha256 %s", snap.version, snap.sha256[:12])
        return snap

    # -- two-phase commit (edgenode/roundphases.py) ----------------------------------------------------
    @property
    def prepared_path(self) -> Path:
        return self.path.with_name(self.path.name + ".prepared")

    def prepare(self, params: list[np.ndarray], version: int) -> ParamsSnapshot:
        """Phase 1: check ``params`` and write them durably beside the current file (fsynced), without
        making them current. Raises NodeError (bad shapes, non-finite) or OSError (the disk)."""
        shapes = [tuple(np.shape(p)) for p in params]
        if shapes != self._shapes:
            raise NodeError(f"parameter shapes {shapes} do not match the artifact's {self._shapes}")
        snap = ParamsSnapshot.make(params, version)
        if not all(np.isfinite(p).all() for p in snap.params):
            raise NodeError("refusing to stage non-finite parameters")
        self._write(snap, self.prepared_path)
        return snap

    def commit_prepared(self, snap: ParamsSnapshot) -> ParamsSnapshot:
        """Phase 2: make the staged parameters current (atomic rename, then the in-memory swap)."""
        with self._lock:
            self._swapping = True  # readiness: "not ready" while parameters change
            try:
                snap = self._prepare(snap)
                replace_durably(self.prepared_path, self.path)
                self._snap = snap
            finally:
                self._swapping = False
            try:
                self.versions.save(snap.version, snap.params)  # a rollback target from now on
            except OSError as exc:  # committed all the same: only the rollback copy is missing
                log.warning("committed version %d but could not keep a rollback copy: %s", snap.version, exc)
        log.info("committed params version %d sha256 %s", snap.version, snap.sha256[:12])
        return snap

    def discard(self, _: ParamsSnapshot | None = None) -> None:
        """Drop staged parameters (the round was not committed)."""
        self.prepared_path.unlink(missing_ok=True)

    def rollback(self, version: int) -> ParamsSnapshot:
        """Make the kept ``version`` current again and forget the later ones (the next round
        commits ``version + 1``); NodeError when it is not kept or is above the current one."""
        if version > self.version:
            raise NodeError(f"cannot roll forward from version {self.version} to {version}")
        params = self.versions.load(version)
        snap = self.commit(params, version)
        self.versions.drop_after(version)
        log.info("rolled back to params version %d", version)
        return snap

    def _prepare(self, snap: ParamsSnapshot) -> ParamsSnapshot:
        return ParamsSnapshot(snap.params, snap.version, snap.sha256,
                              self.artifact.prepare_params(list(snap.params)))

    def reset(self) -> ParamsSnapshot:
        """Back to the artifact's shipped parameters (version 0), persisted."""
        return self.commit(list(self.artifact.params), 0)

    def _persist(self, snap: ParamsSnapshot) -> None:
        self._write(snap, self.path)

    def _write(self, snap: ParamsSnapshot, path: Path) -> None:
        meta = {"format": _PARAMS_FORMAT, "model": self.artifact.name,
                "version": snap.version, "sha256": snap.sha256,
                "names": list(self.artifact.param_names),
                "shapes": [list(s) for s in self._shapes]}
        buf = io.BytesIO()
        arrays: dict[str, Any] = {f"p{i}": p for i, p in enumerate(snap.params)}
        arrays["__meta__"] = np.array(json.dumps(meta))
        np.savez(buf, **arrays)
        atomic_write(path, buf.getvalue())

    def _restore(self) -> ParamsSnapshot | None:
        if not self.path.exists():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as z:
                meta = json.loads(str(z["__meta__"]))
                params = [z[f"p{i}"] for i in range(len(meta["shapes"]))]
        except Exception as exc:  # noqa: BLE001 - any unreadable file: fall back, loudly
            log.warning("ignoring unreadable %s (%s); starting from the artifact's parameters",
                        self.path, exc)
            return None
        if meta.get("format") != _PARAMS_FORMAT or [tuple(s) for s in meta["shapes"]] != self._shapes \
                or meta.get("names") != list(self.artifact.param_names):
            log.warning("%s belongs to another model layout; starting from the artifact's parameters",
                        self.path)
            return None
        snap = ParamsSnapshot.make(params, meta["version"])
        if snap.sha256 != meta["sha256"]:
            log.warning("%s: sha256 mismatch; starting from the artifact's parameters", self.path)
            return None
        log.info("restored params version %d sha256 %s", snap.version, snap.sha256[:12])
        return snap
