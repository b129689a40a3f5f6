"""Fault injection at the steps of the two-phase commit, for tests only.

A :class:`Faults` plan enters through the objects a test builds: ``EdgeNode(config,
faults=Faults.parse("kill@vote:r-3"))``; a node built without one has :data:`NO_FAULTS` (nothing
in a production path reads a switch from the environment or the config file). Tests that run
real node processes start them with ``python -m tests.edgenode.faultnode --faults SPEC --config
NODE.toml``, which serves the node exactly as ``fractal node`` does, built with that plan.

The plan's text form is a comma-separated list of ``ACTION@POINT[:ROUND_ID]``, e.g.
``kill@vote:r-3,fail@prepare:r-4``. ``ACTION`` is ``kill`` (SIGKILL this process: a power cut
as far as the swarm can tell) or ``fail`` (an ``OSError(EIO)`` where the node writes). ``POINT``
is one of :class:`Point`; without ``ROUND_ID`` the fault fires in every round.

Points, in commit order (edgenode/roundphases.py, PROTOCOL.md section 7):

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
from dataclasses import dataclass

from edgenode.common import get_logger
from edgenode.errors import ConfigError
from federation.errors import FrameError
from federation.framing import FrameKind, Phase, decode
from federation.transport import Capabilities, Polled, Transport

__all__ = ["Point", "Action", "Faults", "FaultyTransport", "NO_FAULTS"]

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
    """The faults a node injects (see the module docstring); :data:`NO_FAULTS`: none."""

    def __init__(self, rules: tuple[_Rule, ...] = ()) -> None:
        self.rules = rules

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """The plan ``ACTION@POINT[:ROUND_ID],...`` (ConfigError naming the item it cannot read)."""
        rules = []
        for item in filter(None, (i.strip() for i in spec.split(","))):
            try:
                action, rest = item.split("@", 1)
                point, _, rid = rest.partition(":")
                rules.append(_Rule(Action(action), Point(point), rid or None))
            except ValueError:
                raise ConfigError(f"fault plan: cannot read {item!r}",
                                  hint="use ACTION@POINT[:ROUND_ID] with ACTION kill|fail and POINT "
                                       + "|".join(p.value for p in Point)) from None
            if rules[-1].action == Action.FAIL and rules[-1].point not in (Point.PREPARE, Point.DECIDED):
                raise ConfigError(f"fault plan: {item!r}: nothing is written at {point}",
                                  hint="fail@prepare or fail@decided")
        return cls(tuple(rules))

    def __str__(self) -> str:
        return ",".join(f"{r.action}@{r.point}" + (f":{r.round_id}" if r.round_id else "")
                        for r in self.rules)

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
        fmg = self.capabilities.framing  # a frame with seal room (ring MACs) has no CRC
        try:
            fr = decode(memoryview(payload)[:len(payload) - fmg.room], check_crc=fmg.crc)
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
