"""Round manager: validates round requests, issues ``RoundCommand``s and folds ``RoundEvent``s.

Round life cycle as the fleet sees it::

    POST /api/rounds --> RUNNING --(every participant DONE, same params hash)--> DONE
                            |--(a FAILED event, a participant offline past the grace, a deadline,
                                hashes differ)--> FAILED

A participant's offline status (its Last Will, or a graceful stop) fails the round only if the
node does not report again within ``offline_grace_s``: a Last Will also fires when a connection
merely drops, and a node whose client reconnects within the grace (paho retries after 0.2 s)
finishes the round with its peers (the ring retransmits what the gap lost). A node that really
died is failed by the grace, or sooner by its peers' FAILED events when their step timeout ends.

The fleet never trains: it only tells nodes to and watches what they report. Deadlines are
the fleet's own, so a round whose nodes all died still ends (FAILED, with the reason).
"""

from __future__ import annotations

import bisect
import enum
import logging
import math
import secrets
import statistics
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from api.fleet.history import FleetHistory
from api.fleet.operations import Operations, OpKind, RoundRejected
from federation import topics
from federation.bounds import PARTICIPANTS_MAX, SITE_PARTICIPANTS_MAX, Id
from federation.hierarchy import round_sites
from federation.messages import EventKind, RoundAbort, RoundCommand, RoundEvent, Validation
from federation.robust import Aggregation
from federation.roundspec import Compression, RoundSpec, SyncMode
from federation.startversion import start_hash

__all__ = ["PLOT_POINTS", "Trigger", "RoundState", "RoundRequest", "RoundRejected", "Round", "RoundManager",
           "swarm_validation", "validation_weights", "regression", "VALIDATION_WEIGHT_FACTOR",
           "ROLLBACK_Z", "STRIKES_MAX", "too_many_participants"]

# A member's weight in the swarm's validation figure is at most this many times the median member's
# (issue 26 finding 9: one node claiming 2^40 samples set the figure by itself).
VALIDATION_WEIGHT_FACTOR = 2.0
# A round is rolled back only when its accuracy drop is this many standard errors of a paired
# comparison on the same samples (see regression).
ROLLBACK_Z = 2.0
# A member named as the cause of a round's failure (or excluded from its steps) by a majority of its
# peers in this many rounds without a clean commit in between is left out of later rounds.
STRIKES_MAX = 3

log = logging.getLogger(__name__)


class Trigger(enum.StrEnum):
    """Who started a round: the operator, or the fleet by itself (api/fleet/autorounds.py)."""

    OPERATOR = "operator"
    SCHEDULE = "schedule"
    SAMPLES = "samples"


