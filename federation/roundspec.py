"""A training round's settings as one typed contract: each value bounded once, resolved once.

Three views of the same fields, so a value one layer accepts is one every layer below accepts:

* the operator's ``POST /api/rounds`` body (``api/fleet/rounds.py`` ``RoundRequest``) is a
  :class:`RoundSpec` plus the nodes to train;
* the signed MQTT command (``federation/messages.py`` ``RoundCommand``) is a :class:`RoundSpec`
  plus the round id, its participants and its start parameters;
* a node's ``[training]`` table (``edgenode/config.py`` ``TrainingConfig``) is a
  :class:`RoundDefaults` plus what only the node decides (batch, memory, priority).

A spec leaves a value unset (None) to let the node decide; :func:`resolve` fills every unset
value from the node's defaults, the one place where that happens. The numbers themselves are in
``federation/bounds.py`` (every limit a receiver enforces, in one place).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, model_validator

from federation import bounds as b
from federation.modes import Compression, SyncMode  # re-exported: a round's settings
from federation.robust import Aggregation

__all__ = ["SyncMode", "Compression", "RoundSettings", "RoundSpec", "RoundDefaults", "ResolvedRound",
           "resolve"]


class RoundSettings(BaseModel):
    """How a round trains; None = the node's default (:class:`RoundDefaults`). Every member of a
    round must use the same sync, local_steps, compression, aggregation and outlier_factor: the
    fleet names them in the command."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    lr: b.Lr | None = None  # None everywhere: the artifact's compiled learning rate
    sync: SyncMode | None = None
    local_steps: b.LocalSteps | None = None
    compression: Compression | None = None
    step_timeout_s: b.StepTimeout | None = None
    aggregation: Aggregation | None = None  # federation/robust.py
    outlier_factor: b.OutlierFactor | None = None  # 0 = no screening


class RoundSpec(RoundSettings):
    """What one round is asked to do: its steps and settings (the bounds are the receivers')."""

    steps: b.Steps

    @model_validator(mode="after")
    def _round_work(self) -> RoundSpec:
        # The local compute a command can ask for is bounded too (an unset local_steps is the
        # node's own choice, from its own config).
        if self.sync == SyncMode.ASYNC:
            raise ValueError("sync 'async' has no rounds: an async swarm trains whenever its members are "
                             "online (set [training] sync = \"async\" on the nodes); use 'gradient' or "
                             "'local-sgd' for a round")
        if self.steps * (self.local_steps or 1) > b.ROUND_WORK_MAX:
            raise ValueError(f"steps x local_steps = {self.steps * (self.local_steps or 1)} exceeds "
                             f"{b.ROUND_WORK_MAX}: run fewer steps or fewer local steps per step")
        return self


class RoundDefaults(BaseModel):
    """What a node falls back to for the settings a round leaves unset (its ``[training]`` table)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    lr: b.Lr | None = None  # None: the artifact's compiled learning rate
    sync: SyncMode = SyncMode.GRADIENT
    local_steps: b.LocalSteps = 1
    compression: Compression = Compression.NONE
    step_timeout_s: b.StepTimeout = 30.0
    aggregation: Aggregation = Aggregation.MEAN
    outlier_factor: b.OutlierFactor = b.OUTLIER_FACTOR_DEFAULT


@dataclass(frozen=True)
class ResolvedRound:
    """A spec with every value decided (``lr`` None: the artifact's compiled rate)."""

    steps: int
    lr: float | None
    sync: SyncMode
    local_steps: int
    compression: Compression
    step_timeout_s: float
    aggregation: Aggregation
    outlier_factor: float


def resolve(spec: RoundSpec, defaults: RoundDefaults | None = None) -> ResolvedRound:
    """``spec`` with each unset (None) setting taken from ``defaults`` (built-in ones if None)."""
    d = defaults if defaults is not None else RoundDefaults()
    given = spec.model_dump(include=set(RoundSettings.model_fields), exclude_none=True)
    chosen = d.model_dump(include=set(RoundSettings.model_fields)) | given
    return ResolvedRound(
        steps=spec.steps, lr=None if chosen["lr"] is None else float(chosen["lr"]),
        # an async node asked into a round (by a command that leaves sync unset) takes part in local-sgd
        sync=SyncMode.LOCAL_SGD if chosen["sync"] == SyncMode.ASYNC else SyncMode(chosen["sync"]),
        local_steps=int(chosen["local_steps"]),
        compression=Compression(chosen["compression"]), step_timeout_s=float(chosen["step_timeout_s"]),
        aggregation=Aggregation(chosen["aggregation"]), outlier_factor=float(chosen["outlier_factor"]))
