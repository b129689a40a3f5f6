"""The interface every way of combining members' updates implements, and what they share.

An :class:`Aggregator` gets one step's :class:`Step` (the collective, the group in ring order,
who has samples, the step's tag and settings) and this member's update, and returns the
:class:`Combined` update, bit-identical on every member, plus who was excluded from the step and
why (the same on every member). Each implementation is one module of this package; the round's
spec picks one through the table in :mod:`federation.aggregators`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from federation import robust
from federation.errors import AllExcluded
from federation.limits import DIRECTION_MAX_COSINE, DIRECTION_NORM_FACTOR
from federation.modes import Compression

__all__ = ["Aggregator", "Combined", "Exchanger", "Step", "screen", "sum_rows", "exchange_checked"]


class Exchanger(Protocol):
    """What an aggregator needs of a collective (``federation.ring.RingAllreduce``)."""

    def allreduce(self, vec: np.ndarray, *, group: list[str], tag: str, op: Any = "mean",
                  timeout: float = 30.0, compression: Any = ...,
                  clip_norm: float | None = None, claims: np.ndarray | None = None,
                  screen: Any = None, algorithm: str = "auto") -> np.ndarray: ...

    def exchange(self, vec: np.ndarray, *, group: list[str], tag: str, timeout: float = 30.0,
                 compression: Any = "none") -> np.ndarray: ...


@dataclass(frozen=True)
class Step:
    """One step's combination, as every member of the round sees it."""

    collective: Exchanger
    node_id: str
    group: tuple[str, ...]  # ring order: sorted(participants)
    contributors: tuple[bool, ...]  # in ring order: who has samples (the others send zeros)
    round_id: str
    step: int
    timeout: float
    compression: Compression = Compression.NONE
    outlier_factor: float = 0.0  # 0 = no screening (federation/robust.py)

    @property
    def tag(self) -> str:
        return f"{self.round_id}/{self.step}"

    @property
    def rank(self) -> int:
        return self.group.index(self.node_id)

    @property
    def members(self) -> list[str]:
        return list(self.group)


@dataclass(frozen=True)
class Combined:
    """A step's combined update and the members left out of it (member -> why)."""

    update: np.ndarray
    excluded: dict[str, str] = field(default_factory=dict)
    opposed: frozenset[str] = frozenset()  # those of ``excluded`` left out by the direction check alone


class Aggregator(Protocol):
    """One way of combining the members' updates of a step."""

    def combine(self, step: Step, update: np.ndarray) -> Combined:
        """The combined update (the same bits on every member) and who was excluded; raises
        :class:`~federation.errors.RoundAborted` (``UpdateRejected``, a timeout) or
        :class:`~federation.errors.AllExcluded` when the step cannot be combined."""
        ...


def screen(step: Step, norms: list[float],
           rows: np.ndarray | None = None) -> tuple[tuple[int, ...], dict[str, str], frozenset[str]]:
    """The screening of a step (PROTOCOL.md section 7.1): the norm screen of
    :func:`federation.robust.screen`, then, when the members' ``rows`` are at hand, the direction
    check (:func:`federation.robust.opposed`). -> (ranks kept, member -> why excluded, the members
    excluded by the direction check). Raises :class:`AllExcluded` when nobody is kept."""
    s = robust.screen(norms, list(step.contributors), step.outlier_factor)
    excluded = dict(s.excluded)
    kept = s.kept
    opposed: dict[int, str] = {}
    if rows is not None and step.outlier_factor > 0:
        opposed = robust.opposed(rows, kept, DIRECTION_NORM_FACTOR, DIRECTION_MAX_COSINE)
        excluded.update(opposed)
        kept = tuple(k for k in kept if k not in opposed)
    if not kept:
        raise AllExcluded(f"round {step.round_id} step {step.step}: every update was excluded "
                          f"({', '.join(step.group[j] for j in excluded)})")
    return (kept, {step.group[j]: why for j, why in sorted(excluded.items())},
            frozenset(step.group[j] for j in opposed))


def sum_rows(rows: np.ndarray, which: Any, count: int) -> np.ndarray:
    """The mean of ``rows[which]`` over ``count``, summed in ascending (group) order in float32:
    the same bits on every member."""
    acc = np.zeros(rows.shape[1], np.float32)
    for j in which:
        acc += rows[j]
    return acc / np.float32(count)


def exchange_checked(step: Step, row: np.ndarray) -> np.ndarray:
    """Every member's ``row`` (``Step.compression``, error feedback for int8/top-k), ``(n, L)``
    float32 in ring order."""
    return np.asarray(step.collective.exchange(row, group=step.members, tag=step.tag, timeout=step.timeout,
                                               compression=step.compression), np.float32)
