"""The int8 library a node serves, rebuilt from its float parameters after every commit.

Training stays float: rounds average and commit float parameters (:mod:`edgenode.model`). A node
whose artifact was compiled with ``--train --quantize int8`` (manifest ``quantization``) and whose
``[inference] precision`` is int8 (or auto) serves its inference requests from an int8 library
instead, which is a function of those parameters. After each commit (a round, an async merge, a
rollback) :class:`Int8Serving` rebuilds it:

1. the committed snapshot is written to ``data_dir/int8/.params-V.npz``;
2. a child process (``python -m edgenode.requantize``: it imports TVM and onnxruntime, ~400 MB
   that the serving process must not carry for a job of seconds) writes the snapshot into the
   artifact's float model, quantizes it calibrated on the node's newest stored samples
   (:mod:`edgenode.calibration`) with the artifact's settings and compiles it for the artifact's
   preset (:func:`compiler.requantize.requantize`) into ``data_dir/int8/vV-SHA12`` (atomically:
   a killed build leaves only a hidden temporary, removed before the next build);
3. the node loads it (every sha256 checked), runs one input through it (finite outputs, the float
   model's names and shapes), then swaps the reference inference reads and records it in
   ``data_dir/int8/current.json`` (atomic), so that a restart with the same artifact (its
   manifest's sha256) serves the same library.

Until the swap, requests are served by the previous int8 library (built from an older version:
stale by a round, never half-built); the status's ``inference`` says which version and sha256 the
serving library was built from, and whether a rebuild is running or failed. A failure (the child
dies, is killed, the store holds too few samples, the library does not load) keeps the previous
library and is reported; the next commit tries again. A commit arriving mid-build does not stop
the build: its library is swapped in (newer than the one serving) and the next build starts at
once. Parameters equal to the artifact's shipped ones (a rollback to version 0) take the
artifact's own int8 library without a build.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import Counter, Gauge

from compiler.errors import InputError
from compiler.manifest import MANIFEST, file_sha256
from edgenode.common import get_logger, params_sha256
from edgenode.errors import InvalidInput, NodeError
from edgenode.model import ModelHolder, ParamsSnapshot
from federation.messages import InferenceInfo, Int8State, Precision
from fractal.files import atomic_write

if TYPE_CHECKING:
    from compiler.artifact import Artifact

__all__ = ["Int8Serving", "BuildPriority", "INT8_DIR", "main"]

log = get_logger("int8")
INT8_DIR = "int8"  # in the node's data_dir: the rebuilt libraries and current.json
_CURRENT = "current.json"
_ERROR_MAX = 300


class BuildPriority(enum.StrEnum):
    NICE = "nice"
    IDLE = "idle"


@dataclass(frozen=True)
class _Served:
    """One int8 library and the committed parameters it was built from (swapped as a whole)."""

    engine: Artifact
    version: int
    sha256: str
    directory: Path | None  # None: the artifact's own library (built from the shipped parameters)


class Int8Serving:
    """The int8 inference of a node (see the module docstring). ``artifact_dir``: the node's
    ``--train --quantize int8`` artifact; ``shipped``: its parameters (version 0)."""

    def __init__(self, artifact_dir: Path, library: Artifact, shipped: list[np.ndarray], model: ModelHolder,
                 data_dir: Path, *, calibration_samples: int, publish: Callable[[], Any],
                 registry: Any, nice: int = 19, priority: BuildPriority = BuildPriority.IDLE,
                 threads: int = 1) -> None:
        self.artifact_dir = Path(artifact_dir)
        self.model = model
        self.root = Path(data_dir) / INT8_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        self.calibration_samples = int(calibration_samples)
        self._publish = publish
        self._nice, self._priority, self._threads = int(nice), priority, int(threads)
        self._shipped = _Served(library, 0, params_sha256(shipped), None)
        # which artifact the rebuilt libraries belong to: a new artifact in the same data_dir
        # (another model, other settings) must not be served a library of the old one
        self._artifact_id = file_sha256(self.artifact_dir / MANIFEST)
        self._served = self._restore() or self._shipped
        self._state = Int8State.CURRENT
        self._error: str | None = None
        self._build_s: float | None = None
        self._wanted = threading.Event()
        self._stopping = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.builds_ok = 0
        self.builds_failed = 0
        self._builds = Counter("fractal_node_int8_rebuilds", "Int8 library rebuilds after a commit, by "
                               "result", ["result"], registry=registry)
        Gauge("fractal_node_int8_built_from_version", "Committed parameter version the serving int8 library "
              "was built from", registry=registry).set_function(lambda: self._served.version)
        self._build_gauge = Gauge("fractal_node_int8_rebuild_seconds", "Wall time of the last int8 rebuild "
                                  "(quantize + compile + load)", registry=registry)

    # -- serving -----------------------------------------------------------------------------------
    def infer(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the serving int8 library (one reference read: a swap never splits a request)."""
        served = self._served
        try:
            return served.engine.infer(dict(inputs))
        except InputError as exc:
            raise InvalidInput(str(exc), hint=exc.hint) from exc

    @property
    def built_from(self) -> tuple[int, str]:
        """(version, params sha256) of the committed parameters the serving library was built from."""
        s = self._served
        return s.version, s.sha256

    @property
    def library_dir(self) -> Path:
        """The serving library's artifact directory."""
        s = self._served
        return s.directory if s.directory is not None else self.artifact_dir / "int8"

    @property
    def state(self) -> Int8State:
        return self._state

    @property
    def pid(self) -> int | None:
        """The rebuild's child process id while one runs."""
        p = self._proc
        return int(p.pid) if p is not None and p.poll() is None else None

    def info(self) -> InferenceInfo:
        s = self._served
        return InferenceInfo(precision=Precision.INT8, built_from_version=s.version,
                             built_from_sha256=s.sha256, int8_state=self._state, build_s=self._build_s,
                             error=self._error)

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the builder; builds at once when the committed parameters are not the served ones."""
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="int8-build", daemon=True)
        self._thread.start()
        self.params_changed()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the builder, killing a rebuild in progress (the served library stays)."""
        self._stopping.set()
        self._wanted.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        if self._thread is not None:
            self._thread.join(timeout)

    def params_changed(self) -> None:
        """A commit (round, merge, rollback): rebuild for the new parameters."""
        self._wanted.set()

    # -- building -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wanted.wait()
            self._wanted.clear()
            if self._stopping.is_set():
                return
            snap = self.model.snapshot
            if snap.sha256 == self._served.sha256:
                self._state = Int8State.CURRENT
                continue
            if snap.sha256 == self._shipped.sha256:  # e.g. a rollback to version 0: no build
                self._swap(_Served(self._shipped.engine, snap.version, snap.sha256, None))
                continue
            self._state, self._error = Int8State.BUILDING, None
            self._publish()
            t0 = time.perf_counter()
            try:
                served = self._build(snap)
            except Exception as exc:  # noqa: BLE001 - any failure keeps the served library
                if self._stopping.is_set():
                    return
                self._state, self._error = Int8State.FAILED, str(exc)[:_ERROR_MAX]
                self.builds_failed += 1
                self._builds.labels(result="failed").inc()
                log.warning("int8 rebuild for params version %d failed (serving the library built from "
                            "version %d): %s", snap.version, self._served.version, exc)
                self._publish()
                continue
            self._build_s = round(time.perf_counter() - t0, 3)
            self._build_gauge.set(self._build_s)
            self.builds_ok += 1
            self._builds.labels(result="ok").inc()
            self._swap(served)
            log.info("int8 library rebuilt for params version %d in %.1f s", snap.version, self._build_s)
            if self.model.sha256 != snap.sha256:
                self._wanted.set()  # a commit arrived during the build: build again

    def _swap(self, served: _Served) -> None:
        old = self._served
        record = {"dir": served.directory.name if served.directory is not None else None,
                  "version": served.version, "sha256": served.sha256, "artifact": self._artifact_id}
        try:  # recorded first: a restart from here on serves the new library
            atomic_write(self.root / _CURRENT, json.dumps(record).encode())
        except OSError as exc:  # serving the new library all the same; a restart builds again
            log.warning("could not record the int8 library in %s: %s", self.root / _CURRENT, exc)
        self._served = served
        self._state = Int8State.CURRENT if served.sha256 == self.model.sha256 else Int8State.BUILDING
        if old.directory is not None and old.directory != served.directory:
            # in-flight requests keep the old library mapped; its files may go
            shutil.rmtree(old.directory, ignore_errors=True)
        self._publish()

    def _clean(self, keep: Path | None) -> None:
        """Remove what killed or failed builds left (hidden temporaries, params files, libraries no
        record names)."""
        for p in self.root.iterdir():
            if p.name == _CURRENT or p == keep:
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def _build(self, snap: ParamsSnapshot) -> _Served:
        self._clean(self._served.directory)
        params = self.root / f".params-{snap.version}.npz"
        np.savez(params, **{f"p{i:04d}": p for i, p in enumerate(snap.params)})  # type: ignore[arg-type]
        out = self.root / f"v{snap.version}-{snap.sha256[:12]}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
               "TVM_NUM_THREADS": str(self._threads)}
        cmd = [sys.executable, "-m", "edgenode.requantize", str(self.artifact_dir), str(params),
               str(self.model.path.parent), str(self.calibration_samples), str(out), str(self._nice),
               self._priority.value]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, env=env, start_new_session=True)
        except OSError as exc:
            raise NodeError(f"cannot start the int8 rebuild ({sys.executable}): {exc}") from None
        self._proc = proc
        if self._stopping.is_set():  # stop() came between the start and the line above
            proc.kill()
        try:
            _, err = proc.communicate()
        finally:
            self._proc = None
            params.unlink(missing_ok=True)
        if proc.returncode != 0:
            lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
            why = lines[-1] if lines else ""
            how = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
                   else f"exited with code {proc.returncode}")
            raise NodeError(f"the int8 rebuild (pid {proc.pid}) {how}" + (f": {why}" if why else ""))
        return _Served(self._load(out), snap.version, snap.sha256, out)

    def _load(self, directory: Path) -> Artifact:
        """Load a rebuilt library and check it serves what the float model serves (names, shapes)
        with finite outputs on one input of zeros; NodeError otherwise."""
        from compiler import load_artifact

        lib = load_artifact(directory)
        ref = self._shipped.engine
        def specs(a: Artifact) -> list[tuple[str, tuple[int, ...], str]]:
            return [(s.name, s.shape, s.dtype) for s in a.inputs] + [(s.name, s.shape, "") for s in a.outputs]

        if specs(lib) != specs(ref):
            raise NodeError(f"the rebuilt int8 library in {directory} has other inputs or outputs than the "
                            "artifact's")
        probe = {s.name: np.zeros((1, *s.shape[1:]) if lib.batched else s.shape, s.dtype) for s in lib.inputs}
        outs = lib.infer(probe)
        if not all(np.isfinite(v).all() for v in outs.values()):
            raise NodeError(f"the rebuilt int8 library in {directory} gives non-finite outputs")
        return lib

    def _restore(self) -> _Served | None:
        """The library current.json names, if it still loads; None: the artifact's own."""
        path = self.root / _CURRENT
        if not path.is_file():
            return None
        try:
            rec = json.loads(path.read_text())
            if rec.get("dir") is None:
                return None
            if rec.get("artifact") != self._artifact_id:
                raise NodeError("it was built for another artifact")
            directory = self.root / str(rec["dir"])
            return _Served(self._load(directory), int(rec["version"]), str(rec["sha256"]), directory)
        except Exception as exc:  # noqa: BLE001 - anything unreadable: the artifact's own, and rebuild
            log.warning("ignoring the int8 library recorded in %s (%s); serving the artifact's own",
                        path, exc)
            return None


# -- the child process ---------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """``python -m edgenode.requantize ARTIFACT PARAMS.npz DATA_DIR SAMPLES OUT NICE nice|idle``:
    rebuild the int8 library of ARTIFACT from the float parameters in PARAMS.npz, calibrated on the
    newest SAMPLES stored in DATA_DIR, into OUT. Errors: one line on stderr, exit 1."""
    artifact, params_file, data_dir, samples, out, nice, priority = argv
    if int(nice) > 0:
        try:
            os.nice(max(0, int(nice) - os.nice(0)))
        except OSError:
            pass
    if priority == BuildPriority.IDLE:  # Linux SCHED_IDLE: only on an otherwise idle core
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
    from compiler.requantize import requantize
    from edgenode.calibration import open_store, store_calibration
    from fractal import FractalError

    try:
        with np.load(params_file, allow_pickle=False) as z:
            params = [z[k] for k in sorted(z.files)]
        store = open_store(data_dir)
        try:
            cal = store_calibration(store, int(samples))
        finally:
            store.close()
        requantize(artifact, params, cal, out)
    except FractalError as exc:
        print(f"{exc}" + (f" (help: {exc.hint})" if exc.hint else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
