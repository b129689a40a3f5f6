"""What every collective engine shares (:class:`~federation.ring.RingAllreduce`,
:class:`~federation.star.StarAllreduce`, the direct exchange of :mod:`federation.direct`): one
reliable :class:`~federation.session.Endpoint` on a transport, the error-feedback state of
compressed calls, input checks on vectors and groups, and the violation error for a frame that
breaks a call's schedule."""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import numpy as np

from federation.errors import RoundAborted, TransportError
from federation.framing import Frame
from federation.session import Endpoint
from federation.stats import Stats
from federation.transport import Transport

log = logging.getLogger("fractal.federation.collective")

__all__ = ["CollectiveBase", "Feedback", "ReduceOp", "Screen", "as_vector", "ordered_group", "violation"]

# (this member's claim row, decide(all claim rows, the members' vectors or None) -> (claims to
# check, whether to send our vector)); the vectors are given on the direct path only (every
# member holds every row there), None around the ring.
Screen = tuple[np.ndarray, Callable[[np.ndarray, np.ndarray | None], tuple[np.ndarray, bool]]]


class ReduceOp(enum.StrEnum):
    SUM = "sum"
    MEAN = "mean"


@dataclass
class Feedback:
    """A member's error-feedback residual and the call shape (``key``) it belongs to."""

    key: tuple
    residual: np.ndarray


def as_vector(vec: object) -> np.ndarray:
    """A contiguous 1-D float32 array (copy only if needed); ValueError otherwise."""
    a = np.asarray(vec)
    if a.ndim != 1:
        raise ValueError(f"allreduce takes a 1-D vector, got shape {a.shape}: flatten it first")
    if a.dtype != np.float32:
        if not np.issubdtype(a.dtype, np.number):
            raise ValueError(f"allreduce takes float32 numbers, got dtype {a.dtype}")
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def ordered_group(group: list[str], me: str) -> list[str]:
    """``sorted(group)``, validated: unique ids, ``me`` included."""
    members = sorted(group)
    if len(set(members)) != len(members):
        raise ValueError(f"group has duplicate members: {members}")
    if me not in members:
        raise ValueError(f"{me!r} is not in the group {members}")
    return members


class CollectiveBase:
    """What the ring and the star share: one reliable :class:`Endpoint` on a transport, stats,
    the error-feedback state of compressed rounds, and close/context-manager plumbing."""

    def __init__(self, transport: Transport, *, swarm: str = "default", max_in_flight: int = 16,
                 retransmit_after: float = 1.0, topk_ratio: float = 0.01, max_early_tags: int = 4,
                 max_retransmits: int = 100) -> None:
        self.endpoint = Endpoint(transport, swarm=swarm, max_in_flight=max_in_flight,
                                 retransmit_after=retransmit_after, max_early_tags=max_early_tags,
                                 max_retransmits=max_retransmits)
        self.member_id: str = transport.member_id
        self.swarm = swarm
        self.max_payload: int = int(transport.max_payload)
        self.topk_ratio = topk_ratio
        self._feedback: Feedback | None = None
        self._lock = threading.Lock()

    @property
    def stats(self) -> Stats:
        return self.endpoint.stats

    @property
    def feedback_residual(self) -> np.ndarray | None:
        """A copy of this member's error-feedback residual (INT8 / TOPK rounds), or None."""
        return None if self._feedback is None else self._feedback.residual.copy()

    def reset_feedback(self) -> None:
        """Forget error-feedback residuals (e.g. after the parameters were replaced)."""
        self._feedback = None

    def cancel(self, reason: str) -> bool:
        """Fail the collective this member is blocked in right now (if any), e.g. when the fleet
        aborts the round: its peers get ABORT frames. Returns whether one was running."""
        return self.endpoint.cancel(reason)

    def abort(self, tag: str, peers: list[str], reason: str) -> None:
        """Void the collective ``tag`` at once: the session sends ABORT to every peer, so members
        blocked in (or about to start) that collective stop now instead of at their deadline.
        Best effort: a peer that misses it still times out on its own."""
        try:
            with self.endpoint.call(tag, [p for p in peers if p != self.member_id], 1.0):
                raise RoundAborted(reason)
        except (RoundAborted, TransportError, RuntimeError, ValueError) as exc:
            log.debug("abort of %s: %s", tag, exc)

    def close(self) -> None:
        """Stop the receive thread and close the transport."""
        self.endpoint.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def violation(fr: Frame, what: str) -> None:
    """Abort the call: ``fr`` breaks its schedule (blames its sender)."""
    raise RoundAborted(
        f"{what}: {fr.phase.name} step {fr.step} chunk {fr.chunk} part {fr.part}/{fr.nparts} "
        f"[{fr.offset}+{fr.count} of {fr.total}] codec {fr.codec.name} from {fr.sender}",
        member=fr.sender, hint="every member must run the same release with the same max_payload",
    )
