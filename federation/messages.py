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
from federation.roundspec import Compression, RoundSpec, SyncMode

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
    "ImageUpdateCommand",
    "ImageRollbackCommand",
    "UpdatePhase",
    "ImageUpdate",
    "ImageInfo",
    "ArtifactInfo",
    "Precision",
    "Int8State",
    "InferenceInfo",
    "NodeHealth",
    "Validation",
    "AnomalyTrace",
    "Command",
    "AnyCommand",
    "parse_command",
    "parse_status",
    "parse_event",
]

FORMAT_VERSION: Literal[1] = 1


class NodeState(enum.StrEnum):
    ONLINE = "online"  # idle, serving inference
    TRAINING = "training"  # inside a round
    OFFLINE = "offline"  # graceful stop or Last Will
    # `fractal boot` found no slot it may start (firmware/boot.py): nothing runs, ``halt`` says
    # why. Published once, retained, without heartbeats: it stays until the board boots again.
    HALTED = "halted"


class EventKind(enum.StrEnum):
    STEP = "round.step"
    DONE = "round.done"
    FAILED = "round.failed"


class UpdatePhase(enum.StrEnum):
    """Where a node is with an image update or image rollback (reported in ``NodeStatus.image``)."""

    DOWNLOADING = "downloading"  # fetching the image from the fleet (range requests, resumable)
    REBOOTING = "rebooting"  # staged in the inactive slot; restarting through the boot supervisor
    TRIAL = "trial"  # running from the new slot, its health check not passed yet
    DONE = "done"  # the new slot passed its health check and is marked good
    ROLLED_BACK = "rolled_back"  # the new slot failed its health check: the board fell back by itself
    FAILED = "failed"  # refused before anything changed (download, verification, flash, busy)


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


class Precision(enum.StrEnum):
    """What a node's inference runs: the float model with the committed parameters, or the int8
    library (``fractal compile --train --quantize int8``), rebuilt from them after each round."""

    INT8 = "int8"
    FLOAT = "float"


class Int8State(enum.StrEnum):
    """The int8 library a node serves, against its committed parameters (edgenode/requantize.py)."""

    CURRENT = "current"  # built from the committed parameters
    BUILDING = "building"  # behind them; a rebuild runs (the previous library serves meanwhile)
    # behind them; the last rebuild failed (the previous library serves; the next commit retries)
    FAILED = "failed"


class InferenceInfo(_Part):
    """What serves a node's inference requests (absent: float, the only choice of older nodes)."""

    precision: Precision = Precision.FLOAT
    # int8 only: the committed parameter version and sha256 the serving library was built from
    # (behind model_version while a rebuild runs), its state and the last rebuild's seconds / error
    built_from_version: b.ModelVersion | None = None
    built_from_sha256: b.Sha256Hex | None = None
    int8_state: Int8State | None = None
    build_s: b.Finite | None = None
    error: b.Reason | None = None


class NodeHealth(_Part):
    uptime_s: float = Field(ge=0)
    cpu_percent: float = Field(ge=0)  # of one core; may exceed 100 on several cores
    mem_rss_bytes: int = Field(ge=0)
    mem_percent: float = Field(ge=0, le=100)  # of the machine's memory
    disk_free_bytes: int = Field(ge=0)  # in the node's data directory


class Validation(_Part):
    """Loss (and accuracy for classification models) on a node's held-back validation samples."""

    loss: b.Finite
    accuracy: float | None = Field(default=None, ge=0, le=1)  # None for regression models
    # anomaly models (edgenode/anomaly.py): ROC AUC of the scores on the labelled validation samples
    auc: float | None = Field(default=None, ge=0, le=1)
    samples: b.Samples
    model_version: b.ModelVersion | None = None  # the parameters it was measured on


ANOMALY_POINTS_MAX = 64  # scores per status: a status every second carries a 1 kHz stream's windows
ANOMALY_RANGES_MAX = 16


