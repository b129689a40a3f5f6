"""JSON control messages shared by nodes and the fleet service. Every payload carries ``v``.

Binary allreduce frames are not here: see ``federation/framing.py``.
"""

from __future__ import annotations

import enum
import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from federation import bounds as b

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
    node_id: b.Id
    state: NodeState
    arch: b.Text = ""  # uname -m of the board, e.g. x86_64, aarch64, riscv64
    board: b.Text = ""  # target preset, e.g. rpi4
    model: b.Text = ""
    model_version: b.ModelVersion = 0  # increments with every committed round
    params_sha256: b.Sha256Hex = ""
    samples: b.Samples = 0
    round_id: b.Id | None = None
    api_url: b.Url = ""
    heartbeat_s: b.HeartbeatS = 5.0  # a status is re-published at least this often
    keepalive_s: b.KeepaliveS = 10.0  # MQTT keepalive: the Last Will fires within 1.5x of it
    ts: b.Finite = Field(default_factory=time.time)


class RoundCommand(_Msg):
    """Published on ``cmd`` by the fleet: every listed participant runs the round."""

    kind: Literal["round.start"] = "round.start"
    round_id: b.Id
    steps: b.Steps
    lr: b.Lr | None = None
    sync: SyncMode = SyncMode.GRADIENT
    local_steps: b.LocalSteps = 1
    participants: b.Participants  # ring order = sorted(participants)
    compression: Compression = Compression.NONE
    step_timeout_s: b.StepTimeout = 30.0
    issued_at: b.Finite = Field(default_factory=time.time)
    # The parameters the round starts from (federation/startversion.py); None = the members decide.
    start_sha256: b.Sha256Hex | None = None

    @model_validator(mode="after")
    def _round_work(self) -> RoundCommand:
        b.check_round(self.steps, self.local_steps, self.step_timeout_s)
        return self


class RoundAbort(_Msg):
    kind: Literal["round.abort"] = "round.abort"
    round_id: b.Id
    reason: b.Reason


Command = Annotated[RoundCommand | RoundAbort, Field(discriminator="kind")]
_command_adapter: TypeAdapter[RoundCommand | RoundAbort] = TypeAdapter(Command)


class RoundEvent(_Msg):
    """Published by each participant on ``rounds/{round_id}/events/{node}``."""

    kind: EventKind
    round_id: b.Id
    node_id: b.Id
    step: int = Field(default=0, ge=0, le=b.STEPS_MAX * b.LOCAL_STEPS_MAX)
    loss: b.Loss = None  # NaN/Inf arrive as null
    params_sha256: b.Sha256Hex | None = None  # on DONE: the committed parameters
    model_version: b.ModelVersion | None = None
    reason: b.Reason | None = None  # on FAILED
    ts: b.Finite = Field(default_factory=time.time)


def _with_version(payload: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """The payload as a JSON object that carries ``v`` (a message without it is refused)."""
    try:
        doc = json.loads(bytes(payload) if isinstance(payload, (bytearray, memoryview)) else payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationError.from_exception_data(
            "message", [{"type": "json_invalid", "loc": (), "input": "",
                         "ctx": {"error": str(exc)[:200]}}]) from None
    if not isinstance(doc, dict) or "v" not in doc:
        raise ValidationError.from_exception_data(
            "message", [{"type": "missing", "loc": ("v",), "input": doc if isinstance(doc, dict) else {}}])
    return doc


def parse_command(payload: bytes | bytearray | memoryview | str) -> RoundCommand | RoundAbort:
    """Parse a ``cmd`` payload; raises ``pydantic.ValidationError`` on anything malformed or out
    of bounds (``federation/bounds.py``) and on a payload without ``v``."""
    return _command_adapter.validate_python(_with_version(payload))


def parse_status(payload: bytes | bytearray | memoryview | str) -> NodeStatus:
    return NodeStatus.model_validate(_with_version(payload))


def parse_event(payload: bytes | bytearray | memoryview | str) -> RoundEvent:
    return RoundEvent.model_validate(_with_version(payload))
