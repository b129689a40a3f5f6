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


Command = Annotated[RoundCommand | RoundAbort, Field(discriminator="kind")]
_command_adapter: TypeAdapter[RoundCommand | RoundAbort] = TypeAdapter(Command)


class RoundEvent(_Msg):
    """Published by each participant on ``rounds/{round_id}/events/{node}``."""

    kind: EventKind
    round_id: str
    node_id: str
    step: int = 0
    loss: float | None = None
    params_sha256: str | None = None  # on DONE: the committed parameters
    model_version: int | None = None
    reason: str | None = None  # on FAILED
    ts: float = Field(default_factory=time.time)


def parse_command(payload: bytes | str) -> RoundCommand | RoundAbort:
    """Parse a ``cmd`` payload; raises ``pydantic.ValidationError`` on anything malformed."""
    return _command_adapter.validate_json(payload)


def parse_status(payload: bytes | str) -> NodeStatus:
    return NodeStatus.model_validate_json(payload)


def parse_event(payload: bytes | str) -> RoundEvent:
    return RoundEvent.model_validate_json(payload)
