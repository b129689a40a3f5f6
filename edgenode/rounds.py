"""Round control of an edge node: commands in, one training round at a time on a worker
thread, STEP/DONE/FAILED events out. Mixed into :class:`edgenode.node.EdgeNode`, which owns
the state declared below (the model, the store, the collective, the link and the metrics).
"""

from __future__ import annotations

import collections
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ValidationError

from edgenode.anomaly import AnomalyScorer, evaluate_anomaly
from edgenode.common import InvalidInput, NodeBusy, NodeError, RoundFailed, SeenIds, get_logger
from edgenode.config import NodeConfig
from edgenode.faults import Faults
from edgenode.metrics import NodeMetrics
from edgenode.model import ModelHolder, ParamsSnapshot
from edgenode.ports import Collective, Engine, Link, Publication, StepRunner, Trainer
from edgenode.store import Samples, SampleStore
from edgenode.training import RoundPlan, RoundResult, run_round
from edgenode.validation import evaluate
from federation import topics
from federation.hierarchy import HierarchicalCollective, Topology
from federation.messages import (
    AnyCommand,
    EventKind,
    ImageRollbackCommand,
    ImageUpdateCommand,
    NodeState,
    RollbackCommand,
    RoundAbort,
    RoundCommand,
    RoundEvent,
    Validation,
    parse_command,
)
from federation.ring import RingAllreduce

__all__ = ["SEEN_ROUNDS_KEPT", "RoundControl", "load_seen_rounds", "save_seen_rounds"]

log = get_logger("agent")
_STEP_EVENT_MIN_S = 0.25  # STEP events are throttled: a 1000-step round must not flood the broker


SEEN_ROUNDS_KEPT = 256
_SEEN_FILE = "rounds-seen.json"


def load_seen_rounds(data_dir: Path) -> collections.OrderedDict[str, None]:
    """The ids of the rounds this node started (newest last), as :func:`save_seen_rounds` left
    them; empty if there is no such file or it cannot be read (logged)."""
    return SeenIds(data_dir / _SEEN_FILE, SEEN_ROUNDS_KEPT).ids


def save_seen_rounds(data_dir: Path, seen: collections.OrderedDict[str, None]) -> None:
    """Keep the ids of the rounds this node started across restarts: a round.start captured off
    the broker and replayed after a restart (fresh enough for the signature's replay window,
    which a new process starts empty) must not run a round a second time. Durable (atomic
    write); a node whose data directory refuses writes still runs (logged; its round fails at
    the commit anyway)."""
    SeenIds(data_dir / _SEEN_FILE, SEEN_ROUNDS_KEPT, seen).save()