class AnomalyTrace(_Part):
    """An anomaly model's live view (edgenode/anomaly.py): the scores of the newest stream windows
    as ``[time, score]`` (time: the window's end, unix s), the threshold, and the newest time ranges
    labelled anomalous (``[since, until]``, from late labels)."""

    threshold: b.Finite | None = None
    scores: list[tuple[b.Finite, b.Finite]] = Field(default_factory=list, max_length=ANOMALY_POINTS_MAX)
    labelled: list[tuple[b.Finite, b.Finite]] = Field(default_factory=list, max_length=ANOMALY_RANGES_MAX)


class ImageUpdate(_Part):
    """The node's latest image update or image rollback (kept across the restart it needs)."""

    update_id: b.Id
    kind: Literal["update", "rollback"] = "update"
    phase: UpdatePhase
    version: b.Text = ""  # the version being installed (an update) or returned to (a rollback)
    error: b.Reason | None = None  # FAILED / ROLLED_BACK: why


class ImageInfo(_Part):
    """The device image a node runs from (nodes started by ``fractal boot``)."""

    version: b.Text
    slot: b.Slot
    state: b.Text  # good | trial (firmware.device.SlotState)
    health: b.Text = ""  # this boot's health check: pending | passed
    previous: b.Text | None = None  # version in the previous good slot: what an image rollback returns to
    update: ImageUpdate | None = None


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
    site: b.Id | None = None  # its site (broker) in hierarchical rounds (federation/hierarchy.py)
    # Optional (older nodes leave them out): the device, for the fleet's node table.
    artifact: ArtifactInfo | None = None
    inference: InferenceInfo | None = None
    health: NodeHealth | None = None
    samples_train: b.Samples | None = None
    samples_val: b.Samples | None = None
    # Samples stored since the node's last committed round took its own (the fleet's automatic
    # rounds wait on it; api/fleet/autorounds.py). None: an older node.
    samples_new: b.Samples | None = None
    validation: Validation | None = None  # after the last committed round (or rollback)
    anomaly: AnomalyTrace | None = None  # anomaly models only
    versions: list[b.ModelVersion] = Field(default_factory=list, max_length=1024)  # rollback targets
    image: ImageInfo | None = None  # None: the node does not run from a device image
    halt: b.Reason | None = None  # state HALTED: why no slot may boot (the boot state's ``halt``)
    heartbeat_s: b.HeartbeatS = 5.0  # a status is re-published at least this often
    keepalive_s: b.KeepaliveS = 10.0  # MQTT keepalive: the Last Will fires within 1.5x of it
    ts: b.Finite = Field(default_factory=time.time)


class RoundCommand(_Msg, RoundSpec):
    """Published on ``cmd`` by the fleet: every listed participant runs the round.

    Its settings are a :class:`federation.roundspec.RoundSpec` (one bound per value, shared with
    the fleet's HTTP API and the node's ``[training]`` table); a setting left null is the node's
    ``[training]`` default (``federation.roundspec.resolve``). The fleet names the settings every
    member must share (sync, local_steps, compression, step_timeout_s)."""

    kind: Literal["round.start"] = "round.start"
    round_id: b.Id
    participants: b.Participants  # ring order = sorted(participants)
    issued_at: b.Finite = Field(default_factory=time.time)
    # The parameters the round starts from (federation/startversion.py); None = the members decide.
    start_sha256: b.Sha256Hex | None = None
    # site -> its participants: a hierarchical round (federation/hierarchy.py); None = one flat
    # ring, at most SITE_PARTICIPANTS_MAX participants.
    sites: dict[b.Id, list[b.Id]] | None = Field(default=None, max_length=b.SITES_MAX)

    @model_validator(mode="after")
    def _sites_partition_participants(self) -> RoundCommand:
        if self.sites is None:
            if len(self.participants) > b.SITE_PARTICIPANTS_MAX:
                raise ValueError(f"{len(self.participants)} participants: a flat ring takes at most "
                                 f"{b.SITE_PARTICIPANTS_MAX}; name its sites to run it hierarchically")
            return self
        seen: list[str] = []
        for site, members in self.sites.items():
            if not 1 <= len(members) <= b.SITE_PARTICIPANTS_MAX:
                raise ValueError(f"site {site} has {len(members)} participants: 1 to "
                                 f"{b.SITE_PARTICIPANTS_MAX} per site")
            seen += members
        if len(seen) != len(set(seen)) or set(seen) != set(self.participants):
            raise ValueError("sites must name every participant exactly once")
        return self


