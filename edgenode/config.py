"""``NODE.toml``: the one typed settings object of an edge node.

Example::

    node_id = "node-1"
    artifact = "artifacts/digits-mlp"     # relative paths are resolved against NODE.toml's folder
    port = 8081
    data_dir = "data/node-1"
    broker = "mqtt://127.0.0.1:1883"      # absent = no swarm (inference + samples only)
    swarm = "default"
    site = "east"                         # optional: its site in hierarchical rounds (PROTOCOL.md s. 10)
    auth_token = "s3cret"                 # optional: every route but health needs Bearer
    max_body_bytes = 8388608
    max_batch = 256                       # largest inference batch per request (HTTP answers 413 above)
    host = "127.0.0.1"

    [training]                            # defaults; a RoundCommand may override lr/sync/local_steps
    lr = 0.05                             # absent = the artifact's compiled learning rate
    batch = 32                            # must equal the training module's compiled batch if set
    sync = "gradient"                     # or "local-sgd"
    local_steps = 4
    step_timeout_s = 30.0
    compression = "none"                  # none | fp16 | int8 | topk
    round_memory_mb = 128                 # a round trains on the newest samples that fit in this
    aggregation = "mean"                  # mean | median | trimmed_mean (federation/robust.py)
    outlier_factor = 10.0                 # exclude updates above 10 x the median norm; 0 = off
    nice = 10                             # nice of the round thread / training worker: 0..19
    isolation = "process"                 # or "thread": where the training step computes
    worker_threads = 1                    # TVM threads of the training worker process
    worker_priority = "idle"              # SCHED_IDLE: the worker runs only on otherwise idle cores

    [inference]                           # what serves inference requests (edgenode/requantize.py)
    precision = "auto"                    # auto | int8 | float; auto: int8 when the artifact has it
    calibration_samples = 0               # int8 rebuilds calibrate on the newest N samples; 0: as compiled

    [store]
    max_samples = 100000
    retention = "drop-oldest"             # or "reject"

    [anomaly]                             # reconstruction models (autoencoders): edgenode/anomaly.py
    mode = "auto"                         # auto | on | off
    percentile = 99.0                     # threshold = this percentile of recent normal errors
    threshold_samples = 1000
    refresh_samples = 200

    [[streams]]                           # sensor topics on the broker -> windows -> samples
    name = "vib"                          # (all keys: edgenode/streams/config.py)
    topic = "sensors/m1/#"
    format = "senml"
    fields = ["ax"]
    sample_rate_hz = 1000.0
    window = 640

Any problem becomes one :class:`ConfigError` naming the key and how to fix it.
"""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edgenode.errors import ConfigError
from edgenode.streams.config import StreamConfig
from federation.messages import Precision
from federation.roundspec import RoundDefaults
from federation.topics import validate_id

__all__ = ["NodeConfig", "AnomalyConfig", "AnomalyMode", "TrainingConfig", "StoreConfig", "Retention",
           "Isolation", "WorkerPriority", "InferenceConfig", "PrecisionSetting", "load_config"]


class Retention(enum.StrEnum):
    DROP_OLDEST = "drop-oldest"  # keep the newest max_samples: sensors drift, recent data matters most
    REJECT = "reject"  # refuse new samples once full (the API answers 507-ish 4xx)


class Isolation(enum.StrEnum):
    PROCESS = "process"  # the training step computes in a worker process (edgenode/trainworker.py)
    THREAD = "thread"  # in the node process, on the round thread (shares the GIL with inference)


