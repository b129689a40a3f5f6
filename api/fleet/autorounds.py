"""Automatic rounds: the fleet starts a training round by itself, on a schedule or when the swarm
holds enough new samples, through the very path an operator's round takes.

The policy is one JSON object (``GET/PUT /api/auto-rounds``), kept in the fleet's database so a
restarted fleet keeps it::

    {"enabled": true,                       # the switch (both triggers off when false)
     "schedule": {"enabled": true, "every_min": 60,
                  "window": {"start": "22:00", "end": "06:00"}},   # UTC, optional, may wrap midnight
     "samples": {"enabled": true, "threshold": 500},
     "min_spacing_min": 10,                 # between two automatic round starts
     "round": {"steps": 50, "lr": null, "nodes": null}}          # a POST /api/rounds body

Each check (``FleetSettings.auto_check_s``) asks :func:`decide` whether a trigger is due; a due
trigger starts a round with :meth:`api.fleet.service.FleetService.start_round` (the operations
coordinator, the same validation, the same automatic rollback on a regression). When the swarm is
busy (a round, rollback or roll-out runs; too few idle nodes) the round waits for the next check,
and the wait is recorded once as an ``auto_round.deferred`` action.

A node's own figure (``samples_new`` in its signed status) is not trusted beyond what it can do
harm with: the message bounds it (a non-negative integer up to 2^48; a non-finite or negative
value fails the status), each node counts at most NODE_SHARE_MAX of the threshold (no single node,
lying or not, starts a round alone), a figure that goes backwards without a new parameter version
is ignored, and automatic rounds start at least ``min_spacing_min`` apart, so a liar cannot start
rounds in a loop.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.fleet.history import FleetHistory
from api.fleet.operations import RoundRejected
from api.fleet.rounds import RoundRequest, Trigger

__all__ = ["Trigger", "Window", "ScheduleTrigger", "SamplesTrigger", "AutoRoundPolicy", "AutoState",
           "Decision", "Participants", "decide", "samples_progress", "next_schedule_due", "AutoRounds",
           "NODE_SHARE_MAX"]

log = logging.getLogger("fractal.fleet")

# Distinct waits recorded as actions between two automatic starts (the rest only show as "waiting").
RECORDED_WAITS_MAX = 20

# Each node's new samples count towards the threshold up to this share of it.
NODE_SHARE_MAX = 0.5

_POLICY_KEY = "auto_rounds.policy"
_STATE_KEY = "auto_rounds.state"

HHMM = Annotated[str, Field(pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$", description="UTC, HH:MM")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Window(_Strict):
    """A daily window in UTC, ``[start, end)``; ``start > end`` wraps midnight."""

    start: HHMM
    end: HHMM

    @model_validator(mode="after")
    def _not_empty(self) -> Window:
        if self.start == self.end:
            raise ValueError("window start and end are the same: leave the window out (null) for all day")
        return self

    def minutes(self) -> tuple[int, int]:
        return _minute(self.start), _minute(self.end)

    def contains(self, t: float) -> bool:
        m = _minute_of_day(t)
        a, b = self.minutes()
        return a <= m < b if a < b else (m >= a or m < b)

    def next_start(self, t: float) -> float:
        """The first moment at or after ``t`` inside the window."""
        if self.contains(t):
            return t
        day = dt.datetime.fromtimestamp(t, dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        a = self.minutes()[0]
        start = day + dt.timedelta(minutes=a)
        if start.timestamp() < t:
            start += dt.timedelta(days=1)
        return start.timestamp()


def _minute(hhmm: str) -> int:
    h, m = hhmm.split(":")
    return int(h) * 60 + int(m)


def _minute_of_day(t: float) -> float:
    d = dt.datetime.fromtimestamp(t, dt.UTC)
    return d.hour * 60 + d.minute + d.second / 60


class ScheduleTrigger(_Strict):
    enabled: bool = False
    every_min: float = Field(default=60.0, ge=1, le=7 * 24 * 60)
    window: Window | None = None


class SamplesTrigger(_Strict):
    enabled: bool = False
    # new samples the participants hold together since the last committed round
    threshold: int = Field(default=1000, ge=2, le=10**9)


class AutoRoundPolicy(_Strict):
    """The body of ``PUT /api/auto-rounds`` (every field optional: defaults as shown)."""

    enabled: bool = False
    schedule: ScheduleTrigger = ScheduleTrigger()
    samples: SamplesTrigger = SamplesTrigger()
    min_spacing_min: float = Field(default=10.0, ge=1, le=24 * 60)
    round: RoundRequest = RoundRequest(steps=20)


@dataclass
class AutoState:
    """What the checks remember (kept in the database next to the policy)."""

    last_auto_start: float | None = None  # the last automatic round's start (any trigger)
    schedule_anchor: float | None = None  # the schedule counts every_min from here
    # node -> (model_version, samples_new) as last accepted (see accept_samples)
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    deferred: dict[str, str] = field(default_factory=dict)  # trigger -> why it waits now
    # (trigger, why) recorded since the last automatic start or policy change: a count flapping
    # around the threshold (a node going offline and back) records each reason once, not per check
    recorded: set[tuple[str, str]] = field(default_factory=set)

    def to_json(self) -> str:
        return json.dumps({"last_auto_start": self.last_auto_start, "schedule_anchor": self.schedule_anchor})

    @classmethod
    def from_json(cls, text: str | None) -> AutoState:
        d = json.loads(text) if text else {}
        return cls(last_auto_start=_finite(d.get("last_auto_start")),
                   schedule_anchor=_finite(d.get("schedule_anchor")))


def _finite(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def accept_samples(state: AutoState, node_id: str, model_version: int, samples_new: int | None) -> bool:
    """Fold one status's figure into ``state``; False when it is ignored: it went backwards while
    the node's parameter version stayed (a commit or rollback resets the count legitimately)."""
    if samples_new is None:
        state.counts.pop(node_id, None)
        return True
    kept = state.counts.get(node_id)
    if kept is not None and kept[0] == model_version and samples_new < kept[1]:
        return False
    state.counts[node_id] = (model_version, samples_new)
    return True


