"""JSON control messages shared by nodes and the fleet service. Every payload carries ``v``.

Binary allreduce frames are not here: see ``federation/framing.py``.
"""

from __future__ import annotations

import enum
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

__all__ = [
    "FORMAT_VERSION",
    "NodeState",
    "SyncMode",
    "Compression",
    "EventKind",
    "NodeStatus",
    "RoundCommand",
    "RoundAbort",
    "RoundEvent",
    "RollbackCommand",
    "ArtifactInfo",
    "NodeHealth",
    "Validation",
    "Command",
    "parse_command",
    "parse_status",
    "parse_event",
]

FORMAT_VERSION: Literal[1] = 1


class NodeState(enum.StrEnum):
    ONLINE = "online"  # idle, serving inference
    TRAINING = "training"  # inside a round
    OFFLINE = "offline"  # graceful stop or Last Will


class SyncMode(enum.StrEnum):
    GRADIENT = "gradient"  # allreduce gradients every step (synchronous SGD)
    LOCAL_SGD = "local-sgd"  # k local steps, then average the parameter deltas


class Compression(enum.StrEnum):
    NONE = "none"
    FP16 = "fp16"
    INT8 = "int8"  # with error feedback
    TOPK = "topk"  # with error feedback


class EventKind(enum.StrEnum):
    STEP = "round.step"
    DONE = "round.done"
    FAILED = "round.failed"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    v: Literal[1] = FORMAT_VERSION


class _Part(BaseModel):
    """A nested object of a message (versioned with the message that carries it)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class ArtifactInfo(_Part):
    """What a node serves and trains, from its artifact's manifest."""

    model: str = ""
    target: str = ""  # target preset, e.g. x86_64-avx2
    tuned: bool = False
    tvm_version: str = ""


class NodeHealth(_Part):
    uptime_s: float = Field(ge=0)
    cpu_percent: float = Field(ge=0)  # of one core; may exceed 100 on several cores
    mem_rss_bytes: int = Field(ge=0)
    mem_percent: float = Field(ge=0, le=100)  # of the machine's memory
    disk_free_bytes: int = Field(ge=0)  # in the node's data directory


class Validation(_Part):
    """Loss (and accuracy for classification models) on a node's held-back validation samples."""

    loss: float
    accuracy: float | None = Field(default=None, ge=0, le=1)  # None for regression models
    samples: int = Field(ge=0)
    model_version: int | None = Field(default=None, ge=0)  # the parameters it was measured on


class NodeStatus(_Msg):
    """Retained at ``status/{node}``; the Last Will is the same with ``state=offline``."""

    kind: Literal["status"] = "status"
    node_id: str
    state: NodeState
    arch: str = ""  # uname -m of the board, e.g. x86_64, aarch64, riscv64
    board: str = ""  # target preset, e.g. rpi4
    model: str = ""
    model_version: int = 0  # increments with every committed round
    params_sha256: str = ""
    samples: int = 0
    round_id: str | None = None
    api_url: str = ""
    # Optional (older nodes leave them out): the device, for the fleet's node table.
    artifact: ArtifactInfo | None = None
    health: NodeHealth | None = None
    samples_train: int | None = Field(default=None, ge=0)
    samples_val: int | None = Field(default=None, ge=0)
    validation: Validation | None = None  # after the last committed round (or rollback)
    versions: list[int] = Field(default_factory=list, max_length=1024)  # versions held (rollback targets)
    heartbeat_s: float = 5.0  # a status is re-published at least this often
    keepalive_s: float = 10.0  # MQTT keepalive: the Last Will fires within 1.5x of it
    ts: float = Field(default_factory=time.time)


class RoundCommand(_Msg):
    """Published on ``cmd`` by the fleet: every listed participant runs the round."""

    kind: Literal["round.start"] = "round.start"
    round_id: str
    steps: int = Field(ge=1, le=100_000)
    lr: float | None = Field(default=None, gt=0)
    sync: SyncMode = SyncMode.GRADIENT
    local_steps: int = Field(default=1, ge=1)
    participants: list[str]  # ring order = sorted(participants)
    compression: Compression = Compression.NONE
    step_timeout_s: float = Field(default=30.0, gt=0)
    issued_at: float = Field(default_factory=time.time)


class RoundAbort(_Msg):
    kind: Literal["round.abort"] = "round.abort"
    round_id: str
    reason: str


class RollbackCommand(_Msg):
    """Published on ``cmd`` by the fleet: every listed node restores the parameters it committed as
    ``to_version`` and forgets its later versions (the next round commits ``to_version + 1``).
    Nodes answer with their status (``model_version``, ``params_sha256``); not signed yet."""

    kind: Literal["model.rollback"] = "model.rollback"
    rollback_id: str
    nodes: list[str] = Field(min_length=1, max_length=1024)
    to_version: int = Field(ge=0)
    reason: str = ""
    issued_at: float = Field(default_factory=time.time)


Command = Annotated[RoundCommand | RoundAbort | RollbackCommand, Field(discriminator="kind")]
_command_adapter: TypeAdapter[RoundCommand | RoundAbort | RollbackCommand] = TypeAdapter(Command)


class RoundEvent(_Msg):
    """Published by each participant on ``rounds/{round_id}/events/{node}``."""

    kind: EventKind
    round_id: str
    node_id: str
    step: int = 0
    loss: float | None = None
    # STEP: the losses of the steps since the previous STEP event, the last one being ``step``
    # (a node throttles events by time, not points); ``loss`` is the last of them.
    losses: list[float | None] | None = Field(default=None, max_length=100_000)
    params_sha256: str | None = None  # on DONE: the committed parameters
    model_version: int | None = None
    reason: str | None = None  # on FAILED
    # DONE: validation before the round (the parameters it started from) and after the commit.
    val_before: Validation | None = None
    val_after: Validation | None = None
    ts: float = Field(default_factory=time.time)


def parse_command(payload: bytes | str) -> RoundCommand | RoundAbort | RollbackCommand:
    """Parse a ``cmd`` payload; raises ``pydantic.ValidationError`` on anything malformed."""
    return _command_adapter.validate_json(payload)


def parse_status(payload: bytes | str) -> NodeStatus:
    return NodeStatus.model_validate_json(payload)


def parse_event(payload: bytes | str) -> RoundEvent:
    return RoundEvent.model_validate_json(payload)