class WorkerPriority(enum.StrEnum):
    NICE = "nice"  # the worker process runs at [training] nice
    IDLE = "idle"  # Linux SCHED_IDLE: only when a core has nothing else to run (may starve a round)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainingConfig(_Section, RoundDefaults):
    """The node's ``[training]`` table: the round defaults (``federation.roundspec.RoundDefaults``:
    lr, sync, local_steps, compression, step_timeout_s, aggregation, outlier_factor, with the bounds
    a round command has) plus what only the node decides."""

    batch: int | None = Field(default=None, ge=1)
    seed: int = 0  # per-node sampling seed is seed + a hash of node_id
    # A round trains on an in-memory copy of the NEWEST samples that fit in this budget (a board
    # has little RAM; max_samples of large inputs would not fit).
    round_memory_mb: float = Field(default=128.0, gt=0)
    # Linux nice value of the round worker thread; the TVM threads it spawns inherit it. Training
    # is background work: at equal priority it doubled-to-octupled the inference p99
    # (docs/benchmarks-history.md, "## serve"). 0 = same priority as inference; an unprivileged
    # process cannot go below 0.
    nice: int = Field(default=10, ge=0, le=19)
    # Where a round's training step (loss + gradients, optimizer) computes. "process": a worker
    # process (no GIL shared with the inference threads; figures: BENCHMARKS.md, "serve").
    # "thread": on the round thread in the node process. The round's control flow, collectives
    # and the atomic parameter swap stay in the node either way.
    isolation: Isolation = Isolation.PROCESS
    # TVM threads of the training worker process: 1 leaves the other core(s) of a small board
    # to inference (more threads speed a large model's step but compete with serving).
    worker_threads: int = Field(default=1, ge=1, le=64)
    # CPU class of the worker process. "idle" (Linux SCHED_IDLE): it runs only when a core has
    # nothing else to run, so serving gets every cycle it wants (at nice 10 the worker still
    # took CPU time from the inference threads:
    # docs/benchmarks-history.md, "Training off the serving path"). A board saturated by serving
    # for longer than step_timeout_s stalls its rounds' steps until they time out; "nice" then
    # shares the CPU by [training] nice instead.
    worker_priority: WorkerPriority = WorkerPriority.IDLE
    # Share of the samples held back for validation (chosen by a hash of each sample's content, so
    # a sample is always on the same side); evaluated before and after every committed round.
    validation_share: float = Field(default=0.2, ge=0, lt=1)
    # Committed parameter versions kept in data_dir/versions (plus the shipped version 0), so the
    # swarm can roll back together.
    keep_versions: int = Field(default=5, ge=1, le=1000)
    # aggregation and outlier_factor (RoundDefaults): how a step combines the members' updates
    # (federation/robust.py): "mean" (ring allreduce), "median" or "trimmed_mean" (coordinate-wise,
    # over an all-gather: n x the bytes), and the screening of updates above outlier_factor x the
    # median norm (0 = off). A round command may override both; every member must use the same.


class PrecisionSetting(enum.StrEnum):
    """``[inference] precision``: what serves requests. The values besides auto are the status's
    :class:`federation.messages.Precision` (what the node then reports)."""

    AUTO = "auto"  # int8 when the artifact carries an int8 library (--train --quantize int8), else float
    INT8 = Precision.INT8.value  # the int8 library, rebuilt after every commit; refused without one
    FLOAT = Precision.FLOAT.value  # the float model with the committed parameters (no rebuilds)


class InferenceConfig(_Section):
    """``[inference]``: float or int8 serving (training stays float; edgenode/requantize.py)."""

    precision: PrecisionSetting = PrecisionSetting.AUTO
    # int8 rebuilds calibrate on the node's newest stored samples, this many (0: as many as the
    # artifact's own library was calibrated on)
    calibration_samples: int = Field(default=0, ge=0, le=1_000_000)


class StoreConfig(_Section):
    max_samples: int = Field(default=100_000, ge=1)
    retention: Retention = Retention.DROP_OLDEST


class AnomalyMode(enum.StrEnum):
    AUTO = "auto"  # on for a model whose training loss is mse and whose output has its input's shape
    ON = "on"  # on for any model that reconstructs its input (one input, output of the same shape)
    OFF = "off"


class AnomalyConfig(_Section):
    """``[anomaly]``: scores, flags and threshold of a reconstruction model (edgenode/anomaly.py)."""

    mode: AnomalyMode = AnomalyMode.AUTO
    # The threshold is this percentile of the reconstruction errors of the newest normal samples.
    percentile: float = Field(default=99.0, gt=0, le=100)
    threshold_samples: int = Field(default=1000, ge=1, le=1_000_000)
    refresh_samples: int = Field(default=200, ge=1)  # new samples between threshold refreshes


