"""Training off the serving path: a worker process that runs a round's steps and hosts the
node's collective (``[training] isolation = "process"``, the default).

Why: in the node process a round shares the GIL and the node's CPU time with the FastAPI
inference threads, which pushed the inference p99 during a round to 1.3-8.7x the idle p99
(docs/benchmarks-history.md, "## serve"). Moving only the trainer's two calls out (one pipe round
trip each per step) was measured first and did not help the MLP: the node still spent 0.39 ms of
CPU per step on the round's Python, the pickling and the collective, more than the 0.31 ms of a
whole in-thread step. So the boundary is the step loop: the worker runs
:func:`federation.steps.train_steps` (sampler, ``loss_and_grad``, the ring allreduce's numpy work,
``apply``) with its own copy of the training module and the node's
:class:`~federation.ring.RingAllreduce`, whose frames the node only relays between its transport
(MQTT, or the in-memory hub) and the worker. A single-member step costs the node nothing; a
multi-member step costs it the relaying of frames that it did on the round thread before.

What stays in the node (:func:`edgenode.roundphases.run_round`): the round's control flow, the hello,
start-parameter sync, agreement and vote collectives (forwarded to the worker's ring, a few calls
per round), the two-phase commit and the atomic swap of the :class:`~edgenode.model.ModelHolder`
snapshot (serving sees old or new parameters, never a mix; the worker never touches them).

Worker (``python -m edgenode.trainworker FD ...``: a fresh interpreter, so no TVM threads or locks
are inherited as with fork, and unlike multiprocessing's "spawn" the embedding program's
``__main__`` is never re-imported) runs at ``[training] nice`` (or, with ``worker_priority =
"idle"``, in Linux's SCHED_IDLE class: only on an otherwise idle core) with ``worker_threads``
TVM threads.
Messages on a socket pair (``multiprocessing.connection.Connection``, tuples pickled with protocol 5):

    worker -> node  ("ready", pid) | ("frame", dst, bytes) | ("steps", [(step, loss), ...])
                    | ("ok", result) | ("error", exception or None, text)
    node -> worker  ("frame", bytes) | ("cancel", reason) | ("abort",)            (out of band)
                    | ("allreduce", vec, kwargs) | ("broadcast", vec, kwargs) | ("exchange", vec, kwargs)
                    | ("abort_tag", tag, peers, reason) | ("reset_feedback",)
                    | ("steps", plan, node_id, params, samples, rng, contributors)  (one call at a time)

A worker that dies (killed, out of memory, a crash in native code) or falls silent for
``call_timeout_s`` fails the call with :class:`TrainerWorkerError` naming what happened; the round
fails with that reason (nothing applied, as for any failed round) and a fresh worker boots at once
for the next round. Abort stays "within one step": the node forwards it, the loop checks it
before every step. A worker whose node is gone (its socket at EOF: the node closed it, or died)
exits at once, whatever call it was in.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from edgenode.common import freeze_startup_heap, get_logger
from edgenode.errors import NodeError
from federation.transport import Capabilities, Framing, Polled, Transport

__all__ = ["TrainingWorker", "TrainerWorkerError"]

log = get_logger("trainproc")

_BOOT_TIMEOUT_S = 120.0  # importing TVM and loading the training module (slow boards, cold caches)
_REPORT_EVERY_S = 0.1  # step losses travel to the node in batches at most this often
_COLLECTIVE_MARGIN_S = 30.0  # a forwarded collective answers by its own deadline; this is for a hang


def _dumps(msg: tuple[Any, ...]) -> bytes:
    """A relay message pickled with protocol 5: frames (bytearrays with seal room, views of
    received messages) and numpy vectors go in as one buffer copy, where the Connection's default
    protocol 4 copies a bytearray to bytes and rebuilds it through a global lookup on the other
    side. ``Connection.recv`` reads any protocol."""
    return pickle.dumps(msg, protocol=5)


class TrainerWorkerError(NodeError):
    """The training worker process died, hung or could not start."""


class TrainingWorker:
    """The node's :class:`~edgenode.ports.Collective` and :class:`~edgenode.ports.StepRunner`,
    both served by one worker process (see the module docstring). ``transport`` is the node's."""

    def __init__(self, artifact_dir: Path, transport: Transport, *, swarm: str, nice: int = 10,
                 threads: int = 1, idle: bool = False, call_timeout_s: float = 90.0) -> None:
        self.artifact_dir = Path(artifact_dir)
        self.transport = transport
        self.swarm = swarm
        self._nice, self._threads, self._idle = int(nice), int(threads), bool(idle)
        self.call_timeout_s = float(call_timeout_s)
        self._call_lock = threading.Lock()  # one call at a time (the round thread)
        self._send_lock = threading.Lock()  # writers: the round thread, the pump, cancel()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._sock: socket.socket | None = None  # the node's end (``_conn`` reads a dup of it)
        self._inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._ready = False
        self._busy = False
        self._last_heard = 0.0
        self._closed = threading.Event()
        self._pump: threading.Thread | None = None
        self.restarts = 0  # workers booted after one died

    # -- life cycle --------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The worker's process id while one runs."""
        p = self._proc
        return int(p.pid) if p is not None and p.poll() is None else None

    def start(self) -> None:
        """Boot the worker if none runs (returns at once; calls wait for it to load the module).

        Raises :class:`TrainerWorkerError` when this Python cannot execute a copy of itself (an
        emulated aarch64 node under qemu-user without binfmt_misc gets ENOEXEC): the node then
        trains in-thread.
        """
        with self._call_lock:
            self._closed.clear()
            self._boot()
        if self._pump is None or not self._pump.is_alive():
            self._pump = threading.Thread(target=self._pump_frames, name="train-relay-in", daemon=True)
            self._pump.start()

    def _boot(self) -> None:
        if self._closed.is_set() or (self._proc is not None and self._proc.poll() is None):
            return
        mine, theirs = socket.socketpair()
        # The worker imports this checkout's modules, as the node does (sys.path, not site config).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        max_payload = int(self.transport.max_payload)
        # The worker's frames go out on this transport and its frames come in from it: the worker
        # builds and checks frames the way this transport's link wants them (an authenticated
        # link: no CRC check, MAC'd frames carry CRC 0 and need seal room after the frame).
        fmg = self.transport.capabilities.framing
        framing = f"{int(fmg.authenticated)},{int(fmg.crc)},{fmg.room}"
        cmd = [sys.executable, "-m", "edgenode.trainworker", str(theirs.fileno()), str(self.artifact_dir),
               self.transport.member_id, self.swarm, str(max_payload), str(self._nice), str(self._threads),
               "idle" if self._idle else "nice", framing]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)  # a Ctrl-C to the node is the node's
        except OSError as exc:
            mine.close()
            theirs.close()
            raise TrainerWorkerError(f"cannot start a training worker process ({sys.executable}): {exc}",
                                     hint='set [training] isolation = "thread"') from None
        theirs.close()  # the worker's end lives in the worker only: its death reads as EOF here
        conn = Connection(os.dup(mine.fileno()))
        self._inbox = queue.Queue()
        self._proc, self._conn, self._sock = proc, conn, mine
        self._ready, self._last_heard = False, time.monotonic()
        threading.Thread(target=self._read, args=(conn, self._inbox), name="train-relay-out",
                         daemon=True).start()
        log.info("training worker started (pid %d)", proc.pid)

    def wait_ready(self) -> int:
        """Block until the worker has loaded the training module (booting it if needed); its pid."""
        self._call(None)
        assert self._proc is not None
        return int(self._proc.pid)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (EOF on its socket; killed if it does not exit within ``timeout``).
        A call in progress fails at once; nothing restarts the worker afterwards."""
        self._closed.set()
        proc = self._proc
        if not self._call_lock.acquire(timeout=timeout):
            if proc is not None:
                proc.kill()  # the waiting call sees the death and raises
            self._call_lock.acquire()
        try:
            self._stop(timeout)
        finally:
            self._call_lock.release()
        if self._pump is not None:
            self._pump.join(timeout)

    def _stop(self, timeout: float) -> None:
        proc, conn, sock = self._proc, self._conn, self._sock
        self._proc, self._conn, self._sock, self._ready = None, None, None, False
        if sock is not None:
            # shutdown, not just close: our reader thread is blocked in recv on this socket, and a
            # close would neither wake it nor send the worker its EOF.
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if conn is not None:
            with self._send_lock:
                conn.close()  # the worker reads EOF and leaves its loop
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)

    # -- relaying -----------------------------------------------------------------------------------
    def _send(self, msg: tuple[Any, ...]) -> bool:
        conn = self._conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.send_bytes(_dumps(msg))
            return True
        except (OSError, ValueError):  # closed, or the worker died: the reader reports it
            return False

    def _pump_frames(self) -> None:
        """Node transport -> worker. A frame that arrives while no worker runs is dropped: the
        sender's session retransmits it (or the round it belongs to has failed anyway)."""
        while not self._closed.is_set():
            try:
                buf = self.transport.recv(0.05)
            except Exception as exc:  # noqa: BLE001 - a closed transport ends the relay
                log.debug("relay stops: %s", exc)
                return
            if buf is not None:  # a view into the received message: pickled straight from it
                self._send(("frame", buf if isinstance(buf, bytes) else pickle.PickleBuffer(buf)))

    def _read(self, conn: Connection, inbox: queue.Queue[tuple[Any, ...]]) -> None:
        """Worker -> node: frames go out on the transport here; everything else to the caller."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                inbox.put(("dead",))
                return
            self._last_heard = time.monotonic()
            if msg[0] == "frame":
                try:
                    self.transport.send(msg[1], msg[2])
                except Exception as exc:  # noqa: BLE001 - like a lost frame: the session retransmits
                    log.warning("relay to %s failed: %s", msg[1], exc)
            else:
                inbox.put(msg)

    # -- Collective --------------------------------------------------------------------------------
    def allreduce(self, vec: np.ndarray, *, group: list[str], tag: str, op: Any = "mean",
                  timeout: float = 30.0, compression: Any = "none",
                  clip_norm: float | None = None, claims: np.ndarray | None = None,
                  screen: Any = None, algorithm: str = "auto") -> np.ndarray:
        kw = {"group": list(group), "tag": tag, "op": op, "timeout": timeout, "compression": compression,
              "clip_norm": clip_norm, "claims": claims, "screen": screen, "algorithm": algorithm}
        out = self._call(("allreduce", np.asarray(vec), kw), silence=timeout + _COLLECTIVE_MARGIN_S)
        return np.asarray(out)

    def exchange(self, vec: np.ndarray, *, group: list[str], tag: str, timeout: float = 30.0,
                 compression: Any = "none") -> np.ndarray:
        kw = {"group": list(group), "tag": tag, "timeout": timeout, "compression": compression}
        out = self._call(("exchange", np.asarray(vec), kw), silence=timeout + _COLLECTIVE_MARGIN_S)
        return np.asarray(out)

    def broadcast(self, vec: np.ndarray | None, *, root: str, group: list[str], tag: str,
                  timeout: float = 30.0) -> np.ndarray:
        kw = {"root": root, "group": list(group), "tag": tag, "timeout": timeout}
        arr = None if vec is None else np.asarray(vec)
        return np.asarray(self._call(("broadcast", arr, kw), silence=timeout + _COLLECTIVE_MARGIN_S))

    def reset_feedback(self) -> None:
        if not self._ready:  # a worker that is not up yet (or a fresh one) has no residuals
            return
        try:
            self._call(("reset_feedback",))
        except TrainerWorkerError as exc:  # it died: its successor starts without residuals anyway
            log.warning("reset_feedback: %s", exc)

    def abort(self, tag: str, peers: list[str], reason: str) -> None:
        try:
            self._call(("abort_tag", tag, list(peers), reason))
        except TrainerWorkerError as exc:  # best effort, as a lost ABORT frame: peers time out
            log.warning("could not tell peers that %s is void: %s", tag, exc)

    def cancel(self, reason: str) -> bool:
        """Fail the collective running in the worker now (out of band: no waiting)."""
        busy = self._busy
        self._send(("cancel", reason))
        return busy

    # -- StepRunner --------------------------------------------------------------------------------
    def run_steps(self, plan: Any, *, node_id: str, params: list[np.ndarray], samples: Any,
                  rng: np.random.Generator, contributors: list[bool], abort: Any,
                  on_step: Callable[[int, float], None] | None = None
                  ) -> tuple[list[np.ndarray], list[float], dict[str, str]]:
        msg = ("steps", plan, node_id, [np.asarray(p) for p in params], samples, rng, list(contributors))
        new, losses, excluded = self._call(msg, abort=abort, on_step=on_step)
        return list(new), list(losses), dict(excluded)

    # -- calls -------------------------------------------------------------------------------------
    def _call(self, msg: tuple[Any, ...] | None, *, abort: threading.Event | None = None,
              on_step: Callable[[int, float], None] | None = None, silence: float | None = None) -> Any:
        with self._call_lock:
            if self._closed.is_set():
                raise TrainerWorkerError("the training worker is stopped (the node is stopping)")
            self._boot()
            proc = self._proc
            assert proc is not None
            was_ready = self._ready
            self._busy = True
            try:
                if not self._ready:
                    # The load window opens now, not at the worker's boot: a worker booted at node start
                    # at SCHED_IDLE gets no CPU while its node starts (minutes on an emulated board)
                    # and is slow, not hung, when the first round comes.
                    self._last_heard = max(self._last_heard, time.monotonic())
                    self._wait(proc, _BOOT_TIMEOUT_S, "loading the training module")
                    self._ready = True
                if msg is None:  # wait_ready
                    return None
                self._last_heard = time.monotonic()
                if not self._send(msg):
                    raise TrainerWorkerError(_death(proc, f"receiving {msg[0]!r}"))
                return self._wait(proc, silence or self.call_timeout_s, f"running {msg[0]!r}", abort, on_step)
            except TrainerWorkerError:
                # Dead or hung: kill what is left and boot a fresh worker now, so the next round does
                # not wait for the import; this round fails with the reason. (A worker that never got
                # ready, e.g. a broken module, is retried at the next call only.)
                self._stop(1.0)
                if was_ready and not self._closed.is_set():
                    self.restarts += 1
                    self._boot()
                raise
            finally:
                self._busy = False

    def _wait(self, proc: subprocess.Popen[bytes], silence: float, doing: str,
              abort: threading.Event | None = None,
              on_step: Callable[[int, float], None] | None = None) -> Any:
        """The reply to the current call. Step reports are handed to ``on_step`` on this thread;
        ``abort`` is forwarded once; ``silence`` s without a word from the worker kill it."""
        told = False
        while True:
            if abort is not None and not told and abort.is_set():
                told = self._send(("abort",))
            try:
                kind, *rest = self._inbox.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() - self._last_heard > silence:
                    proc.kill()
                    raise TrainerWorkerError(f"the training worker (pid {proc.pid}) said nothing for "
                                             f"{silence:g} s while {doing}; it was killed",
                                             hint="raise [training] step_timeout_s for slow boards") from None
                continue
            if kind == "steps":
                if on_step is not None:
                    for step, loss in rest[0]:
                        on_step(step, loss)
            elif kind == "ok" or kind == "ready":
                return rest[0]
            elif kind == "error":
                exc, text = rest
                if not self._ready:  # it could not load the module and exits
                    raise TrainerWorkerError(f"training worker: {text}")
                if isinstance(exc, Exception):
                    raise exc  # the ring's RoundAborted (naming a member), the loop's RoundFailed, ...
                raise NodeError(f"training worker: {text}")
            elif kind == "dead":
                raise TrainerWorkerError(_death(proc, doing))


def _death(proc: subprocess.Popen[bytes], doing: str) -> str:
    try:
        code: int | None = proc.wait(2.0)
    except subprocess.TimeoutExpired:
        code = None
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"the training worker process (pid {proc.pid}) {how} while {doing}"


# -- the worker process ---------------------------------------------------------------------------
class _RelayTransport(Polled):
    """The worker's side of the node's transport: frames travel over the socket pair."""

    def __init__(self, member_id: str, max_payload: int, send: Callable[[tuple[Any, ...]], None], *,
                 framing: Framing = Framing()) -> None:
        self.member_id, self.max_payload, self._send = member_id, max_payload, send
        # the node's transport's framing: the worker's frame layer builds and checks frames alike
        self.capabilities = Capabilities(framing=framing)
        self.inbox: queue.Queue[bytes] = queue.Queue()

    def send(self, dst: str, payload: bytes | bytearray) -> None:
        # a bytearray carries the seal room after the frame (pickle keeps the type)
        self._send(("frame", dst, payload if isinstance(payload, bytearray) else bytes(payload)))

    def recv(self, timeout: float) -> bytes | None:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


class _Reporter:
    """Batches (step, loss) for the node: one message per ``_REPORT_EVERY_S`` and at the end."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        self._send, self._last = send, time.monotonic()
        self._pending: list[tuple[int, float]] = []

    def __call__(self, step: int, loss: float) -> None:
        self._pending.append((int(step), float(loss)))
        if time.monotonic() - self._last >= _REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._send(("steps", self._pending))
            self._pending, self._last = [], time.monotonic()


