"""Every limit a receiver enforces on swarm messages, in one place.

A forged or buggy command must not be able to stall a node (huge ``local_steps`` or
``step_timeout_s``), blow up the model (``lr: 1e30``) or flood the fleet's registry (ghost
nodes, 5,000-character ids, ``keepalive_s: Infinity``). The message models in
``federation/messages.py``, the node and the fleet's registry use these types and constants;
the fleet's HTTP API uses the same numbers so that what it accepts, the nodes accept too.

Ids (swarm, node, round, key) match :data:`ID_PATTERN`: 1-64 characters from ``[A-Za-z0-9_.-]``
starting with a letter or digit. They become MQTT topic levels, so ``/``, ``+``, ``#``, spaces
and empty strings are impossible, and they are safe to show in HTML once escaped.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, StringConstraints

from federation.errors import FederationError

__all__ = [
    "ID_PATTERN",
    "LR_MAX",
    "STEPS_MAX",
    "LOCAL_STEPS_MAX",
    "ROUND_WORK_MAX",
    "STEP_TIMEOUT_MIN_S",
    "STEP_TIMEOUT_MAX_S",
    "PARTICIPANTS_MAX",
    "SITE_PARTICIPANTS_MAX",
    "SITES_MAX",
    "UPDATE_NORM_FACTOR",
    "SYNC_GAP_OF_UPDATE",
    "SYNC_GAP_OF_PARAMS",
    "OUTLIER_FACTOR_DEFAULT",
    "OUTLIER_FACTOR_MAX",
    "OutlierFactor",
    "REGISTRY_MAX_NODES",
    "HEARTBEAT_MIN_S",
    "HEARTBEAT_MAX_S",
    "KEEPALIVE_MIN_S",
    "KEEPALIVE_MAX_S",
    "MODEL_VERSION_MAX",
    "SAMPLES_MAX",
    "TEXT_MAX",
    "URL_MAX",
    "REASON_MAX",
    "IMAGE_SIZE_MAX",
    "OutOfBounds",
    "Id",
    "Lr",
    "Steps",
    "LocalSteps",
    "StepTimeout",
    "Participants",
    "HeartbeatS",
    "KeepaliveS",
    "ModelVersion",
    "Samples",
    "Finite",
    "Loss",
    "Sha256Hex",
    "Text",
    "Url",
    "Reason",
    "ImageId",
    "ImageVersion",
    "ImageSize",
    "HttpUrl",
    "Slot",
    "valid_id",
    "check_id",
    "check_round",
    "finite_or_none",
]

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_ID = re.compile(ID_PATTERN)

# Commands (RoundCommand): a node refuses anything outside these.
LR_MAX = 10.0  # SGD on normalised inputs diverges far below this; 1e30 is an attack
STEPS_MAX = 100_000
LOCAL_STEPS_MAX = 1_000
ROUND_WORK_MAX = 1_000_000  # steps x local_steps: bounds the local compute of one round
STEP_TIMEOUT_MIN_S = 0.1
STEP_TIMEOUT_MAX_S = 300.0  # a stalled ring frees its members within 5 minutes at worst
# A round has at most PARTICIPANTS_MAX participants; past SITE_PARTICIPANTS_MAX (the largest flat
# ring) the round is hierarchical (federation/hierarchy.py): its command names its sites, none
# larger than SITE_PARTICIPANTS_MAX, at most SITES_MAX of them, so every ring, the leaders' ring and
# the vote (one slot per site) stay bounded. A command of 1,000 64-character ids is ~140 KB, far
# below the 2 MiB MQTT limit (federation.broker.MESSAGE_SIZE_LIMIT).
PARTICIPANTS_MAX = 1000
SITE_PARTICIPANTS_MAX = 64
SITES_MAX = 64
# A round's update (final - start parameters) may not exceed this many times the start norm
# (at least 1): a member committing it would replace the model rather than train it.
UPDATE_NORM_FACTOR = 100.0
# Final sync without a majority (federation/phases.py:agree): a member adopts the first member's
# parameters only if they lie within SYNC_GAP_OF_UPDATE x its own update of the round plus
# SYNC_GAP_OF_PARAMS x its own parameters' norm (L2) of its own result. Boards that round
# differently drift apart by a few ulps per step, orders of magnitude below this; a member that
# split the others' views on purpose moves the model by at most this, or fails the round.
SYNC_GAP_OF_UPDATE = 1e-2
SYNC_GAP_OF_PARAMS = 1e-5
# A step's update whose norm exceeds this many times the median of the members' is excluded
# (federation/robust.py); 0 = no screening. Below 1 honest members would be excluded.
OUTLIER_FACTOR_DEFAULT = 10.0
OUTLIER_FACTOR_MAX = 1e6
# A screened step also excludes a member whose update points away from the coordinate-wise median
# of the other kept updates (cosine below DIRECTION_MAX_COSINE) with a norm above
# DIRECTION_NORM_FACTOR x the median norm (federation/robust.py opposed; 3 or more kept updates,
# only where every member holds every update: PROTOCOL.md section 7.1). Measured on the digits
# splits of tests/edgenode/learning.py: a gradient x -4 is at 2.9 x or more, its cosine below -0.2
# in about 90% of the steps; an honest non-IID member was excluded in 15 of 631 steps (a member is
# named only when excluded so in half the round's steps: federation/phases.py StepCombiner).
DIRECTION_NORM_FACTOR = 2.5
DIRECTION_MAX_COSINE = -0.2

# Statuses (NodeStatus) and the fleet's registry.
REGISTRY_MAX_NODES = 2 * PARTICIPANTS_MAX  # statuses of further unknown nodes are dropped and counted
HEARTBEAT_MIN_S = 0.1
HEARTBEAT_MAX_S = 600.0
KEEPALIVE_MIN_S = 1.0
KEEPALIVE_MAX_S = 3600.0
MODEL_VERSION_MAX = 2**53  # exact in a JSON number (JavaScript's Number)
SAMPLES_MAX = 2**48
TEXT_MAX = 128  # arch, board, model name
URL_MAX = 256
REASON_MAX = 512
# Device images (ImageUpdateCommand): the same cap as the image format (firmware/image.py MAX_IMAGE).
IMAGE_SIZE_MAX = 4 << 30


class OutOfBounds(FederationError, ValueError):
    """A message field outside its bound (the message is dropped and counted)."""


def valid_id(value: object) -> bool:
    return isinstance(value, str) and bool(_ID.match(value))


def check_id(value: str, what: str = "id") -> str:
    if not valid_id(value):
        raise OutOfBounds(f"invalid {what} {str(value)[:80]!r}",
                          hint="use 1-64 characters from [A-Za-z0-9_.-], starting with a letter or digit")
    return value


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError("must be finite")
    return x


def _loss(x: object) -> object:
    # A diverged loss is reported as null rather than dropped: the event still says "step N".
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _truncate(x: object) -> object:
    return x[:REASON_MAX] if isinstance(x, str) else x


def _outlier_factor(x: float) -> float:
    if x != 0 and not 1.0 <= x <= OUTLIER_FACTOR_MAX:
        raise ValueError(f"must be 0 (off) or between 1 and {OUTLIER_FACTOR_MAX:g}")
    return x


def _unique(ids: list[str]) -> list[str]:
    return list(dict.fromkeys(ids))  # a repeated participant is one member


Id = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
Lr = Annotated[float, Field(gt=0, le=LR_MAX, allow_inf_nan=False)]
Steps = Annotated[int, Field(ge=1, le=STEPS_MAX)]
LocalSteps = Annotated[int, Field(ge=1, le=LOCAL_STEPS_MAX)]
StepTimeout = Annotated[float, Field(ge=STEP_TIMEOUT_MIN_S, le=STEP_TIMEOUT_MAX_S, allow_inf_nan=False)]
Participants = Annotated[list[Id], Field(min_length=1, max_length=PARTICIPANTS_MAX), AfterValidator(_unique)]
# Declared 0..OUTLIER_FACTOR_MAX (so schemas and the property test see the range); the validator
# also refuses the gap between 0 (off) and 1.
OutlierFactor = Annotated[float, Field(ge=0, le=OUTLIER_FACTOR_MAX, allow_inf_nan=False),
                          AfterValidator(_outlier_factor)]
HeartbeatS = Annotated[float, Field(ge=HEARTBEAT_MIN_S, le=HEARTBEAT_MAX_S, allow_inf_nan=False)]
KeepaliveS = Annotated[float, Field(ge=KEEPALIVE_MIN_S, le=KEEPALIVE_MAX_S, allow_inf_nan=False)]
ModelVersion = Annotated[int, Field(ge=0, le=MODEL_VERSION_MAX)]
Samples = Annotated[int, Field(ge=0, le=SAMPLES_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False), AfterValidator(_finite)]
Loss = Annotated[float | None, BeforeValidator(_loss)]  # NaN/Inf -> None
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{64})?$")]
Text = Annotated[str, StringConstraints(max_length=TEXT_MAX)]
Url = Annotated[str, StringConstraints(max_length=URL_MAX)]
Reason = Annotated[str, BeforeValidator(_truncate), StringConstraints(max_length=REASON_MAX)]
# An image in the fleet's catalogue is named by the first 32 hex digits of its file's sha256.
ImageId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
ImageVersion = Annotated[str, StringConstraints(pattern=r"^[0-9A-Za-z.+-]{1,64}$")]  # semantic version
ImageSize = Annotated[int, Field(ge=1, le=IMAGE_SIZE_MAX)]
HttpUrl = Annotated[str, StringConstraints(max_length=2 * URL_MAX, pattern=r"^https?://[^\s]+$")]
Slot = Annotated[str, StringConstraints(pattern=r"^[ab]$")]


def check_round(steps: int, local_steps: int, step_timeout_s: float) -> None:
    """Cross-field bound of a RoundCommand: the local work of a round is bounded too."""
    if steps * local_steps > ROUND_WORK_MAX:
        raise OutOfBounds(f"steps x local_steps = {steps * local_steps} exceeds {ROUND_WORK_MAX}",
                          hint="run fewer steps or fewer local steps per step")
    if not STEP_TIMEOUT_MIN_S <= step_timeout_s <= STEP_TIMEOUT_MAX_S:
        raise OutOfBounds(f"step_timeout_s {step_timeout_s} outside "
                          f"[{STEP_TIMEOUT_MIN_S}, {STEP_TIMEOUT_MAX_S}]")


def finite_or_none(x: float | None) -> float | None:
    """For JSON output: NaN/Inf become null (the event stream never sends non-standard JSON)."""
    return x if x is not None and math.isfinite(x) else None