class NodeConfig(_Section):
    node_id: str
    artifact: Path
    port: int = Field(default=8080, ge=0, le=65535)
    data_dir: Path
    broker: str | None = None
    swarm: str = "default"
    # The site (broker) this node belongs to in hierarchical rounds (federation/PROTOCOL.md
    # section 10); reported in its status, the fleet groups a round's participants by it.
    site: str | None = None
    auth_token: str | None = None
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    # Largest batch N one HTTP inference request may carry: a binary batch under max_body_bytes
    # could otherwise keep an inference thread busy for seconds (413 naming this key). In-process
    # callers of EdgeNode.infer (evaluation, tests) are not capped.
    max_batch: int = Field(default=256, ge=1)
    host: str = "127.0.0.1"
    board: str = ""  # target preset name the image was built for; default: the artifact's preset
    api_url: str = ""  # advertised in NodeStatus; default http://{host}:{port}
    heartbeat_s: float = Field(default=5.0, gt=0)
    keepalive_s: int = Field(default=10, ge=1)
    # Signed swarm (python -m deploy.keys): this node's key file and the swarm keyring. With both,
    # everything it publishes is signed and it acts only on messages signed by their sender
    # (commands: the fleet's key). Relative paths are relative to the config file.
    key_file: Path | None = None
    keyring_file: Path | None = None
    # The device directory this node was booted from (written by `fractal boot`): with it, the node
    # reports its image in its status and takes image updates / image rollbacks from the fleet.
    device: Path | None = None
    # A fresh id per boot, written by `fractal boot` and returned on /v2/health/ready: the boot's
    # health check trusts only the node it started, never another process on the port.
    boot_id: str = Field(default="", max_length=64)
    training: TrainingConfig = TrainingConfig()
    inference: InferenceConfig = InferenceConfig()
    store: StoreConfig = StoreConfig()
    anomaly: AnomalyConfig = AnomalyConfig()
    # Sensor streams over MQTT into the sample store (edgenode/streams/): needs `broker`.
    streams: list[StreamConfig] = Field(default_factory=list, max_length=64)

    @field_validator("node_id", "swarm")
    @classmethod
    def _topic_safe(cls, v: str) -> str:
        return validate_id(v, "id")

    @field_validator("site")
    @classmethod
    def _site_id(cls, v: str | None) -> str | None:
        return None if v is None else validate_id(v, "site")

    @field_validator("broker")
    @classmethod
    def _broker_url(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("mqtt://") or v.startswith("mqtts://")):
            raise ValueError("must look like mqtt://host:port or mqtts://host:port")
        return v

    @property
    def advertised_url(self) -> str:
        return self.api_url or f"http://{self.host}:{self.port}"

    @classmethod
    def from_toml(cls, path: str | Path) -> NodeConfig:
        """Read and validate ``path``; relative ``artifact``/``data_dir`` are relative to its folder."""
        return load_config(path)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: Path | None = None,
                  source: str = "config") -> NodeConfig:
        """Validate a parsed config (``base`` resolves relative paths); errors become ConfigError."""
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            raise _config_error(exc, source) from None
        if base is not None:
            def rel(p: Path | None) -> Path | None:
                return base / p if p is not None and not p.is_absolute() else p

            cfg = cfg.model_copy(update={
                "artifact": rel(cfg.artifact), "data_dir": rel(cfg.data_dir),
                "key_file": rel(cfg.key_file), "keyring_file": rel(cfg.keyring_file),
                "device": rel(cfg.device),
            })
        if cfg.streams and cfg.broker is None:
            raise ConfigError(f"{source}: [[streams]] needs `broker`",
                              hint="set broker = \"mqtt://host:port\" (the broker the sensors publish to)")
        names = [s.name for s in cfg.streams]
        if len(set(names)) != len(names):
            raise ConfigError(f"{source}: two [[streams]] share a name", hint="give each stream its own name")
        if (cfg.key_file is None) != (cfg.keyring_file is None):
            raise ConfigError(f"{source}: key_file and keyring_file go together",
                              hint="make both with python -m deploy.keys")
        if not cfg.artifact.is_dir():
            raise ConfigError(f"{source}: artifact: {cfg.artifact} is not a directory",
                              hint="point `artifact` at a folder written by `fractal compile`")
        return cfg


def _config_error(exc: ValidationError, source: str) -> ConfigError:
    """Turn pydantic's first error into one line: which key, what is wrong, how to fix it."""
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "missing":
        return ConfigError(f"{source}: missing required key `{key}`",
                           hint=f"add `{key} = ...` to the config (see edgenode/config.py for an example)")
    if kind == "extra_forbidden":
        return ConfigError(f"{source}: unknown key `{key}`",
                           hint="remove it or fix its spelling (keys: node_id, artifact, port, data_dir, "
                                "broker, swarm, auth_token, max_body_bytes, max_batch, host, device, "
                                "[training], [inference], [store], [anomaly], [[streams]])")
    if kind == "enum":
        allowed = err.get("ctx", {}).get("expected", "")
        return ConfigError(f"{source}: `{key}` = {err.get('input')!r} is not allowed",
                           hint=f"use one of {allowed}")
    msg = err["msg"].removeprefix("Value error, ")
    return ConfigError(f"{source}: `{key}` = {err.get('input')!r}: {msg}",
                       hint=f"fix the value of `{key}`")


def load_config(path: str | Path) -> NodeConfig:
    """Load ``NODE.toml``; every failure is a :class:`ConfigError` with a hint."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found",
                          hint="pass --config PATH to an existing NODE.toml") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}",
                          hint="check the path and permissions") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}",
                          hint="fix the syntax (strings need quotes)") from None
    return NodeConfig.from_dict(data, base=p.resolve().parent, source=str(p))
