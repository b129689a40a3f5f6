"""Fault injection at the steps of the two-phase commit, for process-level tests only.

``FRACTAL_FAULTS`` (read once when the node is built; unset in production = no effect):
a comma-separated list of ``ACTION@POINT[:ROUND_ID]``, e.g.
``kill@vote:r-3,fail@prepare:r-4``. ``ACTION`` is ``kill`` (SIGKILL this process: a power cut
as far as the swarm can tell) or ``fail`` (an ``OSError(EIO)`` where the node writes). ``POINT``
is one of :class:`Point`; without ``ROUND_ID`` the fault fires in every round.

Points, in commit order (edgenode/training.py, PROTOCOL.md section 7):

* ``prepare``  before the staged file ``params.npz.prepared`` is written (``fail``: that write)
* ``vote``     staged, before this member casts its vote
* ``voted``    inside the vote: this member's vote went out (reduce-scatter), the decision has not
  come back yet (``kill`` only: fired when the vote's first all-gather frame is sent)
* ``decided``  the vote said commit, before the staged file is renamed over ``params.npz``
  (``fail``: that rename)
* ``committed`` the new parameters are current, before the DONE event
"""

from __future__ import annotations

import enum
import errno
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from edgenode.common import ConfigError, get_logger
from federation.errors import FrameError
from federation.framing import FrameKind, Phase, decode
from federation.transport import Capabilities, Polled, Transport

__all__ = ["ENV", "Point", "Action", "Faults", "FaultyTransport", "NO_FAULTS"]

ENV = "FRACTAL_FAULTS"
log = get_logger("faults")


class Point(enum.StrEnum):
    PREPARE = "prepare"
    VOTE = "vote"
    VOTED = "voted"
    DECIDED = "decided"
    COMMITTED = "committed"


class Action(enum.StrEnum):
    KILL = "kill"
    FAIL = "fail"


@dataclass(frozen=True)
class _Rule:
    action: Action
    point: Point
    round_id: str | None


class Faults:
    """The faults this process injects (none unless :data:`ENV` is set)."""

    def __init__(self, rules: tuple[_Rule, ...] = ()) -> None:
        self.rules = rules

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Faults:
        spec = env.get(ENV, "").strip()
        if not spec:
            return cls()
        rules = []
        for item in spec.split(","):
            try:
                action, rest = item.strip().split("@", 1)
                point, _, rid = rest.partition(":")
                rules.append(_Rule(Action(action), Point(point), rid or None))
            except ValueError:
                raise ConfigError(f"{ENV}: cannot read {item!r}",
                                  hint="use ACTION@POINT[:ROUND_ID] with ACTION kill|fail and POINT "
                                       + "|".join(p.value for p in Point)) from None
            if rules[-1].action == Action.FAIL and rules[-1].point not in (Point.PREPARE, Point.DECIDED):
                raise ConfigError(f"{ENV}: {item!r}: nothing is written at {point}",
                                  hint="fail@prepare or fail@decided")
        log.warning("fault injection active: %s", spec)
        return cls(tuple(rules))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def wants(self, point: Point, round_id: str) -> Action | None:
        for r in self.rules:
            if r.point == point and r.round_id in (None, round_id):
                return r.action
        return None

    def at(self, point: Point, round_id: str) -> None:
        """Inject the fault configured for ``point`` in ``round_id`` (if any)."""
        action = self.wants(point, round_id)
        if action == Action.KILL:
            log.warning("injected: SIGKILL at %s of round %s", point, round_id)
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == Action.FAIL:
            log.warning("injected: write failure at %s of round %s", point, round_id)
            raise OSError(errno.EIO, f"injected write failure at {point}")


NO_FAULTS = Faults()


class FaultyTransport(Polled):
    """A transport that fires :attr:`Point.VOTED` when this member sends the first all-gather
    frame of a round's vote (its vote is in its peers' partial sums; nobody knows the result).
    Frames as the inner transport's; received by polling (``recv``) whether or not it pushes."""

    def __init__(self, inner: Transport, faults: Faults) -> None:
        self.inner, self.faults = inner, faults
        self.member_id = inner.member_id
        self.max_payload = inner.max_payload
        self.capabilities = Capabilities(framing=inner.capabilities.framing)

    def send(self, dst: str, payload: bytes) -> None:
        try:
            fr = decode(payload)
        except FrameError:
            fr = None
        if (fr is not None and fr.kind == FrameKind.DATA and fr.phase == Phase.ALL_GATHER
                and fr.tag.endswith("/vote")):
            self.faults.at(Point.VOTED, fr.tag.rsplit("/", 1)[0])
        self.inner.send(dst, payload)

    def recv(self, timeout: float) -> bytes | None:
        return self.inner.recv(timeout)

    def close(self) -> None:
        self.inner.close()