class RoundControl:
    """Commands and rounds. The node provides the attributes and ``publish_status``."""

    config: NodeConfig
    artifact: Engine
    model: ModelHolder
    store: SampleStore
    metrics: NodeMetrics
    trainer: Trainer | None
    anomaly: AnomalyScorer | None  # a reconstruction model's scorer (edgenode/anomaly.py)
    _refit: threading.Event  # set: recompute the anomaly threshold
    _steps: StepRunner | None  # the training worker process ([training] isolation = "process")
    _ring: Collective | None
    _backbone: RingAllreduce | None  # the site leaders' ring of hierarchical rounds (thread isolation)
    faults: Faults
    _link: Link | None
    _lock: threading.Lock
    _state: NodeState
    _round_id: str | None
    _worker: threading.Thread | None
    _abort: threading.Event
    _stopping: threading.Event
    _seen_rounds: collections.OrderedDict[str, None]
    _listeners: list[Callable[[RoundEvent], None]]
    last_result: RoundResult | None
    last_error: str | None
    validation: Validation | None

    if TYPE_CHECKING:  # provided by ImageControl (first in EdgeNode's bases)
        def first_time(self, command_id: str) -> bool: ...

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def publish_status(self) -> Publication | None:
        raise NotImplementedError

    def handle_image_command(self, cmd: ImageUpdateCommand | ImageRollbackCommand) -> None:
        raise NotImplementedError  # edgenode.updates.ImageControl

    def round_busy(self) -> bool:
        """A round's worker thread is running."""
        w = self._worker
        return w is not None and w.is_alive()

    # -- commands ----------------------------------------------------------------------------------
    def add_event_listener(self, fn: Callable[[RoundEvent], None]) -> None:
        """Call ``fn(event)`` for every RoundEvent this node emits (also published over MQTT)."""
        self._listeners.append(fn)

    def _on_command_message(self, topic: str, payload: bytes) -> None:
        self.handle_command(payload)

    def handle_command(self, command: bytes | str | AnyCommand) -> None:
        """Handle one command (non-blocking). Malformed payloads are rejected and counted."""
        if not isinstance(command, BaseModel):
            try:
                command = parse_command(command)
            except (ValidationError, ValueError) as exc:
                self.metrics.rejected()
                log.warning("rejected malformed command: %s", str(exc).splitlines()[0])
                return
        if isinstance(command, RoundAbort):
            if command.round_id == self._round_id:
                log.info("round %s: abort requested (%s)", command.round_id, command.reason)
                self._abort.set()
                # Also fail the collective we may be blocked in (e.g. waiting for a participant
                # that never comes, up to step_timeout_s): freed now, peers told by ABORT frames.
                if self._ring is not None:
                    self._ring.cancel(f"aborted by the fleet: {command.reason}")
                if self._backbone is not None:
                    self._backbone.cancel(f"aborted by the fleet: {command.reason}")
            return
        if isinstance(command, RollbackCommand):
            if self.node_id in command.nodes and self.first_time(command.rollback_id):
                self.rollback(command.to_version, command.rollback_id)
            return
        if isinstance(command, (ImageUpdateCommand, ImageRollbackCommand)):
            self.handle_image_command(command)
            return
        if self.node_id not in command.participants:
            return
        try:
            topics.validate_id(command.round_id, "round id")
        except ValueError as exc:
            self.metrics.rejected()
            log.warning("rejected command: %s", exc)
            return
        if command.round_id in self._seen_rounds:  # QoS 1 redelivery: already run (or running)
            log.info("ignoring duplicate command for round %s", command.round_id)
            return
        try:
            self.start_round(command)
        except NodeBusy as exc:
            self.metrics.rejected()
            self._emit(RoundEvent(kind=EventKind.FAILED, round_id=command.round_id, node_id=self.node_id,
                                  reason=str(exc)))
        except NodeError as exc:
            self._emit(RoundEvent(kind=EventKind.FAILED, round_id=command.round_id, node_id=self.node_id,
                                  reason=str(exc)))

    def rollback(self, to_version: int, rollback_id: str = "") -> bool:
        """Return to the kept parameter ``to_version`` (a fleet rollback); False, logged, when the
        node cannot (busy with a round, version not kept). The new status tells the fleet."""
        w = self._worker
        if w is not None and w.is_alive() and w is not threading.current_thread():
            # The fleet rolls a round back as soon as every DONE event arrived: this node's worker
            # may still be publishing its status. Give it the time a step may take.
            w.join(self.config.training.step_timeout_s)
        with self._lock:
            if self._worker is not None and self._worker.is_alive():
                log.warning("rollback %s refused: round %s is running", rollback_id, self._round_id)
                self.metrics.rejected()
                return False
            try:
                snap = self.model.rollback(to_version)
            except NodeError as exc:
                log.warning("rollback %s to version %d refused: %s", rollback_id, to_version, exc)
                self.last_error = str(exc)
                ok = False
            else:
                ok = True
        if ok:
            self.validation = self._evaluate(snap, self._validation_samples())
            self._refit.set()
        self.publish_status()
        return ok

    def _validation_samples(self) -> Samples:
        tcfg = self.config.training
        budget = int(tcfg.round_memory_mb * 1024 * 1024) // max(1, self.store.sample_bytes)
        # an anomaly model is scored on every validation sample (AUC on the labelled ones); a
        # supervised model only on the samples whose label is known
        which = "any" if self.anomaly is not None else "known"
        return self.store.snapshot(limit=max(1, budget), part="val", share=tcfg.validation_share,
                                   which=which)

    def _evaluate(self, snap: ParamsSnapshot, samples: Samples) -> Validation | None:
        """Loss/accuracy of ``snap`` on ``samples``; None without a training module or samples."""
        if self.trainer is None or not len(samples):
            return None
        out = self.artifact.outputs[0].name
        params = snap.prepared if snap.prepared is not None else list(snap.params)
        try:
            if self.anomaly is not None:
                return evaluate_anomaly(lambda x: self.artifact.infer(x, params=params)[out], samples,
                                        self.anomaly.input_name, version=snap.version)
            return evaluate(lambda x: self.artifact.infer(x, params=params)[out], samples,
                            loss=self.trainer.loss, version=snap.version)
        except Exception as exc:  # noqa: BLE001 - a failed evaluation must not fail the round
            log.warning("validation failed: %s", exc)
            return None

    def start_round(self, cmd: RoundCommand) -> threading.Thread:
        """Run ``cmd`` on the worker thread; raises NodeBusy if a round is running."""
        w = self._worker
        if w is not None and w.is_alive() and self._round_id is None:
            # The previous round already ended (its DONE/FAILED event is out, so the fleet may
            # start the next one at once); its worker is only publishing the status.
            w.join(5.0)
        with self._lock:
            if cmd.round_id in self._seen_rounds:  # QoS 1 redelivery of a command we already ran
                raise NodeError(f"round {cmd.round_id} was already run by {self.node_id}")
            if self._worker is not None and self._worker.is_alive():
                raise NodeBusy(f"{self.node_id} is busy with round {self._round_id}",
                               hint="wait for the running round or abort it")
            if self._ring is None:
                raise NodeError(f"{self.node_id} has no swarm transport", hint="set `broker` in NODE.toml")
            self._seen_rounds[cmd.round_id] = None
            while len(self._seen_rounds) > SEEN_ROUNDS_KEPT:
                self._seen_rounds.popitem(last=False)
            save_seen_rounds(self.config.data_dir, self._seen_rounds)
            log.info("round %s: starting (%d steps, %d participants)", cmd.round_id, cmd.steps,
                     len(cmd.participants))
            self._worker = threading.Thread(target=self._round_worker, args=(cmd,),
                                            name=f"round-{self.node_id}", daemon=True)
            self._worker.start()
            return self._worker

    def wait_idle(self, timeout: float) -> bool:
        """Block until no round runs (True) or ``timeout`` passes (False)."""
        w = self._worker
        if w is not None:
            w.join(timeout)
            return not w.is_alive()
        return True

    def _hierarchical(self, cmd: RoundCommand) -> Collective:
        """The collective of a round whose command names its sites (federation/PROTOCOL.md
        section 10): this node's site ring and, if it leads its site, the bridged backbone ring."""
        assert cmd.sites is not None
        if not isinstance(self._ring, RingAllreduce) or self._backbone is None:
            raise RoundFailed(f"{self.node_id} cannot run hierarchical round {cmd.round_id} in a "
                              "training worker process", hint='set [training] isolation = "thread"')
        return HierarchicalCollective(self._ring, self._backbone, Topology.from_groups(cmd.sites))

    def _round_worker(self, cmd: RoundCommand) -> None:
        _lower_thread_priority(self.config.training.nice)
        try:
            self.run_round(cmd)
        except RoundFailed:
            pass  # already reported as a FAILED event
        except Exception:  # noqa: BLE001 - a worker thread must log, not die silently
            log.exception("round %s crashed", cmd.round_id)

    def run_round(self, cmd: RoundCommand) -> RoundResult:
        """Run one round synchronously on the calling thread (the worker uses this).

        Emits STEP/DONE/FAILED events; on failure raises RoundFailed and keeps the old parameters.
        """
        if self._ring is None:
            raise NodeError(f"{self.node_id} has no swarm transport", hint="set `broker` in NODE.toml")
        if self.trainer is None:
            exc = RoundFailed(f"{self.node_id}: the artifact has no training module",
                              hint="compile with `fractal compile --train`")
            self.metrics.round_finished(False)
            self._emit(RoundEvent(kind=EventKind.FAILED, round_id=cmd.round_id, node_id=self.node_id,
                                  reason=str(exc)))
            raise exc
        tcfg = self.config.training
        plan = RoundPlan.from_command(cmd, tcfg)
        self._abort.clear()
        with self._lock:
            self._state, self._round_id = NodeState.TRAINING, cmd.round_id
        self.metrics.training(True)
        self.publish_status()
        last_emit = [0.0]
        pending: list[float | None] = []  # losses since the last STEP event (it carries them all)

        def on_step(step: int, loss: float) -> None:
            self.metrics.loss(loss)
            pending.append(float(loss) if np.isfinite(loss) else None)
            now = time.monotonic()
            if now - last_emit[0] >= _STEP_EVENT_MIN_S or step == plan.steps - 1:
                last_emit[0] = now
                self._emit(RoundEvent(kind=EventKind.STEP, round_id=cmd.round_id, node_id=self.node_id,
                                      step=step, loss=pending[-1], losses=list(pending)))
                pending.clear()

        rng = np.random.default_rng([tcfg.seed, zlib.crc32(self.node_id.encode()),
                                     zlib.crc32(cmd.round_id.encode())])
        try:
            budget = int(tcfg.round_memory_mb * 1024 * 1024)
            # anomaly model: every sample not flagged anomalous, the input as its target; supervised:
            # the samples whose label is known (stream windows wait for theirs)
            samples = self.store.snapshot(limit=max(1, budget // max(1, self.store.sample_bytes)),
                                          part="train", share=tcfg.validation_share,
                                          which="normal" if self.anomaly is not None else "known")
            self._check_labels(plan, samples)
            if self.anomaly is not None:
                samples = self.anomaly.as_targets(samples)
            val_samples = self._validation_samples()
            val_before = self._evaluate(self.model.snapshot, val_samples)
            ring, steps = (self._ring, self._steps) if cmd.sites is None else (self._hierarchical(cmd), None)
            result = run_round(plan, node_id=self.node_id, model=self.model, trainer=self.trainer,
                               samples=samples, ring=ring, rng=rng, abort=self._abort, on_step=on_step,
                               faults=self.faults, steps=steps)
        except Exception as exc:  # RoundFailed, or e.g. a full disk while persisting: the fleet must hear
            # compression residuals of a void round must not leak into the next
            self._ring.reset_feedback()
            self.last_error = str(exc)
            self.metrics.round_finished(False)
            log.warning("%s: %s", self.node_id, exc)
            self._emit(RoundEvent(kind=EventKind.FAILED, round_id=cmd.round_id, node_id=self.node_id,
                                  reason=str(exc) or type(exc).__name__,
                                  member=exc.member if isinstance(exc, RoundFailed) else None))
            if isinstance(exc, RoundFailed):
                raise
            raise RoundFailed(f"round {cmd.round_id} failed on {self.node_id}: {exc}") from exc
        finally:
            with self._lock:
                self._state = NodeState.OFFLINE if self._stopping.is_set() else NodeState.ONLINE
                self._round_id = None
            self.metrics.training(False)
        self.last_result, self.last_error = result, None
        self.metrics.round_finished(True)
        # The same validation samples before and after: the difference is the round's doing.
        self.validation = self._evaluate(self.model.snapshot, val_samples)
        self._refit.set()  # new parameters: the anomaly threshold follows them (no-op otherwise)
        final = next((x for x in reversed(result.losses) if np.isfinite(x)), None)
        self._emit(RoundEvent(kind=EventKind.DONE, round_id=cmd.round_id, node_id=self.node_id,
                              step=plan.steps, loss=final, params_sha256=result.sha256,
                              model_version=result.version, val_before=val_before, val_after=self.validation,
                              excluded=sorted(result.excluded) or None))
        self.publish_status()
        return result

    def _check_labels(self, plan: RoundPlan, samples: Samples) -> None:
        """Refuse a round over stored labels the compiled loss must not see (a store edited by
        hand or kept from a model with more classes); the peers hear it at once."""
        try:
            self.store.check_labels(samples.labels)
        except InvalidInput as exc:
            reason = f"{self.node_id}: its stored training samples hold bad labels: {exc}"
            if self._ring is not None:
                self._ring.abort(f"{plan.round_id}/hello", [m for m in plan.group if m != self.node_id],
                                 reason)
            raise RoundFailed(reason, member=self.node_id,
                              hint="remove the node's samples.db (data_dir) and send the samples "
                                   "again") from None

    def _emit(self, event: RoundEvent) -> None:
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:  # noqa: BLE001
                log.exception("event listener failed")
        link = self._link
        if link is not None:
            try:
                topic = topics.round_events(self.config.swarm, event.round_id, self.node_id)
                link.publish(topic, event, qos=1)
            except Exception as exc:  # noqa: BLE001
                log.warning("event publish failed: %s", exc)


def _lower_thread_priority(nice: int) -> None:
    """Give the CALLING thread Linux nice ``nice`` (threads have their own nice value).

    Threads created afterwards from this thread (TVM's worker pool, started lazily by the first
    parallel kernel of the training VM) inherit it, so a round never competes with inference
    at equal priority. Best effort: other platforms or a refused change just log.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as exc:
        log.warning("cannot lower the training thread's priority to nice %d: %s", nice, exc)
