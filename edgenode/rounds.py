"""The round runner of an edge node: round commands in, one training round at a time on a
worker thread, STEP/DONE/FAILED events out. :class:`edgenode.node.EdgeNode` holds one
(``node.rounds``), built with the pieces a round reads and changes (:class:`RoundParts`) and
connected to the swarm's collective when the node starts (:meth:`RoundRunner.connect`).

The round path, top to bottom: the node parses a command and hands a ``RoundCommand`` to
:meth:`RoundRunner.handle`; the worker thread's :meth:`RoundRunner.run_round` resolves the
command against the node's ``[training]`` table (``federation.roundspec.resolve``), picks the
samples and calls :func:`edgenode.roundphases.run_round`, which runs federation's phases
(``federation/phases.py``: hello, start; ``federation/steps.py``: the steps; agree, vote) and
commits.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgenode.anomaly import AnomalyScorer, evaluate_anomaly
from edgenode.common import SeenIds, get_logger
from edgenode.config import NodeConfig
from edgenode.errors import InvalidInput, NodeBusy, NodeError, RoundFailed
from edgenode.faults import NO_FAULTS, Faults
from edgenode.metrics import NodeMetrics
from edgenode.model import ModelHolder, ParamsSnapshot
from edgenode.ports import Collective, Engine, Link, Publication, StepRunner, Trainer
from edgenode.roundphases import RoundResult, run_round
from edgenode.store import Samples, SampleStore
from edgenode.validation import evaluate
from federation import topics
from federation.hierarchy import HierarchicalCollective, Topology
from federation.messages import EventKind, RoundAbort, RoundCommand, RoundEvent, Validation
from federation.phases import RoundPlan
from federation.ring import RingAllreduce

__all__ = ["SEEN_ROUNDS_KEPT", "RoundParts", "RoundRunner", "load_seen_rounds", "save_seen_rounds"]

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


@dataclass(frozen=True)
class RoundParts:
    """What a :class:`RoundRunner` works with: the node's pieces a round reads and changes, and
    the two things it tells the node (a new status to publish, new parameters in place)."""

    config: NodeConfig
    artifact: Engine
    trainer: Trainer | None  # the artifact's (None: no training module, every round fails)
    model: ModelHolder
    store: SampleStore
    metrics: NodeMetrics
    publish_status: Callable[[], Publication | None]
    params_changed: Callable[[], None]  # e.g. recompute the anomaly threshold
    anomaly: AnomalyScorer | None = None  # a reconstruction model's scorer (edgenode/anomaly.py)
    faults: Faults = NO_FAULTS


class RoundRunner:
    """One round at a time: starts it on a worker thread, runs it, reports it.

    Owns the round bookkeeping (the running round, the worker, the abort flag, the rounds seen,
    the listeners, the last result and validation) and, once :meth:`connect` ed, the swarm side:
    the collective, the site leaders' backbone ring and the training worker process."""

    def __init__(self, parts: RoundParts) -> None:
        self.parts = parts
        self.node_id = parts.config.node_id
        self.trainer = parts.trainer  # a test may wrap it (a member computing wrong updates)
        self.collective: Collective | None = None  # set by connect(): no swarm, no rounds
        self.backbone: RingAllreduce | None = None  # the site leaders' ring of hierarchical rounds
        self.steps: StepRunner | None = None  # the training worker process ([training] isolation)
        self.link: Link | None = None  # events go out on it (and to the listeners)
        self.round_id: str | None = None  # the running round (the node is TRAINING meanwhile)
        self.last_result: RoundResult | None = None
        self.last_error: str | None = None
        self.validation: Validation | None = None  # after the last committed round or rollback
        self._lock = threading.Lock()  # guards the bookkeeping below
        self._worker: threading.Thread | None = None
        self._abort = threading.Event()
        self._seen = load_seen_rounds(parts.config.data_dir)
        self._listeners: list[Callable[[RoundEvent], None]] = []

    def connect(self, collective: Collective, *, backbone: RingAllreduce | None = None,
                steps: StepRunner | None = None, link: Link | None = None) -> None:
        """The swarm side, built when the node starts."""
        self.collective, self.backbone, self.steps, self.link = collective, backbone, steps, link

    def stop(self, timeout: float) -> None:
        """Abort a running round and wait up to ``timeout`` for its worker. Idempotent."""
        self._abort.set()
        w = self._worker
        if w is not None:
            w.join(timeout)

    def disconnect(self) -> None:
        """Close the swarm side (after the node said it is offline)."""
        self.link = None
        if self.collective is not None:
            self.collective.close()
        if self.backbone is not None:
            self.backbone.close()
            self.backbone = None

    def busy(self) -> bool:
        """A round's worker thread is running."""
        w = self._worker
        return w is not None and w.is_alive()

    def add_event_listener(self, fn: Callable[[RoundEvent], None]) -> None:
        """Call ``fn(event)`` for every RoundEvent this node emits (also published over MQTT)."""
        self._listeners.append(fn)

    # -- commands ----------------------------------------------------------------------------------
    def abort(self, command: RoundAbort) -> None:
        """The fleet aborts ``command.round_id``: stop it if it is the running round."""
        if command.round_id != self.round_id:
            return
        log.info("round %s: abort requested (%s)", command.round_id, command.reason)
        self._abort.set()
        # Also fail the collective we may be blocked in (e.g. waiting for a participant that never
        # comes, up to step_timeout_s): freed now, peers told by ABORT frames.
        for coll in (self.collective, self.backbone):
            if coll is not None:
                coll.cancel(f"aborted by the fleet: {command.reason}")

    def handle(self, command: RoundCommand) -> None:
        """A round command from the fleet (non-blocking): start it if this node takes part and
        has not run it yet; a refusal goes out as a FAILED event."""
        if self.node_id not in command.participants:
            return
        try:
            topics.validate_id(command.round_id, "round id")
        except ValueError as exc:
            self.parts.metrics.rejected()
            log.warning("rejected command: %s", exc)
            return
        if command.round_id in self._seen:  # QoS 1 redelivery: already run (or running)
            log.info("ignoring duplicate command for round %s", command.round_id)
            return
        try:
            self.start_round(command)
        except NodeError as exc:
            if isinstance(exc, NodeBusy):
                self.parts.metrics.rejected()
            log.warning("round %s refused: %s", command.round_id, exc)  # the fleet hears it as FAILED
            self._emit(RoundEvent(kind=EventKind.FAILED, round_id=command.round_id, node_id=self.node_id,
                                  reason=str(exc)))

    def rollback(self, to_version: int, rollback_id: str = "") -> bool:
        """Return to the kept parameter ``to_version`` (a fleet rollback); False, logged, when the
        node cannot (busy with a round, version not kept). The new status tells the fleet."""
        p = self.parts
        w = self._worker
        if w is not None and w.is_alive() and w is not threading.current_thread():
            # The fleet rolls a round back as soon as every DONE event arrived: this node's worker
            # may still be publishing its status. Give it the time a step may take.
            w.join(p.config.training.step_timeout_s)
        with self._lock:
            if self._worker is not None and self._worker.is_alive():
                log.warning("rollback %s refused: round %s is running", rollback_id, self.round_id)
                p.metrics.rejected()
                return False
            try:
                snap = p.model.rollback(to_version)
            except NodeError as exc:
                log.warning("rollback %s to version %d refused: %s", rollback_id, to_version, exc)
                self.last_error = str(exc)
                ok = False
            else:
                ok = True
        if ok:
            self.validation = self._evaluate(snap, self._validation_samples())
            p.params_changed()
        p.publish_status()
        return ok

    def start_round(self, cmd: RoundCommand) -> threading.Thread:
        """Run ``cmd`` on the worker thread; raises NodeBusy if a round is running."""
        w = self._worker
        if w is not None and w.is_alive() and self.round_id is None:
            # The previous round already ended (its DONE/FAILED event is out, so the fleet may
            # start the next one at once); its worker is only publishing the status.
            w.join(5.0)
        with self._lock:
            if cmd.round_id in self._seen:  # QoS 1 redelivery of a command we already ran
                raise NodeError(f"round {cmd.round_id} was already run by {self.node_id}")
            if self._worker is not None and self._worker.is_alive():
                raise NodeBusy(f"{self.node_id} is busy with round {self.round_id}",
                               hint="wait for the running round or abort it")
            if self.collective is None:
                raise NodeError(f"{self.node_id} has no swarm transport", hint="set `broker` in NODE.toml")
            self._seen[cmd.round_id] = None
            while len(self._seen) > SEEN_ROUNDS_KEPT:
                self._seen.popitem(last=False)
            save_seen_rounds(self.parts.config.data_dir, self._seen)
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

    def _round_worker(self, cmd: RoundCommand) -> None:
        _lower_thread_priority(self.parts.config.training.nice)
        try:
            self.run_round(cmd)
        except RoundFailed:
            pass  # already reported as a FAILED event
        except Exception:  # noqa: BLE001 - a worker thread must log, not die silently
            log.exception("round %s crashed", cmd.round_id)

    # -- one round ---------------------------------------------------------------------------------
    def run_round(self, cmd: RoundCommand) -> RoundResult:
        """Run one round synchronously on the calling thread (the worker uses this).

        Emits STEP/DONE/FAILED events; on failure raises RoundFailed and keeps the old parameters.
        """
        p = self.parts
        ring = self.collective
        if ring is None:
            raise NodeError(f"{self.node_id} has no swarm transport", hint="set `broker` in NODE.toml")
        trainer = self.trainer
        if trainer is None:
            exc = RoundFailed(f"{self.node_id}: the artifact has no training module",
                              hint="compile with `fractal compile --train`")
            p.metrics.round_finished(False)
            self._emit(RoundEvent(kind=EventKind.FAILED, round_id=cmd.round_id, node_id=self.node_id,
                                  reason=str(exc)))
            raise exc
        tcfg = p.config.training
        plan = RoundPlan.from_command(cmd, tcfg)
        self._abort.clear()
        with self._lock:
            self.round_id = cmd.round_id
        p.metrics.training(True)
        p.publish_status()
        on_step = self._step_events(plan)
        rng = np.random.default_rng([tcfg.seed, zlib.crc32(self.node_id.encode()),
                                     zlib.crc32(cmd.round_id.encode())])
        try:
            taken_upto = p.store.last_id()  # samples after this one are new to the next round
            samples = self._training_samples(plan)
            val_samples = self._validation_samples()
            val_before = self._evaluate(p.model.snapshot, val_samples)
            coll, steps = (ring, self.steps) if cmd.sites is None else (self._hierarchical(cmd), None)
            result = run_round(plan, node_id=self.node_id, model=p.model, trainer=trainer,
                               samples=samples, ring=coll, rng=rng, abort=self._abort, on_step=on_step,
                               faults=p.faults, steps=steps)
        except Exception as exc:  # RoundFailed, or e.g. a full disk while persisting: the fleet must hear
            # Out of the round before the FAILED event: the fleet may start the next round on it, and
            # start_round waits for a worker that is only finishing up, not for one still in a round.
            with self._lock:
                self.round_id = None
            # compression residuals of a void round must not leak into the next
            ring.reset_feedback()
            self.last_error = str(exc)
            p.metrics.round_finished(False)
            log.warning("%s: %s", self.node_id, exc)
            self._emit(RoundEvent(kind=EventKind.FAILED, round_id=cmd.round_id, node_id=self.node_id,
                                  reason=str(exc) or type(exc).__name__,
                                  member=exc.member if isinstance(exc, RoundFailed) else None))
            if isinstance(exc, RoundFailed):
                raise
            raise RoundFailed(f"round {cmd.round_id} failed on {self.node_id}: {exc}") from exc
        finally:
            with self._lock:
                self.round_id = None
            p.metrics.training(False)
        self.last_result, self.last_error = result, None
        p.metrics.round_finished(True)
        # The same validation samples before and after: the difference is the round's doing.
        self.validation = self._evaluate(p.model.snapshot, val_samples)
        p.params_changed()  # new parameters: e.g. the anomaly threshold follows them
        try:  # before DONE: the status after it reports samples_new counted from this round
            p.store.mark_trained(taken_upto)
        except Exception as exc:  # noqa: BLE001 - a full disk must not undo a committed round
            log.warning("%s: could not record the samples round %s took: %s", self.node_id, cmd.round_id, exc)
        final = next((x for x in reversed(result.losses) if np.isfinite(x)), None)
        self._emit(RoundEvent(kind=EventKind.DONE, round_id=cmd.round_id, node_id=self.node_id,
                              step=plan.steps, loss=final, params_sha256=result.sha256,
                              model_version=result.version, val_before=val_before, val_after=self.validation,
                              excluded=sorted(result.excluded) or None))
        p.publish_status()
        return result

    def _step_events(self, plan: RoundPlan) -> Callable[[int, float], None]:
        """The steps' callback: the loss metric, and STEP events throttled to one per
        ``_STEP_EVENT_MIN_S`` (each carries every loss since the last one)."""
        last_emit = [0.0]
        pending: list[float | None] = []

        def on_step(step: int, loss: float) -> None:
            self.parts.metrics.loss(loss)
            pending.append(float(loss) if np.isfinite(loss) else None)
            now = time.monotonic()
            if now - last_emit[0] >= _STEP_EVENT_MIN_S or step == plan.steps - 1:
                last_emit[0] = now
                self._emit(RoundEvent(kind=EventKind.STEP, round_id=plan.round_id, node_id=self.node_id,
                                      step=step, loss=pending[-1], losses=list(pending)))
                pending.clear()

        return on_step

    def _training_samples(self, plan: RoundPlan) -> Samples:
        """This round's training samples: for an anomaly model every sample not flagged anomalous,
        the input as its target; for a supervised one the samples whose label is known (stream
        windows wait for theirs), within ``[training] round_memory_mb``."""
        p = self.parts
        tcfg = p.config.training
        budget = int(tcfg.round_memory_mb * 1024 * 1024)
        samples = p.store.snapshot(limit=max(1, budget // max(1, p.store.sample_bytes)),
                                   part="train", share=tcfg.validation_share,
                                   which="normal" if p.anomaly is not None else "known")
        self._check_labels(plan, samples)
        return samples if p.anomaly is None else p.anomaly.as_targets(samples)

    def _validation_samples(self) -> Samples:
        p = self.parts
        tcfg = p.config.training
        budget = int(tcfg.round_memory_mb * 1024 * 1024) // max(1, p.store.sample_bytes)
        # an anomaly model is scored on every validation sample (AUC on the labelled ones); a
        # supervised model only on the samples whose label is known
        which = "any" if p.anomaly is not None else "known"
        return p.store.snapshot(limit=max(1, budget), part="val", share=tcfg.validation_share, which=which)

    def _evaluate(self, snap: ParamsSnapshot, samples: Samples) -> Validation | None:
        """Loss/accuracy of ``snap`` on ``samples``; None without a training module or samples."""
        p = self.parts
        trainer = self.trainer
        if trainer is None or not len(samples):
            return None
        out = p.artifact.outputs[0].name
        params = snap.prepared if snap.prepared is not None else list(snap.params)

        def predict(x: dict[str, np.ndarray]) -> np.ndarray:
            return p.artifact.infer(x, params=params)[out]

        try:
            if p.anomaly is not None:
                return evaluate_anomaly(predict, samples, p.anomaly.input_name, version=snap.version)
            return evaluate(predict, samples, loss=trainer.loss, version=snap.version)
        except Exception as exc:  # noqa: BLE001 - a failed evaluation must not fail the round
            log.warning("validation failed: %s", exc)
            return None

    def _hierarchical(self, cmd: RoundCommand) -> Collective:
        """The collective of a round whose command names its sites (federation/PROTOCOL.md
        section 10): this node's site ring and, if it leads its site, the bridged backbone ring."""
        assert cmd.sites is not None
        if not isinstance(self.collective, RingAllreduce) or self.backbone is None:
            raise RoundFailed(f"{self.node_id} cannot run hierarchical round {cmd.round_id} in a "
                              "training worker process", hint='set [training] isolation = "thread"')
        return HierarchicalCollective(self.collective, self.backbone, Topology.from_groups(cmd.sites))

    def _check_labels(self, plan: RoundPlan, samples: Samples) -> None:
        """Refuse a round over stored labels the compiled loss must not see (a store edited by
        hand or kept from a model with more classes), or over non-finite inputs; the peers hear
        it at once."""
        try:
            self.parts.store.check_labels(samples.labels)
            self.parts.store.check_inputs(list(samples.inputs.values()))
        except InvalidInput as exc:
            reason = f"{self.node_id}: its stored training samples hold bad labels or inputs: {exc}"
            if self.collective is not None:
                self.collective.abort(f"{plan.round_id}/hello",
                                      [m for m in plan.group if m != self.node_id], reason)
            raise RoundFailed(reason, member=self.node_id,
                              hint="remove the node's samples.db (data_dir) and send the samples "
                                   "again") from None

    def _emit(self, event: RoundEvent) -> None:
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:  # noqa: BLE001
                log.exception("event listener failed")
        link = self.link
        if link is not None:
            try:
                topic = topics.round_events(self.parts.config.swarm, event.round_id, self.node_id)
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