# The round's candidate participants: node -> the parameter version the fleet sees it hold.
Participants = dict[str, int]


def samples_progress(policy: AutoRoundPolicy, state: AutoState, participants: Participants) -> dict:
    """New samples the ``participants`` hold together, each capped at NODE_SHARE_MAX of the threshold.
    A figure counts only for the version the node holds now: a node whose round just committed
    (its DONE arrived, its new status not yet) holds nothing new as far as the fleet knows."""
    cap = math.ceil(policy.samples.threshold * NODE_SHARE_MAX)
    nodes = {n: min(c[1], cap) if (c := state.counts.get(n)) is not None and c[0] == v else 0
             for n, v in sorted(participants.items())}
    return {"total": sum(nodes.values()), "threshold": policy.samples.threshold, "node_cap": cap,
            "nodes": nodes}


def next_schedule_due(policy: AutoRoundPolicy, state: AutoState, now: float) -> float | None:
    """When the schedule is due next (``now`` or earlier: due), None when it is off."""
    sch = policy.schedule
    if not (policy.enabled and sch.enabled):
        return None
    anchor = state.schedule_anchor if state.schedule_anchor is not None else now
    due = anchor + sch.every_min * 60
    return sch.window.next_start(due) if sch.window is not None else due


@dataclass(frozen=True)
class Decision:
    trigger: Trigger | None  # the trigger that is due, None: nothing to start
    wait: str | None = None  # a trigger is due but must wait (the spacing), why


def decide(policy: AutoRoundPolicy, state: AutoState, participants: Participants, now: float) -> Decision:
    """Is an automatic round due at ``now`` (pure: tests drive it with any clock)?"""
    if not policy.enabled:
        return Decision(None)
    due: Trigger | None = None
    nxt = next_schedule_due(policy, state, now)
    if nxt is not None and nxt <= now:
        due = Trigger.SCHEDULE
    elif policy.samples.enabled:
        prog = samples_progress(policy, state, participants)
        if prog["total"] >= policy.samples.threshold:
            due = Trigger.SAMPLES
    if due is None:
        return Decision(None)
    if state.last_auto_start is not None:
        ready = state.last_auto_start + policy.min_spacing_min * 60
        if now < ready:
            return Decision(due, wait=f"the last automatic round started less than "
                                      f"{policy.min_spacing_min:g} min ago (next at {_iso(ready)})")
    return Decision(due)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stored_policy(raw: str | None) -> AutoRoundPolicy:
    """The stored policy; off (the defaults) when none is stored or it no longer validates (a
    bound tightened by an upgrade): a fleet must start, and must not start rounds on a guess."""
    if not raw:
        return AutoRoundPolicy()
    try:
        return AutoRoundPolicy.model_validate_json(raw)
    except ValueError as exc:
        log.warning("the stored automatic-round policy is not valid any more, automatic rounds are off: %s",
                    str(exc).splitlines()[0])
        return AutoRoundPolicy()