class RoundAbort(_Msg):
    kind: Literal["round.abort"] = "round.abort"
    round_id: b.Id
    reason: b.Reason


class RollbackCommand(_Msg):
    """Published on ``cmd`` by the fleet: every listed node restores the parameters it committed as
    ``to_version`` and forgets its later versions (the next round commits ``to_version + 1``).
    Nodes answer with their status (``model_version``, ``params_sha256``); not signed yet."""

    kind: Literal["model.rollback"] = "model.rollback"
    rollback_id: b.Id
    nodes: b.Participants
    to_version: b.ModelVersion
    reason: b.Reason = ""
    issued_at: b.Finite = Field(default_factory=time.time)


class ImageUpdateCommand(_Msg):
    """Published on ``cmd`` by the fleet (one per roll-out stage): every listed node downloads the
    image from ``url`` (range requests), checks that its sha256 starts with ``image_id``, flashes it
    into its inactive slot and restarts into it through its boot supervisor. Answered by the node's
    status (``image.update`` with this ``update_id``)."""

    kind: Literal["image.update"] = "image.update"
    update_id: b.Id
    nodes: b.Participants
    image_id: b.ImageId
    version: b.ImageVersion
    size: b.ImageSize
    url: b.HttpUrl
    issued_at: b.Finite = Field(default_factory=time.time)


class ImageRollbackCommand(_Msg):
    """Published on ``cmd`` by the fleet: every listed node makes its previous good slot active and
    restarts into it. Answered by the node's status (``image.update`` with ``kind: rollback``)."""

    kind: Literal["image.rollback"] = "image.rollback"
    rollback_id: b.Id
    nodes: b.Participants
    reason: b.Reason = ""
    issued_at: b.Finite = Field(default_factory=time.time)


AnyCommand = RoundCommand | RoundAbort | RollbackCommand | ImageUpdateCommand | ImageRollbackCommand
Command = Annotated[AnyCommand, Field(discriminator="kind")]
_command_adapter: TypeAdapter[AnyCommand] = TypeAdapter(Command)


class RoundEvent(_Msg):
    """Published by each participant on ``rounds/{round_id}/events/{node}``."""

    kind: EventKind
    round_id: b.Id
    node_id: b.Id
    step: int = Field(default=0, ge=0, le=b.STEPS_MAX * b.LOCAL_STEPS_MAX)
    loss: b.Loss = None  # NaN/Inf arrive as null
    # STEP: the losses of the steps since the previous STEP event, the last one being ``step``
    # (a node throttles events by time, not points); ``loss`` is the last of them.
    losses: list[b.Loss] | None = Field(default=None, max_length=100_000)
    params_sha256: b.Sha256Hex | None = None  # on DONE: the committed parameters
    model_version: b.ModelVersion | None = None
    reason: b.Reason | None = None  # on FAILED
    # FAILED: the member the failure names as its cause (voted no, refused final parameters, a
    # rejected update); the fleet leaves out members a majority of their peers keep naming.
    member: b.Id | None = None
    # DONE: validation before the round (the parameters it started from) and after the commit.
    val_before: Validation | None = None
    val_after: Validation | None = None
    # DONE: members whose update was excluded from at least one step (outlier or non-finite).
    excluded: list[b.Id] | None = Field(default=None, max_length=b.PARTICIPANTS_MAX)
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


def parse_command(payload: bytes | bytearray | memoryview | str) -> AnyCommand:
    """Parse a ``cmd`` payload; raises ``pydantic.ValidationError`` on anything malformed or out
    of bounds (``federation/bounds.py``) and on a payload without ``v``."""
    return _command_adapter.validate_python(_with_version(payload))


def parse_status(payload: bytes | bytearray | memoryview | str) -> NodeStatus:
    return NodeStatus.model_validate(_with_version(payload))


def parse_event(payload: bytes | bytearray | memoryview | str) -> RoundEvent:
    return RoundEvent.model_validate(_with_version(payload))