def _picklable(exc: Exception) -> Exception | None:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - the text still travels
        return None


def _worker_main(conn: Connection, artifact_dir: str, member_id: str, swarm: str, max_payload: int,
                 nice: int, threads: int, idle: bool, framing: str = "0,1,0") -> None:
    """Load the training module, host the member's ring, answer calls until the socket closes."""
    os.environ["TVM_NUM_THREADS"] = str(max(1, threads))  # before TVM creates its pool (lazily)
    if nice > 0:
        try:
            os.nice(max(0, nice - os.nice(0)))
        except OSError:
            pass
    if idle:  # Linux SCHED_IDLE: runs only on an otherwise idle core; serving always goes first
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError) as exc:
            print(f"training worker: cannot use SCHED_IDLE ({exc}); nice {nice} only", file=sys.stderr)
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send_bytes(_dumps(msg))

    try:
        from compiler import load_artifact  # the node verified every file's sha256 already
        from federation.ring import RingAllreduce
        from federation.steps import train_steps

        trainer = load_artifact(artifact_dir, verify=False).trainer
        if trainer is None:
            raise NodeError(f"artifact {artifact_dir} has no training module")
    except Exception as exc:  # noqa: BLE001 - reported to the node, which fails the round with it
        send(("error", None, f"cannot load the training module: {type(exc).__name__}: {exc}"))
        return
    freeze_startup_heap()  # TVM and the training module: never traversed by a full GC mid-round
    auth, crc, room = (int(v) for v in framing.split(","))
    relay = _RelayTransport(member_id, max_payload, send,
                            framing=Framing(authenticated=bool(auth), crc=bool(crc), room=room))
    ring = RingAllreduce(relay, swarm=swarm)
    calls: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
    abort = threading.Event()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                # The node closed us or died (SIGKILL, OOM). Nothing here outlives it (the node owns
                # every file and decision) and a call in progress may wait on peers for a whole
                # collective deadline, or, at SCHED_IDLE on a busy machine, take long to unwind:
                # leave now rather than linger as an orphan.
                sys.stderr.flush()
                os._exit(0)
            kind = msg[0]
            if kind == "frame":
                relay.inbox.put(msg[1])
            elif kind == "cancel":
                # The node cancels only an aborted round. Set the abort first: the node's own
                # ("abort",) message comes later (its waiting loop polls), and a step failed by the
                # cancel must know it was an abort, so that it also voids the next step's tag for
                # peers that already finished this one (else they wait for the step deadline).
                abort.set()
                ring.cancel(msg[1])
            elif kind == "abort":
                abort.set()
            else:
                if kind == "steps":
                    abort.clear()  # here, in order: an abort sent after this call stays set
                calls.put(msg)

    threading.Thread(target=read, name="relay", daemon=True).start()
    send(("ready", os.getpid()))
    while (msg := calls.get()) is not None:
        try:
            op = msg[0]
            out: Any = None
            if op == "allreduce":
                out = ring.allreduce(msg[1], **msg[2])
            elif op == "broadcast":
                out = ring.broadcast(msg[1], **msg[2])
            elif op == "exchange":
                out = ring.exchange(msg[1], **msg[2])
            elif op == "abort_tag":
                ring.abort(msg[1], msg[2], msg[3])
            elif op == "reset_feedback":
                ring.reset_feedback()
            elif op == "steps":
                plan, node_id, params, samples, rng, contributors = msg[1:]
                report = _Reporter(send)
                out = train_steps(plan, node_id=node_id, trainer=trainer, params=params, samples=samples,
                                  ring=ring, rng=rng, contributors=contributors, abort=abort,
                                  on_step=report)
                report.flush()
            else:
                raise ValueError(f"unknown call {op!r}")
        except Exception as exc:  # noqa: BLE001 - the node raises it in the round
            send(("error", _picklable(exc), f"{type(exc).__name__}: {exc}"))
            continue
        send(("ok", out))
    ring.close()


if __name__ == "__main__":  # FD ARTIFACT MEMBER SWARM MAX_PAYLOAD NICE THREADS nice|idle AUTH,CRC,ROOM
    from fractal.heap import tune_allocator

    tune_allocator()  # the worker encodes and decodes every ring frame of the node
    _a = sys.argv[1:10]
    _worker_main(Connection(int(_a[0])), _a[1], _a[2], _a[3], int(_a[4]), int(_a[5]), int(_a[6]),
                 _a[7] == "idle", *_a[8:9])