class RoundState(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class RoundRequest(RoundSpec):
    """Body of ``POST /api/rounds``: a :class:`federation.roundspec.RoundSpec` (the same bounds as
    the signed command and the nodes' ``[training]`` table) plus the nodes to train (null: every
    idle node). sync, local_steps, compression and step_timeout_s null: gradient, 1, none and the
    fleet's step timeout (every member must share them); lr, aggregation and outlier_factor null:
    the nodes' ``[training]`` defaults. Unknown fields are a 422, not silently dropped."""

    model_config = ConfigDict(extra="forbid")

    nodes: Annotated[list[Id], Field(max_length=PARTICIPANTS_MAX)] | None = None


def _hierarchical_settings(req: RoundRequest) -> dict:
    """What a hierarchical round (participants past one ring, or across sites) runs with:
    uncompressed (screened) means (federation/hierarchy.py HierarchicalCollective, screening
    across levels); other requested settings are refused."""
    asked = {"compression": (req.compression, Compression.NONE),
             "aggregation": (req.aggregation, Aggregation.MEAN)}
    for key, (value, plain) in asked.items():
        if value is not None and value != plain:
            raise RoundRejected(f"{key}={value}: a round across sites or past {SITE_PARTICIPANTS_MAX} "
                                f"participants runs {key}={plain} (federation/PROTOCOL.md section 10)", 422)
    return {key: plain for key, (_, plain) in asked.items()}


def too_many_participants(count: int, what: str = "a round") -> str:
    """The refusal for more than PARTICIPANTS_MAX nodes when the operator named none."""
    return (f"{count} nodes are online: {what} takes at most {PARTICIPANTS_MAX} participants (the "
            f"signed command's limit until the scale-out work lifts it); pass \"nodes\" with up to "
            f"{PARTICIPANTS_MAX} of them")


@dataclass
class _Progress:
    losses: dict[int, float] = field(default_factory=dict)
    # (step, seconds since the round started) at the last step of each STEP event, in step order:
    # the wall-time axis of the plot (steps between two anchors are interpolated).
    times: list[tuple[int, float]] = field(default_factory=lambda: [(-1, 0.0)])
    last_event: float | None = None
    offline_at: float | None = None  # its offline status arrived then and nothing since
    done: bool = False
    failed: str | None = None
    params_sha256: str | None = None
    model_version: int | None = None
    val_before: Validation | None = None
    val_after: Validation | None = None
    excluded: list[str] = field(default_factory=list)  # DONE: members whose update was left out
    blamed: str | None = None  # FAILED: the member it named as the cause

    def add_losses(self, first: int, losses: list[float | None], steps: int, t: float) -> int:
        """Record losses of steps ``first, first+1, ...`` (only steps of the round, only finite
        values: the history is strict JSON); returns how many values were dropped."""
        dropped = 0
        last = None
        for i, v in enumerate(losses):
            s = first + i
            if not 0 <= s < steps or v is None or not math.isfinite(v):
                dropped += v is not None
                continue
            self.losses[s] = float(v)
            last = s
        if last is not None and last > self.times[-1][0]:
            self.times.append((last, max(t, self.times[-1][1])))
        return dropped


@dataclass
class Round:
    command: RoundCommand
    started_at: float
    skipped: list[str]
    state: RoundState = RoundState.RUNNING
    reason: str | None = None
    finished_at: float | None = None
    progress: dict[str, _Progress] = field(default_factory=dict)
    rollback: dict | None = None  # set when a rollback undid this round (see api.fleet.rollback)
    margin: float = 0.02  # how much worse validation may get (see regression)
    judged: bool = False  # the fleet checked its validation after it ended (auto rollback)
    # Each participant's validation sample count as its status reported it before the round (None:
    # an older node that does not report it): the most its validation result may weigh.
    checked_val: dict[str, int | None] = field(default_factory=dict)
    accounted: bool = False  # its failure names were counted (RoundManager._account)
    left_out: dict[str, str] = field(default_factory=dict)  # requested, left out for failing rounds
    trigger: Trigger = Trigger.OPERATOR

    @property
    def round_id(self) -> str:
        return self.command.round_id

    def loss_series(self, max_points: int | None = None) -> list[dict]:
        """Per reported step: each node's loss, and their mean.

        Nodes throttle STEP events by time, so they rarely report exactly the same steps. The
        mean uses each node's loss at that step, linearly interpolated between the two steps it
        did report around it; ``complete`` says every participant covered the step (reported or
        interpolated), so the mean over a complete step is over all nodes.
        """
        steps = sorted({s for p in self.progress.values() for s in p.losses})
        if max_points is not None and len(steps) > max_points >= 2:
            # Evenly spaced reported steps, first and last kept: enough for a plot.
            last = len(steps) - 1
            steps = [steps[round(i * last / (max_points - 1))] for i in range(max_points)]
        curves = {n: sorted(p.losses.items()) for n, p in sorted(self.progress.items())}
        out = []
        for s in steps:
            per = {n: p.losses[s] for n, p in sorted(self.progress.items()) if s in p.losses}
            values = [v for v in (_interpolate(c, s) for c in curves.values()) if v is not None]
            times = [v for v in (_interpolate(p.times, s) for p in self.progress.values()) if v is not None]
            out.append({"step": s, "mean": sum(values) / len(values), "nodes": per,
                        "complete": len(values) == len(self.progress),
                        "t": round(sum(times) / len(times), 4) if times else None})
        return out

    def weights(self) -> dict[str, int]:
        """Each reporting participant's weight in the swarm's validation (see validation_weights)."""
        reported = {}
        for n, p in self.progress.items():
            counts = [v.samples for v in (p.val_before, p.val_after) if v is not None]
            if counts:
                reported[n] = min(counts)
        return validation_weights(reported, self.checked_val)

    def validation(self, without: str | None = None) -> dict:
        """The swarm's validation result before and after the round (see swarm_validation), each
        member weighted by :meth:`weights`; ``without`` leaves one member out."""
        w = self.weights()
        members = [n for n in sorted(self.progress) if n != without]
        return {"before": swarm_validation([self.progress[n].val_before for n in members],
                                           [w.get(n, 0) for n in members]),
                "after": swarm_validation([self.progress[n].val_after for n in members],
                                          [w.get(n, 0) for n in members])}

    def regressed(self) -> str | None:
        """Why the round's validation regressed enough to roll it back (see regression), else None.
        With three or more reporting members the drop must also hold without any one of them, so a
        single member reporting a fall its peers do not see cannot force a rollback."""
        why = regression(self.validation(), self.margin)
        reporters = [n for n, p in self.progress.items()
                     if p.val_before is not None and p.val_after is not None]
        if why is None or len(reporters) < 3:
            return why
        for n in sorted(reporters):
            if regression(self.validation(without=n), self.margin) is None:
                return None
        return why

    def versions(self) -> tuple[int | None, int | None]:
        """(version the round started from, version it committed); None before any DONE."""
        after = max((p.model_version for p in self.progress.values() if p.model_version is not None),
                    default=None)
        return (None if after is None else max(0, after - 1)), after

    def hashes(self) -> dict[str, str]:
        return {n: p.params_sha256 for n, p in self.progress.items() if p.params_sha256}

    def to_dict(self, max_points: int | None = None) -> dict:
        hashes = self.hashes()
        agree = None
        if self.progress and len(hashes) == len(self.progress):
            agree = len(set(hashes.values())) == 1
        cmd = self.command
        before, after = self.versions()
        validation = self.validation()
        return {
            "round_id": cmd.round_id,
            "trigger": self.trigger.value,
            "state": self.state.value,
            "reason": self.reason,
            "participants": list(cmd.participants),
            "sites": cmd.sites,  # None: one flat ring (federation/PROTOCOL.md section 10)
            "skipped": self.skipped,
            "left_out": self.left_out,
            "steps": cmd.steps,
            "lr": cmd.lr,
            "sync": cmd.sync.value if cmd.sync is not None else None,
            "local_steps": cmd.local_steps,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "loss": self.loss_series(max_points),
            "nodes": {
                n: {"last_step": max(p.losses, default=None), "done": p.done, "failed": p.failed,
                    "params_sha256": p.params_sha256, "model_version": p.model_version,
                    "val_before": _val(p.val_before), "val_after": _val(p.val_after)}
                for n, p in sorted(self.progress.items())
            },
            "params_agree": agree,
            "excluded": sorted({m for p in self.progress.values() for m in p.excluded}),
            "params_sha256": next(iter(hashes.values())) if agree else None,
            "version_before": before,
            "version_after": after,
            "validation": validation,
            "validation_weights": self.weights(),
            "regressed": self.regressed() if self.state is RoundState.DONE else None,
            "rollback": self.rollback,
        }


def _val(v: Validation | None) -> dict | None:
    return None if v is None else {"loss": v.loss, "accuracy": v.accuracy, "samples": v.samples}


def validation_weights(reported: dict[str, int], checked: dict[str, int | None]) -> dict[str, int]:
    """How much each member's validation result weighs: the samples it reported for the round, at
    most what its status reported before the round (``checked``; an older node that reports none is
    taken at its word) and at most VALIDATION_WEIGHT_FACTOR x the median member's. One member with
    a valid key can lie about its counts, but then weighs at most twice a typical member."""
    base = {n: min(r, c) if (c := checked.get(n)) is not None else r for n, r in reported.items()}
    if not base:
        return {}
    cap = int(VALIDATION_WEIGHT_FACTOR * statistics.median_low(base.values()))
    return {n: min(v, cap) for n, v in base.items()}


def swarm_validation(vals: list[Validation | None], weights: list[int] | None = None) -> dict | None:
    """The swarm's validation result: the mean over nodes weighted by ``weights`` (default: their
    validation samples, so it equals the result on the union of their validation sets); None when
    nobody reported. ``accuracy`` is None unless every reporting node measured one; ``samples`` is
    the total weight, ``nodes`` counts reporters."""
    ws = weights if weights is not None else [v.samples if v is not None else 0 for v in vals]
    got = [(v, w) for v, w in zip(vals, ws, strict=True) if v is not None and v.samples > 0 and w > 0]
    if not got:
        return None
    n = sum(w for _, w in got)
    acc: float | None = 0.0
    for v, w in got:
        acc = None if acc is None or v.accuracy is None else acc + v.accuracy * w
    # Weights below 1 keep a diverged node's huge (finite) loss finite: the history is strict JSON.
    loss = min(sum(v.loss * (w / n) for v, w in got), sys.float_info.max)
    return {"loss": loss, "accuracy": None if acc is None else acc / n, "samples": n, "nodes": len(got)}


def regression(validation: dict, margin: float) -> str | None:
    """Why a round's swarm validation got worse than before by more than ``margin`` and more than
    noise explains, or None.

    Accuracy: an absolute drop (0.02 = 2 points) that also exceeds ROLLBACK_Z standard errors of a
    paired comparison on the same n samples. Before and after are measured on the same samples, so
    the drop is (wrong now - right now) / n; even if every changed sample went the same way
    (McNemar's test, its most favourable case) z = sqrt(n x drop), so a drop counts only when more
    than ROLLBACK_Z^2 = 4 samples' worth turned wrong: one flipped sample of 44 is noise, not a
    regression. Loss-only models (nodes report no spread of the loss): a relative rise."""
    before, after = validation.get("before"), validation.get("after")
    if not before or not after:
        return None
    if before["accuracy"] is not None and after["accuracy"] is not None:
        drop = before["accuracy"] - after["accuracy"]
        n = before.get("samples") or 0
        if drop > margin and n * drop > ROLLBACK_Z ** 2:
            return (f"validation accuracy fell from {before['accuracy']:.4f} to {after['accuracy']:.4f}: "
                    f"more than the margin {margin:g} and beyond noise on {n} samples "
                    f"({n * drop:.1f} samples' worth, more than {ROLLBACK_Z ** 2:g})")
        return None
    if after["loss"] > before["loss"] * (1 + margin) + 1e-12:
        return (f"validation loss rose from {before['loss']:.4g} to {after['loss']:.4g} "
                f"(more than {margin:.0%})")
    return None


def _interpolate(curve: list[tuple[int, float]], step: int) -> float | None:
    """The curve's value at ``step`` (linear between its points, sorted by step), None outside
    its range. Binary search: long rounds have thousands of points per node."""
    if not curve or step < curve[0][0] or step > curve[-1][0]:
        return None
    i = bisect.bisect_left(curve, step, key=lambda p: p[0])
    s1, v1 = curve[i]
    if s1 == step or i == 0:
        return v1
    s0, v0 = curve[i - 1]
    return v0 + (v1 - v0) * (step - s0) / (s1 - s0)


Publish = Callable[[str, BaseModel], None]

PLOT_POINTS = 400  # loss points per round in the event stream and history (the plot's resolution)


def _new_round_id() -> str:
    return "r" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


class RoundManager:
    """Thread-safe; ``publish(topic, message)`` sends on MQTT (injected so tests can capture it)."""

    def __init__(self, *, swarm: str, publish: Publish, start_timeout_s: float, idle_timeout_s: float,
                 step_timeout_s: float = 30.0, max_steps: int = 10_000, history: int = 200,
                 store: FleetHistory | None = None, margin: float = 0.02,
                 offline_grace_s: float = 5.0, operations: Operations | None = None) -> None:
        self._swarm = swarm
        self._publish = publish
        self._start_timeout = start_timeout_s
        self._idle_timeout = idle_timeout_s
        self._step_timeout = step_timeout_s
        self._offline_grace = offline_grace_s
        self._max_steps = max_steps
        self._history = history
        self._store = store  # durable history (rounds and their metrics); None: memory only
        self._margin = margin
        self._lock = threading.Lock()
        self._rounds: OrderedDict[str, Round] = OrderedDict()
        self.ignored_events = 0  # events of rounds this fleet did not start
        # Members failing rounds: strikes in a row (see _account) and those left out, with why.
        self._strikes: dict[str, int] = {}
        self._left_out: dict[str, str] = {}
        self.dropped_values = 0  # non-finite losses and steps outside the round
        # The fleet's one coordinator of what may run together (api/fleet/operations.py); alone
        # (unit tests), a coordinator of its own that knows only rounds.
        self._ops = operations if operations is not None else Operations()
        self._ops.register(OpKind.ROUND, self._running_phrase)

    # -- commands -------------------------------------------------------------------------
    def running(self) -> str | None:
        """The id of the running round, if one is."""
        with self._lock:
            return next((r.round_id for r in self._rounds.values() if r.state is RoundState.RUNNING), None)

    def _running_phrase(self) -> str | None:
        rid = self.running()
        return None if rid is None else f"round {rid} is still running"

    def judge(self, round_id: str) -> tuple[Round, str] | None:
        """Once per round, after it ended DONE: the round and why its validation regressed (else None)."""
        with self._lock:
            rnd = self._rounds.get(round_id)
            if rnd is None or rnd.state is not RoundState.DONE or rnd.judged:
                return None
            rnd.judged = True
            why = rnd.regressed()
        return (rnd, why) if why else None

    def start(self, req: RoundRequest, *, online: set[str], known: set[str], now: float,
              halted: dict[str, str] | None = None,
              holdings: dict[str, str] | None = None,
              val_counts: dict[str, int | None] | None = None,
              site_of: dict[str, str | None] | None = None, trigger: Trigger = Trigger.OPERATOR) -> Round:
        """Validate against the live swarm, publish the RoundCommand, return the new round.
        ``holdings`` (node -> params_sha256 of its last status) fixes the start parameters by
        the start-version rule (federation/startversion.py), never by the highest version.
        ``val_counts`` (node -> validation samples its status reported) bounds each member's
        weight in the round's validation figure. Members left out for failing rounds are skipped.
        ``site_of`` (node -> the site its status declares) groups a round past one ring's size, or
        spanning sites, into the sites its command names (federation/hierarchy.py)."""
        if req.steps > self._max_steps:
            raise RoundRejected(f"steps={req.steps} exceeds this fleet's limit of {self._max_steps}", 422)
        # check-then-start under the coordinator's lock: nothing it may not overlap starts meanwhile
        with self._ops.starting(OpKind.ROUND), self._lock:
            for r in self._rounds.values():
                if r.state is not RoundState.RUNNING and not r.accounted:
                    self._account(r)
            if req.nodes is None:
                wanted = sorted(online)
                count = sum(n not in self._left_out for n in wanted)
                if count > PARTICIPANTS_MAX:
                    raise RoundRejected(too_many_participants(count), 409)
            else:
                wanted = sorted(set(req.nodes))
                unknown = [n for n in wanted if n not in known]
                if unknown:
                    raise RoundRejected(f"unknown node(s): {', '.join(unknown)}", 404)
            left_out = {n: self._left_out[n] for n in wanted if n in self._left_out}
            participants = [n for n in wanted if n in online and n not in left_out]
            skipped = [n for n in wanted if n not in online or n in left_out]
            if len(participants) < 2:
                have = ", ".join(participants) or "none"
                out = "".join(f"; {n} is left out: {why}" for n, why in sorted(self._left_out.items()))
                out += "".join(f"; {n} is halted, no bootable slot: {why}"
                               for n, why in sorted((halted or {}).items())
                               if req.nodes is None or n in wanted)
                raise RoundRejected(
                    f"fewer than 2 nodes online and idle among the requested participants (idle: {have}); "
                    f"a round needs at least 2{out}")
            start = None
            if holdings is not None:
                last = next((r.to_dict().get("params_sha256") for r in reversed(self._rounds.values())
                             if r.state is RoundState.DONE), None)
                start = start_hash({p: holdings.get(p, "") for p in participants}, last_committed=last)
                if start is None:
                    raise RoundRejected(
                        "the participants hold different parameters and none has a majority: choose the "
                        "nodes to train (those holding the parameters you want) with \"nodes\"")
            # The settings every member must share are named here; lr, aggregation and
            # outlier_factor left null are the nodes' [training] defaults.
            spec = req.model_dump(exclude={"nodes"}) | {
                "sync": req.sync or SyncMode.GRADIENT, "local_steps": req.local_steps or 1,
                "compression": req.compression or Compression.NONE,
                "step_timeout_s": req.step_timeout_s or self._step_timeout}
            sites = round_sites(participants, site_of or {})
            if sites is not None:
                spec |= _hierarchical_settings(req)
            cmd = RoundCommand(round_id=_new_round_id(), participants=participants, issued_at=now,
                               start_sha256=start, sites=sites, **spec)
            rnd = Round(command=cmd, started_at=now, skipped=skipped,
                        progress={n: _Progress() for n in participants}, margin=self._margin,
                        checked_val={n: (val_counts or {}).get(n) for n in participants},
                        left_out=left_out, trigger=trigger)
            self._rounds[cmd.round_id] = rnd
            while len(self._rounds) > self._history:
                self._rounds.popitem(last=False)
            self._save(rnd)
        # Publish outside the lock: a slow broker must not block readers.
        self._publish(topics.command(self._swarm), cmd)
        return rnd

    # -- members failing rounds -------------------------------------------------------------
    def _account(self, rnd: Round) -> None:
        """Count, once per ended round, which members a majority of their peers named as its cause
        (FAILED ``member``) or left out of a step (DONE ``excluded``). A member named in STRIKES_MAX
        rounds without a clean commit in between is left out of later rounds until readmitted."""
        rnd.accounted = True
        names: dict[str, set[str]] = {}
        for reporter, p in rnd.progress.items():
            for m in set(p.excluded) | ({p.blamed} if p.blamed else set()):
                if m != reporter and m in rnd.progress:
                    names.setdefault(m, set()).add(reporter)
        peers = len(rnd.progress) - 1
        for m in rnd.progress:
            by = names.get(m, set())
            if peers > 0 and 2 * len(by) > peers:
                self._strikes[m] = self._strikes.get(m, 0) + 1
                if self._strikes[m] >= STRIKES_MAX and m not in self._left_out:
                    what = "failed" if rnd.state is RoundState.FAILED else "had its update excluded in"
                    self._left_out[m] = (f"named by {len(by)} of its {peers} peers in {self._strikes[m]} "
                                         f"rounds in a row (last: {what} round {rnd.round_id}); readmit "
                                         "it with POST /api/nodes/{id}/readmit".replace("{id}", m))
                    log.warning("node %s left out of rounds: %s", m, self._left_out[m])
            elif rnd.state is RoundState.DONE:
                self._strikes.pop(m, None)

    def _account_if_final(self, rnd: Round) -> None:
        if rnd.state is not RoundState.RUNNING and not rnd.accounted and \
                all(p.done or p.failed for p in rnd.progress.values()):
            self._account(rnd)

    def left_out(self) -> dict[str, str]:
        """Members left out of rounds (node -> why)."""
        with self._lock:
            return dict(self._left_out)

    def readmit(self, node_id: str) -> bool:
        """The operator takes ``node_id`` back into rounds; False when it was not left out."""
        with self._lock:
            self._strikes.pop(node_id, None)
            return self._left_out.pop(node_id, None) is not None

    def finished_by(self, node_id: str, round_id: str | None) -> _Progress | None:
        """``node_id``'s DONE report of ``round_id`` when that round is DONE: the node ended it and
        holds its parameters, whatever status of the round it still shows (its idle status follows
        its DONE event). None otherwise."""
        with self._lock:
            rnd = self._rounds.get(round_id) if round_id is not None else None
            p = rnd.progress.get(node_id) if rnd is not None else None
            done = rnd is not None and p is not None and p.done and rnd.state is RoundState.DONE
            return p if done else None

    # -- events ---------------------------------------------------------------------------
    def on_event(self, ev: RoundEvent, now: float) -> Round | None:
        """Fold one node event into its round; returns the round when it changed."""
        with self._lock:
            rnd = self._rounds.get(ev.round_id)
            if rnd is None or ev.node_id not in rnd.progress:
                self.ignored_events += 1
                return None
            p = rnd.progress[ev.node_id]
            p.last_event = now
            p.offline_at = None  # it reports: whatever its offline status said is over
            if ev.kind is EventKind.STEP:
                losses = ev.losses if ev.losses is not None else [ev.loss]
                first = ev.step - len(losses) + 1  # ``losses`` end at ``step``
                self.dropped_values += p.add_losses(first, losses, rnd.command.steps, now - rnd.started_at)
            elif ev.kind is EventKind.DONE:
                p.done = True
                p.params_sha256 = ev.params_sha256
                p.model_version = ev.model_version
                p.val_before, p.val_after = ev.val_before, ev.val_after
                p.excluded = list(ev.excluded or [])
            elif ev.kind is EventKind.FAILED:
                p.failed = ev.reason or "failed"
                p.blamed = ev.member
            was_running = rnd.state is RoundState.RUNNING
            if was_running:
                self._settle(rnd, now)
            self._account_if_final(rnd)
            failed_now = was_running and rnd.state is RoundState.FAILED
        if failed_now:  # members still waiting on the ring give up now instead of at their timeout
            self._abort(rnd)
        return rnd

    def _settle(self, rnd: Round, now: float) -> None:
        failed = {n: p.failed for n, p in rnd.progress.items() if p.failed}
        if failed:
            why = "; ".join(f"{n}: {r}" for n, r in sorted(failed.items()))
            self._finish(rnd, RoundState.FAILED, why, now)
        elif all(p.done for p in rnd.progress.values()):
            if len(set(rnd.hashes().values())) == 1:
                self._finish(rnd, RoundState.DONE, None, now)
            else:
                self._finish(rnd, RoundState.FAILED, "participants committed different parameters "
                             f"({', '.join(f'{n}={h[:12]}' for n, h in sorted(rnd.hashes().items()))})", now)

    def _finish(self, rnd: Round, state: RoundState, reason: str | None, now: float) -> None:
        rnd.state, rnd.reason, rnd.finished_at = state, reason, now
        self._save(rnd)

    def _save(self, rnd: Round) -> None:
        if self._store is not None:
            self._store.save_round(rnd.to_dict(PLOT_POINTS))

    def node_offline(self, node_id: str, now: float, *, immediate: bool = False) -> list[Round]:
        """A participant's offline status arrived: its running rounds fail once it has stayed
        offline for the grace (:meth:`tick`), or at once with ``immediate`` (or no grace); returns
        the rounds failed now."""
        changed = []
        with self._lock:
            for rnd in self._rounds.values():
                if rnd.state is RoundState.RUNNING and node_id in rnd.progress \
                        and not rnd.progress[node_id].done:
                    p = rnd.progress[node_id]
                    if immediate or self._offline_grace <= 0:
                        self._finish(rnd, RoundState.FAILED, f"node {node_id} went offline during the round",
                                     now)
                        changed.append(rnd)
                    elif p.offline_at is None:
                        p.offline_at = now
        for rnd in changed:
            self._abort(rnd)
        return changed

    def node_online(self, node_id: str, round_id: str | None) -> None:
        """A status that is not offline arrived from ``node_id``, naming the round it is in: it is
        back in that round (reconnected). A node back without the round (restarted, it lost the
        round's state) stays offline for the round: the grace runs on."""
        with self._lock:
            rnd = self._rounds.get(round_id) if round_id is not None else None
            p = rnd.progress.get(node_id) if rnd is not None else None
            if rnd is not None and p is not None and rnd.state is RoundState.RUNNING:
                p.offline_at = None

    def tick(self, now: float) -> list[Round]:
        """Fail rounds whose participants missed the fleet's deadlines; returns those rounds."""
        changed = []
        with self._lock:
            for rnd in self._rounds.values():
                if rnd.state is not RoundState.RUNNING:
                    continue
                silent = []
                for n, p in rnd.progress.items():
                    if p.done:
                        continue
                    if p.offline_at is not None and now - p.offline_at > self._offline_grace:
                        silent.append(f"{n} (went offline and did not come back within "
                                      f"{self._offline_grace:g}s)")
                    elif p.last_event is None and now - rnd.started_at > self._start_timeout:
                        silent.append(f"{n} (no report within {self._start_timeout:g}s)")
                    elif p.last_event is not None and now - p.last_event > self._idle_timeout:
                        silent.append(f"{n} (silent for {self._idle_timeout:g}s)")
                if silent:
                    self._finish(rnd, RoundState.FAILED, "deadline passed: " + ", ".join(sorted(silent)), now)
                    changed.append(rnd)
        for rnd in changed:
            self._abort(rnd)
        return changed

    def _abort(self, rnd: Round) -> None:
        # Tell the other participants to stop waiting; they may already have given up.
        try:
            self._publish(topics.command(self._swarm),
                          RoundAbort(round_id=rnd.round_id, reason=rnd.reason or "aborted by fleet"))
        except Exception as exc:  # best effort: the round is failed either way
            log.warning("round %s: could not publish the abort to the nodes: %s", rnd.round_id, exc)

    def mark_rolled_back(self, nodes: set[str], to_version: int, info: dict) -> list[str]:
        """Mark DONE rounds of ``nodes`` that committed a version above ``to_version`` as undone by
        the rollback ``info``; their ids. Rounds of earlier fleet processes are updated in the store."""
        marked = []
        with self._lock:
            for rnd in self._rounds.values():
                after = rnd.versions()[1]
                if rnd.state is RoundState.DONE and rnd.rollback is None and after is not None \
                        and after > to_version and nodes & set(rnd.progress):
                    rnd.rollback = dict(info)
                    self._save(rnd)
                    marked.append(rnd.round_id)
            live = set(self._rounds)
        if self._store is not None:
            for d in self._store.rounds(self._history):
                if d["round_id"] in live or d["state"] != RoundState.DONE.value or d.get("rollback"):
                    continue
                after = d.get("version_after")
                if after is not None and after > to_version and nodes & set(d["participants"]):
                    d["rollback"] = dict(info)
                    self._store.save_round(d)
                    marked.append(d["round_id"])
        return marked

    # -- queries --------------------------------------------------------------------------
    def get(self, round_id: str, max_points: int | None = None) -> dict | None:
        """One round; ``max_points`` thins the loss series (the event stream and history use it).
        A round of an earlier fleet process comes from the store, thinned to PLOT_POINTS."""
        with self._lock:
            rnd = self._rounds.get(round_id)
            if rnd is not None:
                return rnd.to_dict(max_points)
        return self._store.get_round(round_id) if self._store is not None else None

    def history(self, max_points: int | None = PLOT_POINTS, *, limit: int = 50,
                before: float | None = None) -> list[dict]:
        """Up to ``limit`` rounds started before ``before`` (a ``started_at``), newest first; from the
        store when there is one (so rounds of earlier fleet processes are included)."""
        with self._lock:
            live = {r.round_id: r.to_dict(max_points) for r in self._rounds.values()
                    if before is None or r.started_at < before}
        if self._store is None:
            rows = sorted(live.values(), key=lambda d: (d["started_at"], d["round_id"]), reverse=True)
            return rows[:limit]
        # Rounds this process runs are fresher in memory than in the store (loss points arrive
        # between saves).
        return [live.get(d["round_id"], d) for d in self._store.rounds(limit, before)]