# start(request, trigger) -> the started round's dict; raises RoundRejected when the swarm cannot.
StartRound = Callable[[RoundRequest, Trigger], dict]


class AutoRounds:
    """Thread-safe. The fleet calls :meth:`on_status` for every node status and :meth:`check`
    periodically with the round's candidate participants; :attr:`clock` is the checks' time (a
    test replaces it to drive the schedule)."""

    def __init__(self, store: FleetHistory, clock: Callable[[], float],
                 stamp: Callable[[], float] | None = None) -> None:
        self._store = store
        self.clock = clock
        self._stamp = stamp or clock  # the time recorded actions carry (the fleet's clock)
        self._lock = threading.Lock()
        self._checking = threading.Lock()  # one check at a time: decide and start together
        self.policy = _stored_policy(store.get_value(_POLICY_KEY))
        self.state = AutoState.from_json(store.get_value(_STATE_KEY))
        self.ignored_backwards = 0  # statuses whose samples_new went backwards

    def set_policy(self, policy: AutoRoundPolicy) -> dict:
        """Store a new policy (the schedule counts from now when it is switched on or changed)."""
        now = self.clock()
        with self._lock:
            old = self.policy
            if (policy.enabled and policy.schedule.enabled) and not (old.enabled and old.schedule.enabled and
                                                                  old.schedule == policy.schedule):
                self.state.schedule_anchor = now
            self.policy = policy
            self.state.deferred.clear()
            self.state.recorded.clear()
            self._store.set_value(_POLICY_KEY, policy.model_dump_json())
            self._store.set_value(_STATE_KEY, self.state.to_json())
        self._store.record_action("auto_rounds.policy", {"policy": policy.model_dump(mode="json")},
                                  self._stamp())
        return policy.model_dump(mode="json")

    def on_status(self, node_id: str, model_version: int, samples_new: int | None) -> None:
        with self._lock:
            if not accept_samples(self.state, node_id, model_version, samples_new):
                self.ignored_backwards += 1

    def forget(self, node_id: str) -> None:
        with self._lock:
            self.state.counts.pop(node_id, None)

    def committed(self, nodes: list[str], version: int) -> None:
        """A round committed ``version`` on ``nodes``: nothing is new on them until they say so."""
        with self._lock:
            for n in nodes:
                self.state.counts[n] = (version, 0)

    def check(self, participants: Participants, start: StartRound) -> dict | None:
        """Start a round when a trigger is due; the started round, or None."""
        with self._checking:
            return self._check(participants, start)

    def _check(self, participants: Participants, start: StartRound) -> dict | None:
        now = self.clock()
        with self._lock:
            d = decide(self.policy, self.state, participants, now)
            policy = self.policy
            if d.trigger is None:
                self.state.deferred.clear()
                return None
            if d.wait is not None:
                self._defer(d.trigger, d.wait)
                return None
        try:
            rnd = start(policy.round, d.trigger)
        except RoundRejected as exc:
            with self._lock:
                self._defer(d.trigger, exc.reason)
            return None
        with self._lock:
            self.state.last_auto_start = now
            if d.trigger is Trigger.SCHEDULE:
                self.state.schedule_anchor = now
            self.state.deferred.clear()
            self.state.recorded.clear()
            self._store.set_value(_STATE_KEY, self.state.to_json())
        return rnd

    def _defer(self, trigger: Trigger, why: str) -> None:
        """Record a due round that waits, once per reason (every check retries)."""
        self.state.deferred[trigger.value] = why
        key = (trigger.value, why)
        if key in self.state.recorded or len(self.state.recorded) >= RECORDED_WAITS_MAX:
            return
        self.state.recorded.add(key)
        self._store.record_action("auto_round.deferred", {"trigger": trigger.value, "reason": why},
                                  self._stamp())

    def view(self, participants: Participants) -> dict[str, Any]:
        """The policy and where its triggers stand (the dashboard's panel)."""
        now = self.clock()
        with self._lock:
            p = self.policy
            return {"policy": p.model_dump(mode="json"),
                    "status": {"now": now, "next_due": next_schedule_due(p, self.state, now),
                               "samples": samples_progress(p, self.state, participants),
                               "last_auto_start": self.state.last_auto_start,
                               "spacing_until": (None if self.state.last_auto_start is None else
                                                 self.state.last_auto_start + p.min_spacing_min * 60),
                               "waiting": dict(self.state.deferred)}}
