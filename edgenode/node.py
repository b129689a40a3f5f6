"""``EdgeNode``: the agent on one board.

It composes the artifact (``compiler.load_artifact``), the current parameters
(:class:`~edgenode.model.ModelHolder`), the sample store (:class:`~edgenode.store.SampleStore`)
and, with a broker, the swarm side: an ``MqttLink`` whose Last Will is an offline NodeStatus, a
retained status re-published on every change and every ``heartbeat_s``, the command topic, and
a ``RingAllreduce`` over the link's transport. Training rounds run on one worker thread, one at
a time; inference keeps running on the caller's threads from the last committed parameters.

Surface used by the HTTP layer (``api.node_app``): ``config``, ``model_name``, ``model_version``,
``inputs``, ``outputs``, ``infer()``, ``add_samples()``, ``info()``, ``metrics``, ``registry``,
``start()``, ``stop()``.
"""

from __future__ import annotations

import collections
import os
import platform
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ValidationError

from edgenode.common import ConfigError, NodeBusy, NodeError, RoundFailed, get_logger
from edgenode.config import NodeConfig
from edgenode.devicefacts import DeviceFacts
from edgenode.metrics import NodeMetrics
from edgenode.model import ModelHolder, ParamsSnapshot
from edgenode.ports import Collective, Engine, Link, Publication, Spec, Trainer
from edgenode.store import Samples, SampleSpec, SampleStore
from edgenode.training import RoundPlan, RoundResult, run_round
from edgenode.validation import evaluate
from federation import topics
from federation.messages import (
    ArtifactInfo,
    EventKind,
    NodeState,
    NodeStatus,
    RollbackCommand,
    RoundAbort,
    RoundCommand,
    RoundEvent,
    Validation,
    parse_command,
)
from federation.transport import Transport

__all__ = ["EdgeNode"]

log = get_logger("agent")
_STATUS_MIN_S = 1.0  # extra status publishes (sample count changes) are rate-limited to this
_STEP_EVENT_MIN_S = 0.25  # STEP events are throttled: a 1000-step round must not flood the broker


