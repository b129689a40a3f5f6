"""``EdgeNode``: the agent on one board.

It composes the artifact (``compiler.load_artifact``), the current parameters
(:class:`~edgenode.model.ModelHolder`), the sample store (:class:`~edgenode.store.SampleStore`)
and, with a broker, the swarm side: an ``MqttLink`` whose Last Will is an offline NodeStatus, a
retained status re-published on every change and every ``heartbeat_s``, the command topic, and
a ``RingAllreduce`` over the link's transport. The node holds its round runner
(``self.rounds``, :class:`~edgenode.rounds.RoundRunner`: one training round at a time on a
worker thread) and its image control (``self.images``, :class:`~edgenode.updates.ImageControl`),
each built with the pieces it uses; commands arrive here and are handed to them
(:meth:`EdgeNode.handle_command`). Inference keeps running on the caller's threads from the last
committed parameters. Collaborators are typed by the Protocols of :mod:`edgenode.ports`.

Surface used by the HTTP layer (``api.node_app``): ``config``, ``model_name``, ``model_version``,
``inputs``, ``outputs``, ``infer()``, ``add_samples()``, ``info()``, ``metrics``, ``registry``,
``readiness()``, ``start()``, ``stop()``.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from edgenode.anomaly import SCORE, AnomalyScorer, is_reconstruction
from edgenode.common import get_logger
from edgenode.config import AnomalyMode, Isolation, NodeConfig, PrecisionSetting, WorkerPriority
from edgenode.devicefacts import DeviceFacts
from edgenode.errors import ConfigError
from edgenode.faults import NO_FAULTS, Faults, FaultyTransport, Point
from edgenode.metrics import NodeMetrics
from edgenode.model import ModelHolder
from edgenode.ports import Engine, Link, Publication, Spec, Trainer, Updater
from edgenode.roundphases import RoundResult
from edgenode.rounds import RoundParts, RoundRunner
from edgenode.store import SampleSpec, SampleStore
from edgenode.streams.runner import StreamRunner
from edgenode.trainworker import TrainerWorkerError, TrainingWorker
from edgenode.updates import CommandLog, ImageControl
from federation import topics
from federation.messages import (
    AnyCommand,
    ArtifactInfo,
    ImageRollbackCommand,
    ImageUpdateCommand,
    InferenceInfo,
    NodeState,
    NodeStatus,
    RollbackCommand,
    RoundAbort,
    RoundCommand,
    RoundEvent,
    Validation,
    parse_command,
)
from federation.modes import SyncMode
from federation.transport import Transport

if TYPE_CHECKING:  # the signing stack (cryptography) loads only in a signed swarm
    from edgenode.asyncrunner import AsyncRunner
    from edgenode.requantize import Int8Serving
    from edgenode.security import NodeAuth

__all__ = ["EdgeNode"]

log = get_logger("agent")
_STATUS_MIN_S = 1.0  # extra status publishes (sample count changes) are rate-limited to this


class EdgeNode:
    """One edge node. Build it, ``start()`` it, serve it with ``api.node_app``, ``stop()`` it.

    ``artifact`` (an already loaded Artifact) and ``transport`` (e.g. ``MemoryHub().transport(id)``
    for in-process swarms) are test/embedding hooks; by default the artifact is loaded from
    ``config.artifact`` and, when ``config.broker`` is set, the transport is the MQTT link's.
    ``faults``: the commit faults a test injects (``edgenode/faults.py``); none by default.
    """

    def __init__(self, config: NodeConfig, *, artifact: Engine | None = None,
                 transport: Transport | None = None, faults: Faults = NO_FAULTS) -> None:
        self.config = config
        loaded_here = artifact is None
        if artifact is None:
            from compiler import load_artifact  # lazy: keeps `import edgenode` light

            artifact = load_artifact(config.artifact)
        self.artifact: Engine = artifact
        self.trainer: Trainer | None = artifact.trainer
        # [training] isolation = "process": a worker process runs the rounds' steps and hosts the
        # collective (edgenode/trainworker.py), started with the swarm transport in start(). Only
        # for the artifact the node loaded itself: an embedder's `artifact=` object (a fake, a
        # shared instance) may not be what config.artifact holds, so it trains in-thread as given.
        self._isolate = (loaded_here and self.trainer is not None
                         and config.training.isolation == Isolation.PROCESS)
        self._training_worker: TrainingWorker | None = None
        _check_writable(config.data_dir)
        tb = config.training.batch
        if tb is not None and self.trainer is not None and int(self.trainer.batch) != tb:
            raise ConfigError(f"[training] batch = {tb} but the artifact's training module was compiled for "
                              f"batch {self.trainer.batch}",
                              hint=f"set batch = {self.trainer.batch} or recompile with --batch {tb}")
        self.model = ModelHolder(artifact, config.data_dir, keep_versions=config.training.keep_versions)
        self.anomaly: AnomalyScorer | None = self._anomaly_scorer()
        self._since_fit = 0  # samples stored since the anomaly threshold was last computed
        self._refit = threading.Event()
        self.store = SampleStore(config.data_dir / "samples.db", self._sample_spec(),
                                 max_samples=config.store.max_samples, retention=config.store.retention,
                                 num_classes=self._num_classes())
        self.metrics = NodeMetrics(lambda: self.store.count, lambda: self.model.version)
        # [inference] precision: the int8 library (rebuilt after every commit) or the float model
        self.int8: Int8Serving | None = self._int8_serving(loaded_here)
        self.auth: NodeAuth | None = None  # set in a signed swarm
        if config.key_file is not None and config.keyring_file is not None:
            from edgenode.security import NodeAuth  # lazy: `cryptography` only for signed swarms

            self.auth = NodeAuth(config.key_file, config.keyring_file, config.node_id, self.metrics.registry)
        self.faults = faults
        if faults:
            log.warning("fault injection active: %s", faults)
        self._transport = transport
        self._link: Link | None = None
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._threshold_thread: threading.Thread | None = None
        self.async_runner: AsyncRunner | None = None  # [training] sync = "async" (edgenode/asyncrunner.py)
        self._started = False
        self._last_status = 0.0
        self.facts = DeviceFacts(config.data_dir)
        self.commands = CommandLog(config.data_dir)  # signed commands acted on (never twice)
        self.rounds = RoundRunner(RoundParts(
            config=config, artifact=artifact, trainer=self.trainer, model=self.model, store=self.store,
            metrics=self.metrics, publish_status=self.publish_status, params_changed=self._params_changed,
            anomaly=self.anomaly, faults=faults))
        # Booted from a device (`fractal boot`): image updates from the fleet (edgenode/updates.py).
        updater: Updater | None = None
        if config.device is not None:
            from firmware.ota import DeviceUpdates  # lazy: only nodes that run from a device image

            updater = DeviceUpdates(config.device)
            if (phase := updater.recover()) is not None:  # an install cut by a power loss or crash
                log.warning("the image update interrupted by the last restart is now %s", phase)
        self.images = ImageControl(config.node_id, updater, commands=self.commands,
                                   publish_status=self.publish_status, round_busy=self.rounds.busy,
                                   signer=None if self.auth is None else self.auth.identity.signer)
        self.streams = self._stream_runners()  # [[streams]]: started with the broker link

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
        """The artifact's outputs, plus ``anomaly_score`` and ``anomaly`` for an anomaly model."""
        outs: list[Spec] = list(self.artifact.outputs)
        if self.anomaly is not None:
            outs += self.anomaly.specs(int(outs[0].shape[0]))
        return outs

    @property
    def labels_optional(self) -> bool:
        """Whether samples may come without labels over HTTP (anomaly models learn from unlabelled)."""
        return self.anomaly is not None

    @property
    def batched(self) -> bool:
        """Whether the inputs' leading dimension is a batch (False: exactly the compiled shapes)."""
        return bool(self.artifact.manifest.batched)

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
        if self._stopping.is_set():
            return NodeState.OFFLINE
        return NodeState.ONLINE if self.rounds.round_id is None else NodeState.TRAINING

    @property
    def round_id(self) -> str | None:
        return self.rounds.round_id

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
                "model_version": snap.version, "params_sha256": snap.sha256, "round_id": self.round_id,
                "samples": self.store.count, "state": self.state.value, "swarm": self.config.swarm,
                "broker": self.config.broker is not None, "trainable": self.trainer is not None,
                "last_loss": self.metrics.last_loss, "last_error": self.rounds.last_error,
                "anomaly_threshold": None if self.anomaly is None else self.anomaly.threshold,
                "inference": self.inference_info().model_dump(mode="json")}

    def inference_info(self) -> InferenceInfo:
        """What serves inference: the float model, or the int8 library and the parameters it was
        built from (behind ``model_version`` while a rebuild runs)."""
        return InferenceInfo() if self.int8 is None else self.int8.info()

    def _int8_serving(self, loaded_here: bool) -> Int8Serving | None:
        """The int8 serving of an artifact compiled with ``--train --quantize int8`` (precision int8
        or auto), or None: float."""
        setting = self.config.inference.precision
        if setting == PrecisionSetting.FLOAT:
            return None
        from compiler.manifest import Manifest  # standard library only

        quant = Manifest.read(self.config.artifact).quantization if loaded_here else None
        if quant is None:
            if setting == PrecisionSetting.INT8:
                why = ("has no int8 library" if loaded_here else
                       "is not the node's own (an embedder's artifact= object serves float)")
                raise ConfigError(f"[inference] precision = \"int8\" but the artifact {self.config.artifact} "
                                  f"{why}",
                                  hint="compile it with --train --quantize int8 --calibration DATA.npz, or "
                                       "set precision = \"float\"")
            return None
        import importlib.util

        if setting == PrecisionSetting.AUTO and importlib.util.find_spec("tvm") is None:
            # no compiler here (a C-backend board): an int8 library that cannot follow the rounds
            # would serve the shipped weights forever; "int8" keeps it all the same, on purpose
            log.info("serving float: this node cannot rebuild the int8 library after rounds (no TVM)")
            return None
        from compiler import load_artifact
        from edgenode.calibration import DEFAULT_SAMPLES
        from edgenode.requantize import BuildPriority, Int8Serving

        # the node's load checked the sha256 of every file, the int8 library's included
        library = load_artifact(self.config.artifact / quant.library, verify=False)
        tc = self.config.training
        return Int8Serving(self.config.artifact, library, list(self.artifact.params), self.model,
                           self.config.data_dir,
                           calibration_samples=(self.config.inference.calibration_samples
                                                or quant.calibration_samples or DEFAULT_SAMPLES),
                           publish=self._int8_changed, registry=self.metrics.registry, nice=tc.nice,
                           priority=BuildPriority.IDLE if tc.worker_priority == WorkerPriority.IDLE
                           else BuildPriority.NICE, threads=tc.worker_threads)

    def _int8_changed(self) -> None:
        """The int8 library was swapped, or its rebuild started or failed: tell the fleet (and an
        anomaly model's threshold follows the library that scores requests)."""
        if self.anomaly is not None:
            self._refit.set()
        self.publish_status()

    def _params_changed(self) -> None:
        """New committed parameters (round, merge, rollback): the anomaly threshold and the int8
        library follow them."""
        self._refit.set()
        if self.int8 is not None:
            self.int8.params_changed()

    def _anomaly_scorer(self) -> AnomalyScorer | None:
        ac = self.config.anomaly
        recon = is_reconstruction(self.inputs, self.artifact.outputs)
        if ac.mode == AnomalyMode.OFF or (ac.mode == AnomalyMode.AUTO and not (
                recon and self.trainer is not None and self.trainer.loss == "mse")):
            return None
        if not recon:
            raise ConfigError("[anomaly] mode = \"on\" needs a model that reconstructs its input (one "
                              "input, a first output of the same shape)", hint="set mode = \"off\"")
        return AnomalyScorer(self.inputs[0].name, self.artifact.outputs[0].name,
                             percentile=ac.percentile)

    def _sample_spec(self) -> SampleSpec:
        ins = tuple((s.name, tuple(int(d) for d in s.shape[1:]), str(np.dtype(s.dtype))) for s in self.inputs)
        if self.anomaly is not None:  # labels are flags (0 normal, 1 anomalous); the target is the input
            return SampleSpec(ins, (), "int64")
        if self.trainer is not None and self.trainer.loss == "mse":
            out = self.outputs[0]
            return SampleSpec(ins, tuple(int(d) for d in out.shape[1:]), "float32")
        return SampleSpec(ins, (), "int64")

    def _num_classes(self) -> int | None:
        if self.anomaly is not None:
            return 2
        if self.trainer is not None and self.trainer.loss == "mse":
            return None
        return int(self.outputs[0].shape[-1]) if self.outputs and self.outputs[0].shape else None

    # -- data plane --------------------------------------------------------------------------------
    def infer(self, inputs: Mapping[str, Any], *, shipped: bool = False) -> dict[str, np.ndarray]:
        """Run the model on a batch (any leading N >= 1) with one consistent parameter snapshot;
        ``shipped``: with the artifact's own parameters (version 0) instead of the current ones.

        Raises :class:`InvalidInput` naming the problem (missing/unknown input, shape, dtype):
        the artifact validates (``compiler.artifact.check_inputs``, the one validator).
        """
        t0 = time.perf_counter()
        if shipped:
            out = self.model.infer_shipped(inputs)
            self.metrics.inference(time.perf_counter() - t0)
            return out
        out = self._serve(inputs)
        if self.anomaly is not None:
            out.update(self.anomaly.score(dict(inputs), out))
        self.metrics.inference(time.perf_counter() - t0)
        return out

    def _serve(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The model's outputs as requests get them: the int8 library, or the float model. A request
        holding NaN or infinity goes to the float model: int8 has no such values (quantizing them is
        undefined), the float model gives ONNX's IEEE results."""
        if self.int8 is not None and not _holds_nonfinite(inputs):
            return self.int8.infer(inputs)
        return self.model.infer(inputs)

    def add_samples(self, inputs: dict[str, np.ndarray], labels: np.ndarray | None) -> int:
        """Store samples durably (one fsynced transaction) and return the new sample count."""
        return self.insert_samples(inputs, labels)[1]

    def insert_samples(self, inputs: dict[str, np.ndarray], labels: np.ndarray | None, *,
                       taken: np.ndarray | None = None) -> tuple[list[int], int]:
        """Store samples durably (one fsynced transaction); returns their ids and the new count.

        ``inputs[name]`` is (N, *input shape without batch), ``labels`` (N,) class ids for a ce
        model, (N, *output shape) targets for mse, (N,) flags 0/1 for an anomaly model, or None
        (not known yet: ``set_labels`` later). Raises InvalidInput or StoreError (full).
        """
        ids, count = self.store.insert(inputs, labels, ts=taken)
        self.metrics.samples(len(ids))
        self._samples_stored(len(ids))
        if time.monotonic() - self._last_status > _STATUS_MIN_S:  # sample count changed: tell the fleet,
            self.publish_status()  # at most once a second (heartbeats carry the rest)
        return ids, count

    def set_labels(self, label: Any, *, ids: list[int] | None = None, since: float | None = None,
                   until: float | None = None) -> int:
        """Labels that arrived later for stored samples (by id or time range); how many were set."""
        n = self.store.set_labels(label, ids=ids, since=since, until=until)
        if n and self.anomaly is not None:
            self._refit.set()  # samples flagged anomalous leave the threshold's normal set
            if since is not None and until is not None and np.all(np.asarray(label) == 1):
                self.anomaly.labelled_anomalous(since, until)
        return n

    def _samples_stored(self, n: int) -> None:
        if self.anomaly is None:
            return
        self._since_fit += n
        if self._since_fit >= self.config.anomaly.refresh_samples or self.anomaly.threshold is None:
            self._refit.set()

    def refresh_threshold(self) -> float | None:
        """Recompute the anomaly threshold now from the newest normal samples (committed params)."""
        if self.anomaly is None:
            return None
        self._since_fit = 0
        samples = self.store.snapshot(limit=self.config.anomaly.threshold_samples, which="normal")
        snap = self.model.snapshot
        params = snap.prepared if snap.prepared is not None else list(snap.params)
        out = self.artifact.outputs[0].name
        if self.int8 is not None:  # scored as requests are: on the int8 library
            int8 = self.int8
            return self.anomaly.fit(lambda x: int8.infer(x)[out], samples, snap.version)
        return self.anomaly.fit(lambda x: self.artifact.infer(x, params=params)[out], samples, snap.version)

    def _threshold_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._refit.wait(0.5):
                continue
            self._refit.clear()
            if self._stopping.is_set():
                return
            try:
                self.refresh_threshold()
            except Exception:  # noqa: BLE001 - a failed refresh keeps the last threshold
                log.exception("anomaly threshold refresh failed")

    def _stream_runners(self) -> list[StreamRunner]:
        if not self.config.streams:
            return []
        if len(self.inputs) != 1:
            raise ConfigError("[[streams]] feed models with one input; this model has "
                              f"{len(self.inputs)}", hint="remove [[streams]] or use a one-input model")
        spec = self.inputs[0]
        runners = []
        for sc in self.config.streams:
            if sc.input is not None and sc.input != spec.name:
                raise ConfigError(f"[[streams]] {sc.name}: input {sc.input!r} is not the model's input "
                                  f"{spec.name!r}", hint=f"set input = \"{spec.name}\" or remove it")
            runners.append(StreamRunner(sc, spec.name, tuple(int(d) for d in spec.shape[1:]),
                                        self.add_stream_samples, self.metrics))
        return runners

    def add_stream_samples(self, input_name: str, values: np.ndarray, taken: np.ndarray) -> int:
        """Store windows from a stream as unlabelled samples taken at ``taken`` (unix s); an anomaly
        model also scores them for the status's live view (not counted as inference requests)."""
        count = self.insert_samples({input_name: values}, None, taken=taken)[1]
        if self.anomaly is not None:
            inputs = {input_name: values}
            self.anomaly.observe(taken, self.anomaly.score(inputs, self._serve(inputs))[SCORE])
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
            will_topic = topics.status(self.config.swarm, self.node_id)
            will_payload: bytes | str = self._status(NodeState.OFFLINE).model_dump_json()
            if self.auth is not None:
                will_payload = self.auth.sign_will(will_topic, will_payload)
            link = MqttLink(self.config.broker, swarm=self.config.swarm, client_id=self.node_id,
                            will=(will_topic, will_payload), keepalive=self.config.keepalive_s,
                            on_oversized=self._on_oversized)
            self._link = link if self.auth is None else self.auth.wrap(link)
            if self._transport is None:
                self._transport = self._link.transport(self.node_id)
            # a restarted broker without persistence forgot our retained status: say it again
            self._link.on_connect(self._on_connect)
            self._link.subscribe(topics.command(self.config.swarm), self._on_command_message)
            for runner in self.streams:  # sensors do not sign: the raw link, never the signed one
                runner.start()
                link.subscribe(runner.cfg.topic, runner.on_message, inline=True)
        if self._transport is not None:
            self._connect_rounds(self._transport)
        if self._link is not None and self.config.training.sync == SyncMode.ASYNC:
            from edgenode.asyncrunner import AsyncRunner

            self.async_runner = AsyncRunner(self.rounds.parts, self._link)
            self.async_runner.start()
        if self.int8 is not None:
            self.int8.start()
        if self.anomaly is not None:
            self._refit.set()
            self._threshold_thread = threading.Thread(target=self._threshold_loop,
                                                      name=f"anomaly-{self.node_id}", daemon=True)
            self._threshold_thread.start()
        self.publish_status()
        if self._link is not None:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"hb-{self.node_id}",
                                               daemon=True)
            self._heartbeat.start()
        log.info("node %s started (model %s v%d)", self.node_id, self.model_name, self.model_version)

    def _connect_rounds(self, transport: Transport) -> None:
        """The round runner's swarm side: the training worker process (which hosts the collective),
        or a ring in this process plus, with a broker, a site leader's ring to the other sites."""
        if any(r.point == Point.VOTED for r in self.faults.rules):
            transport = self._transport = FaultyTransport(transport, self.faults)
        worker = self._start_training_worker(transport)
        if worker is not None:
            self.rounds.connect(worker, steps=worker, link=self._link)
            return
        from federation.ring import RingAllreduce

        ring = RingAllreduce(transport, swarm=self.config.swarm)
        backbone = None
        if self._link is not None:  # a site leader's ring to the other sites (bridged topics)
            from federation.backbone import backbone_transport

            backbone = RingAllreduce(backbone_transport(self._link, self.node_id), swarm=self.config.swarm)
        self.rounds.connect(ring, backbone=backbone, link=self._link)

    @property
    def training_worker(self) -> TrainingWorker | None:
        """The worker process running this node's rounds, or None (isolation = "thread", no swarm)."""
        return self._training_worker

    def _start_training_worker(self, transport: Transport) -> TrainingWorker | None:
        if not self._isolate:
            return None
        tc = self.config.training
        worker = TrainingWorker(self.config.artifact, transport, swarm=self.config.swarm, nice=tc.nice,
                                threads=tc.worker_threads, idle=tc.worker_priority == WorkerPriority.IDLE,
                                call_timeout_s=max(60.0, 2 * tc.step_timeout_s + 30))
        try:
            worker.start()
        except TrainerWorkerError as exc:  # e.g. an emulated node that cannot exec its own Python
            log.warning("%s; training runs in the node process", exc)
            return None
        self._training_worker = worker
        return worker

    def stop(self, timeout: float = 10.0) -> None:
        """Abort a running round, publish the offline status, disconnect, close the store. Idempotent."""
        if not self._started:
            self.store.close()
            return
        self._started = False
        self._stopping.set()
        self.rounds.stop(timeout)
        if self.async_runner is not None:
            self.async_runner.stop(timeout)
            self.async_runner = None
        if self._heartbeat is not None:
            self._heartbeat.join(timeout)
        if self._threshold_thread is not None:
            self._threshold_thread.join(timeout)
        if self.int8 is not None:
            self.int8.stop(timeout)
        info = self.publish_status()  # offline (self.state)
        if info is not None:  # let the offline status reach the broker before we disconnect
            try:
                info.wait_for_publish(timeout=2.0)
            except Exception:  # noqa: BLE001 - not connected: the Last Will says offline anyway
                pass
        if self._link is not None:
            self._link.close()
            self._link = None
        self.rounds.disconnect()
        for runner in self.streams:
            runner.stop()
        self.store.close()
        log.info("node %s stopped", self.node_id)

    def __enter__(self) -> EdgeNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- commands ------------------------------------------------------------------------------------
    def _on_command_message(self, topic: str, payload: bytes) -> None:
        self.handle_command(payload)

    def handle_command(self, command: bytes | str | AnyCommand) -> None:
        """Handle one fleet command (non-blocking): rounds go to the round runner, image updates to
        the image control. Malformed payloads are rejected and counted."""
        if isinstance(command, (bytes, str)):
            try:
                command = parse_command(command)
            except (ValidationError, ValueError) as exc:
                self.metrics.rejected()
                log.warning("rejected malformed command: %s", str(exc).splitlines()[0])
                return
        if isinstance(command, RoundCommand):
            self.rounds.handle(command)
        elif isinstance(command, RoundAbort):
            self.rounds.abort(command)
        elif isinstance(command, RollbackCommand):
            if self.node_id in command.nodes and self.commands.first_time(command.rollback_id):
                self.rounds.rollback(command.to_version, command.rollback_id)
        elif isinstance(command, (ImageUpdateCommand, ImageRollbackCommand)):
            self.images.handle(command)

    # The round runner's and the image control's surface, for the HTTP layer, embedders and tests.
    def add_event_listener(self, fn: Callable[[RoundEvent], None]) -> None:
        """Call ``fn(event)`` for every RoundEvent this node emits (also published over MQTT)."""
        self.rounds.add_event_listener(fn)

    def start_round(self, cmd: RoundCommand) -> threading.Thread:
        """Run ``cmd`` on the round worker thread; raises NodeBusy if a round is running."""
        return self.rounds.start_round(cmd)

    def run_round(self, cmd: RoundCommand) -> RoundResult:
        """Run one round on the calling thread (STEP/DONE/FAILED events; RoundFailed on failure)."""
        return self.rounds.run_round(cmd)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no round runs (True) or ``timeout`` passes (False)."""
        return self.rounds.wait_idle(timeout)

    def rollback(self, to_version: int, rollback_id: str = "") -> bool:
        """Return to the kept parameters ``to_version``; False (logged) when the node cannot."""
        return self.rounds.rollback(to_version, rollback_id)

    @property
    def last_result(self) -> RoundResult | None:
        return self.rounds.last_result

    @property
    def last_error(self) -> str | None:
        return self.rounds.last_error

    @property
    def validation(self) -> Validation | None:
        """Loss/accuracy after the last committed round or rollback."""
        return self.rounds.validation

    @property
    def reboot_requested(self) -> threading.Event:
        """Set when a staged image waits for a restart (``fractal node`` exits for the supervisor)."""
        return self.images.reboot_requested

    # -- status --------------------------------------------------------------------------------
    def _status(self, state: NodeState | None = None) -> NodeStatus:
        snap = self.model.snapshot
        count = self.store.count
        val = self.store.count_part("val", self.config.training.validation_share)
        m = self.artifact.manifest
        return NodeStatus(node_id=self.node_id, state=state or self.state, arch=self.arch, board=self.board,
                          model=self.model_name, model_version=snap.version, params_sha256=snap.sha256,
                          samples=count,
                          round_id=self.round_id, api_url=self.config.advertised_url, site=self.config.site,
                          artifact=ArtifactInfo(model=self.model_name, target=m.preset, tuned=m.tuning.tuned,
                                                tvm_version=m.tvm_version),
                          inference=self.inference_info(),
                          health=self.facts.health(), samples_train=max(0, count - val), samples_val=val,
                          samples_new=self.store.count_new(),
                          validation=self.rounds.validation, versions=self.model.versions.available(),
                          anomaly=None if self.anomaly is None else self.anomaly.trace(),
                          image=self.images.image_info(),
                          heartbeat_s=self.config.heartbeat_s, keepalive_s=float(self.config.keepalive_s))

    def status(self) -> NodeStatus:
        """The NodeStatus this node publishes (retained) right now."""
        return self._status()

    def publish_status(self) -> Publication | None:
        """Publish the retained status now (also done on every state change and heartbeat)."""
        link = self._link
        if link is None:
            return None
        if not link.connected:
            # Between a lost connection and the renewed subscriptions: say nothing. paho sends a
            # PUBLISH as soon as the new socket exists, before the CONNACK and so before the
            # re-SUBSCRIBE (clean session: the broker drops our commands until then); a status
            # sent there told the fleet "online" while a round command would still be lost. The
            # on_connect hook publishes the status right after the re-SUBSCRIBE (in order on the
            # connection), and one queued while disconnected would be resent after it, stale.
            return None
        self._last_status = time.monotonic()
        try:
            return link.publish(topics.status(self.config.swarm, self.node_id), self._status(),
                                retain=True, qos=1)
        except Exception as exc:  # noqa: BLE001 - a broker hiccup must not kill a round or a request
            log.warning("status publish failed: %s", exc)
            return None

    def _on_oversized(self, topic: str, size: int) -> None:
        """A payload over MESSAGE_SIZE_LIMIT, dropped by the link before anything parsed it."""
        if self.auth is not None:
            from federation.auth import Reject  # lazy: `cryptography` only for signed swarms

            self.auth.count(topic, Reject.OVERSIZED)
        else:
            self.metrics.rejected()

    def _on_connect(self, reconnected: bool) -> None:
        if reconnected:  # a restarted broker without persistence forgot our retained status
            self.publish_status()

    def _heartbeat_loop(self) -> None:
        if self.images.updater is None:
            while not self._stopping.wait(self.config.heartbeat_s):
                self.publish_status()
            return
        # Booted from a device: the supervisor marks the slot good (or not) after the node started;
        # tell the fleet as soon as the boot state says so, not a heartbeat later.
        poll = min(self.config.heartbeat_s, 0.25)
        seen = self.images.image_info()
        while not self._stopping.wait(poll):
            now = self.images.image_info()
            if now != seen or time.monotonic() - self._last_status >= self.config.heartbeat_s:
                seen = now
                self.publish_status()


def _check_writable(data_dir: Path) -> None:
    """One clear error at start for a data directory the node cannot write (read-only file
    system, permissions, a file in the way), instead of a SQLite error deep in the store."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / f".write-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"data_dir {data_dir} is not writable: {exc.strerror or exc}",
                          hint="point data_dir at a writable directory (the node stores samples and "
                               "parameters there)") from None


def _holds_nonfinite(inputs: Mapping[str, Any]) -> bool:
    """Whether a float input holds NaN or infinity (inputs that are not arrays of numbers: False,
    the artifact's validator names what is wrong with them)."""
    if not isinstance(inputs, Mapping):
        return False
    for v in inputs.values():
        a = v if isinstance(v, np.ndarray) else None
        if a is None:
            try:
                a = np.asarray(v)
            except (ValueError, TypeError):
                return False
        if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
            return True
    return False
