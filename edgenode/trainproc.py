"""A :class:`~edgenode.ports.Trainer` whose training step runs in a child process.

Why: in the node process a round's Python and TVM work share the GIL (and the cores' scheduler
slots at the same process) with the FastAPI inference threads, which pushed the inference p99
during a round to 1.3-8.7x the idle p99 (BENCHMARKS.md "## serve"). The heavy part of a step --
``loss_and_grad`` and ``apply`` on the compiled training module -- runs here in a worker process
(``python -m edgenode.trainproc``: a fresh interpreter, so no TVM threads or locks are inherited
as with fork, and unlike multiprocessing's "spawn" the embedding program's ``__main__`` is never
re-imported) at ``[training] nice`` with ``[training] worker_threads`` TVM threads. The round's control flow
(collectives, two-phase commit, the parameter swap) stays in the node: the node's
:class:`~edgenode.model.ModelHolder` still swaps one immutable snapshot, so serving sees the old or
the new parameters, never a mix, and the worker never touches the committed parameters.

Protocol on a socket pair wrapped in ``multiprocessing.connection.Connection`` (pickled tuples;
arrays travel as pickled numpy buffers, a few hundred KB at most for the zoo models):

    worker -> node   ("ready", pid) once the training module is loaded, or ("error", text)
    node -> worker   ("grad", params, x, y) | ("apply", params, grads, state, lr)
    worker -> node   ("ok", result) | ("error", text)

A worker that dies (killed, out of memory, a crash in native code) or does not answer within
``call_timeout_s`` fails the call with :class:`TrainerWorkerError` naming what happened; the
round fails with that reason (nothing applied, as for any failed round) and a fresh worker is
started at once for the next round. Abort stays "within one step": the round checks the abort
flag between calls, and a call lasts one step.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from edgenode.common import NodeError, get_logger
from edgenode.ports import Trainer

__all__ = ["ProcessTrainer", "TrainerWorkerError"]

log = get_logger("trainproc")
_BOOT_TIMEOUT_S = 120.0  # importing TVM and loading the training module (slow boards, cold caches)


class TrainerWorkerError(NodeError):
    """The training worker process died, hung or could not start."""


class ProcessTrainer:
    """The ``Trainer`` protocol, computed by a worker process that loads ``artifact_dir``'s
    training module. ``local`` (the same module loaded in the node) gives the metadata and is
    the fallback where this Python cannot start a copy of itself (see :meth:`start`)."""

    def __init__(self, artifact_dir: Path, local: Trainer, *, nice: int = 10, threads: int = 1,
                 call_timeout_s: float = 60.0) -> None:
        self.artifact_dir = Path(artifact_dir)
        self._local = local
        self._nice, self._threads = int(nice), int(threads)
        self.call_timeout_s = float(call_timeout_s)
        self._lock = threading.Lock()  # one call at a time; start/stop under it too
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._fallback: str | None = None  # why training runs in the node process instead
        self._closed = False  # set by close(): no restart after the node stopped
        self.restarts = 0  # workers started after one died (tests and /metrics-style checks)

    # -- Trainer protocol ------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return int(self._local.batch)

    @property
    def loss(self) -> str:
        return str(self._local.loss)

    def loss_and_grad(self, params: list[np.ndarray], x: Any,
                      y: np.ndarray) -> tuple[float, list[np.ndarray]]:
        if self._fallback is not None:
            return self._local.loss_and_grad(params, x, y)
        loss, grads = self._call(("grad", _plain(params), x, np.asarray(y)))
        return float(loss), list(grads)

    def init_state(self, params: list[np.ndarray]) -> list[np.ndarray]:
        # No TVM call (zero-filled arrays of the compiled optimizer's state shapes): the node's
        # copy of the module answers, the worker is not needed for it.
        return self._local.init_state(params)

    def apply(self, params: list[np.ndarray], grads: list[np.ndarray], state: list[np.ndarray],
              lr: float | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if self._fallback is not None:
            return self._local.apply(params, grads, state, lr)
        new, st = self._call(("apply", _plain(params), _plain(grads), _plain(state), lr))
        return list(new), list(st)

    # -- the worker ------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The worker's process id while one runs (None before the first start or in fallback)."""
        p = self._proc
        return int(p.pid) if p is not None and p.poll() is None else None

    @property
    def isolated(self) -> bool:
        """False when training fell back to the node process (see :meth:`start`)."""
        return self._fallback is None

    def start(self) -> None:
        """Start the worker if none runs (returns without waiting for it to load the module).

        A Python that cannot execute a copy of itself -- an emulated aarch64 node under qemu-user
        without binfmt_misc gets ENOEXEC -- falls back to training in the node process, once, with
        a warning: the round still works, only without the isolation.
        """
        with self._lock:
            self._closed = False
            self._start_locked()

    def _start_locked(self) -> None:
        if self._closed or self._fallback is not None:
            return
        if self._proc is not None and self._proc.poll() is None:
            return
        self._reap_locked()
        mine, theirs = socket.socketpair()
        # The worker imports this checkout's modules, as the node does (sys.path, not site config).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        cmd = [sys.executable, "-m", "edgenode.trainproc", str(theirs.fileno()), str(self.artifact_dir),
               str(self._nice), str(self._threads)]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)  # a Ctrl-C to the node is the node's
        except OSError as exc:
            mine.close()
            theirs.close()
            self._fallback = f"cannot start a worker process ({sys.executable}): {exc}"
            log.warning("training isolation unavailable: %s; training runs in the node process",
                        self._fallback)
            return
        theirs.close()  # the worker's end lives in the worker only: its death reads as EOF here
        self._proc, self._conn, self._ready = proc, Connection(mine.detach()), False
        log.info("training worker started (pid %d)", proc.pid)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (EOF on its pipe; killed if it does not exit within ``timeout``).

        A call in progress (a round the node is abandoning) fails at once: the worker is killed
        without waiting for the call's lock, and nothing restarts it."""
        self._closed = True
        if not self._lock.acquire(timeout=timeout):
            proc = self._proc
            if proc is not None:
                proc.kill()  # the caller sees the death, raises, and finds us closed
            self._lock.acquire()
        try:
            self._stop_locked(timeout)
        finally:
            self._lock.release()

    def _stop_locked(self, timeout: float) -> None:
        proc, conn = self._proc, self._conn
        if conn is not None:
            conn.close()  # EOF: the worker exits its loop
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self._proc, self._conn, self._ready = None, None, False

    def _reap_locked(self) -> None:
        if self._proc is not None:
            self._stop_locked(1.0)

    def _call(self, msg: tuple[Any, ...]) -> Any:
        with self._lock:
            self._start_locked()
            if self._fallback is not None:  # the start just now found we cannot isolate
                raise TrainerWorkerError(self._fallback)
            if self._proc is None:
                raise TrainerWorkerError("the training worker is stopped (the node is stopping)")
            was_ready = self._ready
            try:
                if not self._ready:
                    self._receive(_BOOT_TIMEOUT_S, "loading the training module")
                    self._ready = True
                assert self._conn is not None
                self._conn.send(msg)
                return self._receive(self.call_timeout_s, f"computing {msg[0]!r}")
            except _RemoteError as exc:  # the step itself raised (e.g. bad shapes): the worker lives on
                raise TrainerWorkerError(f"training worker: {exc}") from None
            except TrainerWorkerError:
                # Dead or hung: kill what is left and boot a fresh worker now, so the next round
                # does not wait for the import; this round fails with the reason. (A worker that
                # never got ready -- a broken module -- is retried at the next call only.)
                self._stop_locked(1.0)
                if was_ready and not self._closed:
                    self.restarts += 1
                    self._start_locked()
                raise

    def _receive(self, timeout: float, doing: str) -> Any:
        conn, proc = self._conn, self._proc
        assert conn is not None and proc is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TrainerWorkerError(f"the training worker (pid {proc.pid}) did not answer within "
                                         f"{timeout:g} s while {doing}; it was killed",
                                         hint="raise [training] step_timeout_s for slow boards")
            if conn.poll(min(left, 0.5)):
                try:
                    kind, *rest = conn.recv()
                except (EOFError, OSError):
                    raise TrainerWorkerError(_death(proc, doing)) from None
                if kind == "error":
                    if not self._ready:  # it could not load the module and exits
                        raise TrainerWorkerError(f"training worker: {rest[0]}")
                    raise _RemoteError(rest[0])
                return rest[0]
            if proc.poll() is not None:  # dead without closing the socket (cannot happen on Linux)
                raise TrainerWorkerError(_death(proc, doing))