class EdgeNode:
    """One edge node. Build it, ``start()`` it, serve it with ``api.node_app``, ``stop()`` it.

    ``artifact`` (an already loaded Artifact) and ``transport`` (e.g. ``MemoryHub().transport(id)``
    for in-process swarms) are test/embedding hooks; by default the artifact is loaded from
    ``config.artifact`` and, when ``config.broker`` is set, the transport is the MQTT link's.
    """

    def __init__(self, config: NodeConfig, *, artifact: Engine | None = None,
                 transport: Transport | None = None) -> None:
        self.config = config
        if artifact is None:
            from compiler import load_artifact  # lazy: keeps `import edgenode` light

            artifact = load_artifact(config.artifact)
        self.artifact: Engine = artifact
        self.trainer: Trainer | None = artifact.trainer
        config.data_dir.mkdir(parents=True, exist_ok=True)
        tb = config.training.batch
        if tb is not None and self.trainer is not None and int(self.trainer.batch) != tb:
            raise ConfigError(f"[training] batch = {tb} but the artifact's training module was compiled for "
                              f"batch {self.trainer.batch}",
                              hint=f"set batch = {self.trainer.batch} or recompile with --batch {tb}")
        self.model = ModelHolder(artifact, config.data_dir, keep_versions=config.training.keep_versions)
        self.store = SampleStore(config.data_dir / "samples.db", self._sample_spec(),
                                 max_samples=config.store.max_samples, retention=config.store.retention,
                                 num_classes=self._num_classes())
        self.metrics = NodeMetrics(lambda: self.store.count, lambda: self.model.version)
        self._transport = transport
        self._ring: Collective | None = None
        self._link: Link | None = None
        self._lock = threading.Lock()  # guards state / round bookkeeping below
        self._state = NodeState.ONLINE
        self._round_id: str | None = None
        self._worker: threading.Thread | None = None
        self._abort = threading.Event()
        self._seen_rounds: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._started = False
        self._listeners: list[Callable[[RoundEvent], None]] = []
        self._last_status = 0.0
        self.last_result: RoundResult | None = None
        self.last_error: str | None = None
        self.facts = DeviceFacts(config.data_dir)
        self.validation: Validation | None = None  # after the last committed round or rollback

    # -- identity --------------------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def model_name(self) -> str:
        """The model's name (from the artifact manifest), used in URLs."""
        return str(self.artifact.name)

    @property
    def model_version(self) -> int:
        """Version of the committed parameters: 0 = as shipped, +1 per committed round."""
        return self.model.version

    @property
    def params_sha256(self) -> str:
        return self.model.sha256

    @property
    def inputs(self) -> list[Spec]:
        """The artifact's input TensorSpecs (shape includes the compiled batch dim)."""
        return list(self.artifact.inputs)

    @property
    def outputs(self) -> list[Spec]:
        return list(self.artifact.outputs)

    def readiness(self) -> str | None:
        """Why the node cannot serve right now, or None when it can (``/v2/health/ready``).

        Not ready: before :meth:`start` or after :meth:`stop`, while a new parameter set is being
        swapped in, or while the sample store is unavailable (closed, or its writes fail).
        """
        if not self._started:
            return "the node is not started"
        if self.model.swapping:
            return "parameters are being swapped"
        return self.store.problem()

    @property
    def registry(self) -> CollectorRegistry:
        """Prometheus ``CollectorRegistry`` with the node's counters (inferences, samples, rounds, loss)."""
        return self.metrics.registry

    @property
    def state(self) -> NodeState:
        return self._state

    @property
    def round_id(self) -> str | None:
        return self._round_id

    @property
    def arch(self) -> str:
        return platform.machine()

    @property
    def board(self) -> str:
        if self.config.board:
            return self.config.board
        return self.artifact.manifest.preset

    def info(self) -> dict[str, Any]:
        """node_id, arch, board, model, model_version, params_sha256, round_id, samples, state, ..."""
        snap = self.model.snapshot
        return {"node_id": self.node_id, "arch": self.arch, "board": self.board, "model": self.model_name,
                "model_version": snap.version, "params_sha256": snap.sha256, "round_id": self._round_id,
                "samples": self.store.count, "state": self._state.value, "swarm": self.config.swarm,
                "broker": self.config.broker is not None, "trainable": self.trainer is not None,
                "last_loss": self.metrics.last_loss, "last_error": self.last_error}

    def _sample_spec(self) -> SampleSpec:
        ins = tuple((s.name, tuple(int(d) for d in s.shape[1:]), str(np.dtype(s.dtype))) for s in self.inputs)
        if self.trainer is not None and self.trainer.loss == "mse":
            out = self.outputs[0]
            return SampleSpec(ins, tuple(int(d) for d in out.shape[1:]), "float32")
        return SampleSpec(ins, (), "int64")

    def _num_classes(self) -> int | None:
        if self.trainer is not None and self.trainer.loss == "mse":
            return None
        return int(self.outputs[0].shape[-1]) if self.outputs and self.outputs[0].shape else None

    # -- data plane --------------------------------------------------------------------------------
    def infer(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the model on a batch (any leading N >= 1) with one consistent parameter snapshot.

        Raises :class:`InvalidInput` naming the problem (missing/unknown input, shape, dtype):
        the artifact validates (``compiler.artifact.check_inputs``, the one validator).
        """
        t0 = time.perf_counter()
        out = self.model.infer(inputs)
        self.metrics.inference(time.perf_counter() - t0)
        return out

    def add_samples(self, inputs: dict[str, np.ndarray], labels: np.ndarray) -> int:
        """Store labelled samples durably (one fsynced transaction) and return the new sample count.

        ``inputs[name]`` is (N, *input shape without batch), ``labels`` (N,) class ids for a ce
        model or (N, *output shape) targets for mse. Raises InvalidInput or StoreError (full).
        """
        count = self.store.add(inputs, labels)
        self.metrics.samples(int(np.shape(labels)[0]))
        if time.monotonic() - self._last_status > _STATUS_MIN_S:  # sample count changed: tell the fleet,
            self.publish_status()  # at most once a second (heartbeats carry the rest)
        return count

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to the broker (if configured), publish the retained status, start heartbeats.

        Idempotent. Without a broker and without a transport the node serves inference only.
        """
        if self._started:
            return
        self._started = True
        self._stopping.clear()
        if self.config.broker:
            from federation.mqtt import MqttLink

            # The will is fixed at CONNECT: after later rounds it carries an older model_version.
            # Consumers must treat an offline status as "gone", not as the node's current version.
            will = (topics.status(self.config.swarm, self.node_id),
                    self._status(NodeState.OFFLINE).model_dump_json())
            self._link = MqttLink(self.config.broker, swarm=self.config.swarm, client_id=self.node_id,
                                  will=will, keepalive=self.config.keepalive_s)
            if self._transport is None:
                self._transport = self._link.transport(self.node_id)
            # a restarted broker without persistence forgot our retained status: say it again
            self._link.on_connect(self._on_connect)
            self._link.subscribe(topics.command(self.config.swarm), self._on_command_message)
        if self._transport is not None:
            from federation.ring import RingAllreduce

            self._ring = RingAllreduce(self._transport, swarm=self.config.swarm)
        self.publish_status()
        if self._link is not None:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"hb-{self.node_id}",
                                               daemon=True)
            self._heartbeat.start()
        log.info("node %s started (model %s v%d)", self.node_id, self.model_name, self.model_version)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort a running round, publish the offline status, disconnect, close the store. Idempotent."""
        if not self._started:
            self.store.close()
            return
        self._started = False
        self._stopping.set()
        self._abort.set()
        w = self._worker
        if w is not None:
            w.join(timeout)
        if self._heartbeat is not None:
            self._heartbeat.join(timeout)
        self._state = NodeState.OFFLINE
        info = self.publish_status()
        if info is not None:  # let the offline status reach the broker before we disconnect
            try:
                info.wait_for_publish(timeout=2.0)
            except Exception:  # noqa: BLE001 - not connected: the Last Will says offline anyway
                pass
        if self._link is not None:
            self._link.close()
            self._link = None
        if self._ring is not None:
            self._ring.close()
        self.store.close()
        log.info("node %s stopped", self.node_id)

    def __enter__(self) -> EdgeNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- status --------------------------------------------------------------------------------
    def _status(self, state: NodeState | None = None) -> NodeStatus:
        snap = self.model.snapshot
        count = self.store.count
        val = self.store.count_part("val", self.config.training.validation_share)
        m = self.artifact.manifest
        return NodeStatus(node_id=self.node_id, state=state or self._state, arch=self.arch, board=self.board,
                          model=self.model_name, model_version=snap.version, params_sha256=snap.sha256,
                          samples=count,
                          round_id=self._round_id, api_url=self.config.advertised_url,
                          artifact=ArtifactInfo(model=self.model_name, target=m.preset, tuned=m.tuning.tuned,
                                                tvm_version=m.tvm_version),
                          health=self.facts.health(), samples_train=max(0, count - val), samples_val=val,
                          validation=self.validation, versions=self.model.versions.available(),
                          heartbeat_s=self.config.heartbeat_s, keepalive_s=float(self.config.keepalive_s))

    def status(self) -> NodeStatus:
        """The NodeStatus this node publishes (retained) right now."""
        return self._status()

    def publish_status(self) -> Publication | None:
        """Publish the retained status now (also done on every state change and heartbeat)."""
        link = self._link
        if link is None:
            return None
        self._last_status = time.monotonic()
        try:
            return link.publish(topics.status(self.config.swarm, self.node_id), self._status(),
                                retain=True, qos=1)
        except Exception as exc:  # noqa: BLE001 - a broker hiccup must not kill a round or a request
            log.warning("status publish failed: %s", exc)
            return None

    def _on_connect(self, reconnected: bool) -> None:
        if reconnected:  # a restarted broker without persistence forgot our retained status
            self.publish_status()

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.config.heartbeat_s):
            self.publish_status()

    # -- commands ----------------------------------------------------------------------------------
    def add_event_listener(self, fn: Callable[[RoundEvent], None]) -> None:
        """Call ``fn(event)`` for every RoundEvent this node emits (also published over MQTT)."""
        self._listeners.append(fn)

    def _on_command_message(self, topic: str, payload: bytes) -> None:
        self.handle_command(payload)

    def handle_command(self, command: bytes | str | RoundCommand | RoundAbort | RollbackCommand) -> None:
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
            return
        if isinstance(command, RollbackCommand):
            if self.node_id in command.nodes:
                self.rollback(command.to_version, command.rollback_id)
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
        self.publish_status()
        return ok

    def _validation_samples(self) -> Samples:
        tcfg = self.config.training
        budget = int(tcfg.round_memory_mb * 1024 * 1024) // max(1, self.store.sample_bytes)
        return self.store.snapshot(limit=max(1, budget), part="val", share=tcfg.validation_share)

    def _evaluate(self, snap: ParamsSnapshot, samples: Samples) -> Validation | None:
        """Loss/accuracy of ``snap`` on ``samples``; None without a training module or samples."""
        if self.trainer is None or not len(samples):
            return None
        out = self.outputs[0].name
        params = snap.prepared if snap.prepared is not None else list(snap.params)
        try:
            return evaluate(lambda x: self.artifact.infer(x, params=params)[out], samples,
                            loss=self.trainer.loss, version=snap.version)
        except Exception as exc:  # noqa: BLE001 - a failed evaluation must not fail the round
            log.warning("validation failed: %s", exc)
            return None

    def start_round(self, cmd: RoundCommand) -> threading.Thread:
        """Run ``cmd`` on the worker thread; raises NodeBusy if a round is running."""
        with self._lock:
            if cmd.round_id in self._seen_rounds:  # QoS 1 redelivery of a command we already ran
                raise NodeError(f"round {cmd.round_id} was already run by {self.node_id}")
            if self._worker is not None and self._worker.is_alive():
                raise NodeBusy(f"{self.node_id} is busy with round {self._round_id}",
                               hint="wait for the running round or abort it")
            if self._ring is None:
                raise NodeError(f"{self.node_id} has no swarm transport", hint="set `broker` in NODE.toml")
            self._seen_rounds[cmd.round_id] = None
            while len(self._seen_rounds) > 256:
                self._seen_rounds.popitem(last=False)
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
            samples = self.store.snapshot(limit=max(1, budget // max(1, self.store.sample_bytes)),
                                          part="train", share=tcfg.validation_share)
            val_samples = self._validation_samples()
            val_before = self._evaluate(self.model.snapshot, val_samples)
            result = run_round(plan, node_id=self.node_id, model=self.model, trainer=self.trainer,
                               samples=samples, ring=self._ring, rng=rng, abort=self._abort, on_step=on_step)
        except Exception as exc:  # RoundFailed, or e.g. a full disk while persisting: the fleet must hear
            # compression residuals of a void round must not leak into the next
            self._ring.reset_feedback()
            self.last_error = str(exc)
            self.metrics.round_finished(False)
            log.warning("%s: %s", self.node_id, exc)
            self._emit(RoundEvent(kind=EventKind.FAILED, round_id=cmd.round_id, node_id=self.node_id,
                                  reason=str(exc) or type(exc).__name__))
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
        final = next((x for x in reversed(result.losses) if np.isfinite(x)), None)
        self._emit(RoundEvent(kind=EventKind.DONE, round_id=cmd.round_id, node_id=self.node_id,
                              step=plan.steps, loss=final, params_sha256=result.sha256,
                              model_version=result.version, val_before=val_before, val_after=self.validation))
        self.publish_status()
        return result

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
