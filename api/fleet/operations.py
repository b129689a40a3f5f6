"""The fleet's operations on the swarm and which of them may run at the same time: one coordinator.

Every operation that changes the swarm starts through :meth:`Operations.starting`, which holds one
lock around check-then-start: the table below is checked against what runs now, and the operation
is registered as running by its manager before the lock is released. So two requests arriving at
the same moment can never both start when the table says they conflict (before: each manager
checked the others one by one, without a common lock, and a round and a roll-out could both pass
their checks and both start).

Which operations may overlap (every pair not listed conflicts; no kind overlaps itself):

====================  ====================  ==================================================
operation             may run during        why
====================  ====================  ==================================================
rollback              image roll-out,       a parameter rollback loads kept parameters from the
(parameters)          image rollback        data area; an image roll-out writes the inactive slot
                                            and the data area survives it
====================  ====================  ==================================================

Conflicting, e.g.: a training round with anything (its members must hold the same parameters and
stay up from hello to commit); an image roll-out with an image rollback (both drive A/B slots).
Accepting or revoking an enrolment is not an operation here: a round's members are fixed when it
starts and a node accepted meanwhile joins the next one, so enrolment may overlap everything.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator

__all__ = ["OpKind", "MAY_OVERLAP", "may_overlap", "Operations", "OperationConflict", "RoundRejected"]


class OpKind(enum.StrEnum):
    ROUND = "training round"
    ROLLBACK = "rollback"
    ROLLOUT = "image roll-out"
    IMAGE_ROLLBACK = "image rollback"


MAY_OVERLAP: frozenset[frozenset[OpKind]] = frozenset({
    frozenset({OpKind.ROLLBACK, OpKind.ROLLOUT}),
    frozenset({OpKind.ROLLBACK, OpKind.IMAGE_ROLLBACK}),
})


def may_overlap(a: OpKind, b: OpKind) -> bool:
    """May ``a`` start while ``b`` runs (and the other way round)? The table is symmetric."""
    return a is not b and frozenset({a, b}) in MAY_OVERLAP


class RoundRejected(Exception):
    """A well-formed request for an operation (round, rollback, roll-out) the swarm cannot run now
    (HTTP 409) or that names unknown nodes (404). The name is historical: rounds came first."""

    def __init__(self, reason: str, status_code: int = 409) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code


class OperationConflict(RoundRejected):
    """An operation asked for while one it may not overlap runs (HTTP 409)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, 409)


# What runs of one kind now: a phrase naming it ("round r-1 is still running"), or None.
Probe = Callable[[], str | None]


class Operations:
    """Thread-safe. Managers :meth:`register` a probe per kind they run, and start under
    :meth:`starting`; probes are called with the coordinator's lock held (they take their
    manager's own lock, never this one, so the lock order is always coordinator -> manager)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probes: dict[OpKind, Probe] = {}

    def register(self, kind: OpKind, running: Probe) -> None:
        self._probes[kind] = running

    def conflict(self, kind: OpKind) -> str | None:
        """Why ``kind`` cannot start now (the running operation it may not overlap), or None."""
        for other, probe in self._probes.items():
            if may_overlap(kind, other):
                continue
            what = probe()
            if what is not None:
                article = "an" if kind[0] in "aeiou" else "a"
                return f"cannot start {article} {kind} now: {what}; start it after that ends"
        return None

    @contextlib.contextmanager
    def starting(self, kind: OpKind) -> Iterator[None]:
        """Hold the start lock, refuse ``kind`` if it conflicts with what runs (OperationConflict),
        and let the caller validate and register its operation before the lock is released."""
        with self._lock:
            why = self.conflict(kind)
            if why is not None:
                raise OperationConflict(why)
            yield