class _RemoteError(Exception):
    """A call raised inside the worker (which keeps running)."""


def _death(proc: subprocess.Popen[bytes], doing: str) -> str:
    try:
        code: int | None = proc.wait(2.0)
    except subprocess.TimeoutExpired:
        code = None
    pid = proc.pid
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"the training worker process (pid {pid}) {how} while {doing}"


def _plain(arrays: Any) -> list[np.ndarray]:
    return [np.asarray(a) for a in arrays]


def _worker_main(conn: Connection, artifact_dir: str, nice: int, threads: int) -> None:
    """The worker: load the training module, then answer calls until the socket closes."""
    # Before TVM creates its thread pool (lazily, at the first parallel kernel).
    os.environ["TVM_NUM_THREADS"] = str(max(1, threads))
    if nice > 0:
        try:
            os.nice(max(0, nice - os.nice(0)))
        except OSError:
            pass
    try:
        from compiler import load_artifact  # the node verified every file's sha256 already

        trainer = load_artifact(artifact_dir, verify=False).trainer
        if trainer is None:
            raise NodeError(f"artifact {artifact_dir} has no training module")
    except Exception as exc:  # noqa: BLE001 - reported to the node, which fails the round with it
        conn.send(("error", f"cannot load the training module: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the node closed the pipe (stop) or died
        try:
            op = msg[0]
            if op == "grad":
                loss, grads = trainer.loss_and_grad(msg[1], msg[2], msg[3])
                out: Any = (float(loss), [np.asarray(g) for g in grads])
            elif op == "apply":
                new, state = trainer.apply(msg[1], msg[2], msg[3], lr=msg[4])
                out = ([np.asarray(p) for p in new], [np.asarray(s) for s in state])
            else:
                raise ValueError(f"unknown call {op!r}")
        except Exception as exc:  # noqa: BLE001 - the node turns it into a failed round
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", out))


if __name__ == "__main__":  # python -m edgenode.trainproc FD ARTIFACT_DIR NICE THREADS (ProcessTrainer)
    _fd, _dir, _nice, _threads = sys.argv[1:5]
    _worker_main(Connection(int(_fd)), _dir, int(_nice), int(_threads))
