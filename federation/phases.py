"""A training round's phases as functions over a collective (federation/PROTOCOL.md sections 5-7).

A member runs them in this order (``edgenode.roundphases.run_round`` is that sequence on a node):

0. :class:`RoundPlan`: the signed command resolved against the member's defaults.
1. :func:`hello`: every member learns every member's version, parameter hash, parameter count and
   whether it has samples; :func:`choose_start` names whose parameters the round starts from and
   :func:`start_from` hands them to everyone whose hash differs.
2. :func:`federation.steps.train_steps`: each step's updates are combined by the round's
   aggregator (:mod:`federation.aggregators`) through a :class:`StepCombiner`, which also keeps
   who was left out and why.
3. :func:`agree`: the final parameters' hashes are compared; if they differ, one member's
   parameters are adopted (checked against what it reported).
4. :func:`check_update` and :func:`vote`: every member checks the result and stages it, then all
   vote; only a unanimous yes commits.

Every phase works on flat float32 vectors and a :class:`RoundContext`; a phase that finds the round
cannot go on raises :class:`~federation.errors.RoundRefused` (naming the member at fault when there
is one). Staging and committing the parameters is the caller's (a node's durable store).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from federation.aggregators import Settings, Step, aggregator_for
from federation.aggregators.base import Exchanger
from federation.errors import AllExcluded, RoundRefused
from federation.limits import (
    OUTLIER_FACTOR_DEFAULT,
    SYNC_GAP_OF_PARAMS,
    SYNC_GAP_OF_UPDATE,
    UPDATE_NORM_FACTOR,
)
from federation.modes import Compression, SyncMode
from federation.robust import Aggregation

if TYPE_CHECKING:  # the node's side only: the training worker never loads the message models
    from federation.messages import RoundCommand
    from federation.roundspec import RoundDefaults

__all__ = ["RoundPlan", "Members", "RoundContext", "MemberFacts", "hello", "choose_start", "start_from",
           "StepCombiner", "agree", "sync_gap_limit", "check_update", "vote", "abort_peers", "hash_chunks",
           "vector_sha256"]

log = logging.getLogger("fractal.federation.phases")
_SLOT = 7  # hello values per member: version, 4 x 16-bit hash chunks, n_params mod 2^24, has_samples


@dataclass(frozen=True)
class RoundPlan:
    """A signed RoundCommand as one member runs it: resolved against the member's defaults."""

    round_id: str
    steps: int
    lr: float | None
    sync: SyncMode
    local_steps: int
    group: tuple[str, ...]  # ring order = sorted(participants)
    compression: Compression = Compression.NONE
    step_timeout_s: float = 30.0
    start_sha256: str | None = None  # the fleet's start-version decision (federation/startversion.py)
    aggregation: Aggregation = Aggregation.MEAN  # federation/aggregators/
    outlier_factor: float = OUTLIER_FACTOR_DEFAULT  # 0 = no outlier screening

    @classmethod
    def from_command(cls, cmd: RoundCommand, defaults: RoundDefaults | None = None) -> RoundPlan:
        """The command's settings, those it leaves null or out taken from the member's defaults (a
        node's ``[training]`` table, :func:`federation.roundspec.resolve`); an unset ``lr``
        everywhere means the artifact's compiled rate."""
        from federation.roundspec import resolve

        r = resolve(cmd, defaults)
        return cls(round_id=cmd.round_id, steps=r.steps, lr=r.lr, sync=r.sync, local_steps=r.local_steps,
                   group=tuple(sorted(set(cmd.participants))), compression=r.compression,
                   step_timeout_s=r.step_timeout_s, start_sha256=cmd.start_sha256,
                   aggregation=r.aggregation, outlier_factor=r.outlier_factor)


class Members(Exchanger, Protocol):
    """What the phases need of a collective (``federation.ring.RingAllreduce`` has it)."""

    def broadcast(self, vec: np.ndarray | None, *, root: str, group: list[str], tag: str,
                  timeout: float = 30.0) -> np.ndarray: ...

    def abort(self, tag: str, peers: list[str], reason: str) -> None: ...


@dataclass(frozen=True)
class RoundContext:
    """One member's view of a round: the collective, the round, who it is, the group in ring order
    (``sorted(participants)``) and the deadline of each collective call."""

    collective: Members
    round_id: str
    node_id: str
    group: tuple[str, ...]
    timeout: float

    @classmethod
    def of(cls, plan: RoundPlan, collective: Members, node_id: str) -> RoundContext:
        return cls(collective, plan.round_id, node_id, plan.group, plan.step_timeout_s)

    @property
    def rank(self) -> int:
        return self.group.index(self.node_id)

    @property
    def peers(self) -> list[str]:
        return [m for m in self.group if m != self.node_id]


@dataclass(frozen=True)
class MemberFacts:
    """What a member says of itself in the hello."""

    version: int
    sha256: str  # of its parameters (the hello carries its first 64 bits)
    n_params: int
    has_samples: bool


@dataclass(frozen=True)
class Hello:
    """What every member learnt in the hello (the same on every member)."""

    versions: dict[str, int]
    hashes: dict[str, tuple[int, ...]]  # the first 64 bits of each member's parameter hash
    n_params: set[int]
    contributors: tuple[bool, ...] = field(default=())  # in ring order: who has samples


def hash_chunks(sha: str) -> list[float]:
    """The first 64 bits of a hex sha256 as four 16-bit numbers (exact in float32)."""
    return [float(int(sha[i * 4:(i + 1) * 4], 16)) for i in range(4)]


def vector_sha256(vec: np.ndarray) -> str:
    """sha256 of a flat float32 vector's bytes (equal to a node's ``params_sha256`` of the arrays)."""
    return hashlib.sha256(np.ascontiguousarray(vec, dtype=np.float32).tobytes()).hexdigest()


def abort_peers(ctx: RoundContext, tag: str, reason: str) -> None:
    """Void the collective ``tag`` for every peer, so members blocked in (or about to start) it stop
    now instead of at the deadline."""
    ctx.collective.abort(tag, ctx.peers, reason)


def hello(ctx: RoundContext, mine: MemberFacts) -> Hello:
    """``{round_id}/hello``: a SUM-allreduce in which each member fills only its own slot."""
    vec = np.zeros(len(ctx.group) * _SLOT, np.float32)
    i = ctx.rank * _SLOT
    vec[i:i + _SLOT] = [mine.version, *hash_chunks(mine.sha256), mine.n_params % (1 << 24),
                        float(mine.has_samples)]
    # Integers below 2^24 sum exactly in float32 and only one member is non-zero per slot.
    out = np.asarray(ctx.collective.allreduce(vec, group=list(ctx.group), tag=f"{ctx.round_id}/hello",
                                              op="sum", timeout=ctx.timeout))
    rows = {m: out[k * _SLOT:(k + 1) * _SLOT].tolist() for k, m in enumerate(ctx.group)}
    return Hello(versions={m: int(f[0]) for m, f in rows.items()},
                 hashes={m: tuple(int(v) for v in f[1:5]) for m, f in rows.items()},
                 n_params={int(f[5]) for f in rows.values()},
                 contributors=tuple(bool(int(rows[m][6])) for m in ctx.group))


def choose_start(hashes: dict[str, tuple[int, ...]], start_sha256: str | None) -> str:
    """The member whose parameters the round starts from (the first in ring order among the
    holders of the start parameters): those named by the fleet, else a strict majority's; never
    the highest version claimed (a rogue member could claim any). Raises RoundRefused when nobody
    holds the named parameters or there is no majority."""
    if start_sha256:
        want = tuple(int(c) for c in hash_chunks(start_sha256))
        holders = [m for m in sorted(hashes) if hashes[m] == want]
        if not holders:
            raise RoundRefused(f"no participant holds the start parameters {start_sha256[:12]} named by "
                               "the fleet", hint="include a node that holds them")
        return holders[0]
    counts: dict[tuple[int, ...], list[str]] = {}
    for m in sorted(hashes):
        counts.setdefault(hashes[m], []).append(m)
    best = max(counts.values(), key=len)
    if 2 * len(best) <= len(hashes):
        raise RoundRefused("participants hold different parameters and none has a majority",
                           hint="start the round from the fleet, which names the start parameters")
    return best[0]


def start_from(ctx: RoundContext, root: str, mine: np.ndarray) -> np.ndarray:
    """``{round_id}/params``: ``root`` broadcasts its parameters; everyone continues from them."""
    vec = ctx.collective.broadcast(mine if ctx.node_id == root else None, root=root, group=list(ctx.group),
                                   tag=f"{ctx.round_id}/params", timeout=ctx.timeout)
    return np.asarray(vec, np.float32)


class StepCombiner:
    """The round's aggregator (picked by its settings) applied step after step; collects who was
    left out (and why) over the round.

    A member left out by the direction check alone is named only when that happened in at least
    half of the round's steps (:meth:`named`): an honest member on skewed data can look like a
    flipped one now and then (PROTOCOL.md section 7.1), an insider does so step after step. Its
    update is left out of those steps either way."""

    def __init__(self, ctx: RoundContext, settings: Settings, contributors: tuple[bool, ...]) -> None:
        self.ctx = ctx
        self.contributors = tuple(contributors)  # members with samples (the others send zeros)
        self.compression = Compression(settings.compression)
        self.outlier_factor = float(settings.outlier_factor)
        self.aggregator = aggregator_for(settings)
        self.excluded: dict[str, str] = {}
        self.opposed: dict[str, tuple[int, str]] = {}  # member -> (steps, first reason)
        self.steps = 0

    def combine(self, update: np.ndarray, step: int) -> np.ndarray:
        """Step ``step``'s combined update (the same bits on every member)."""
        c = self.ctx
        at = Step(c.collective, c.node_id, c.group, self.contributors, c.round_id, step, c.timeout,
                  self.compression, self.outlier_factor)
        try:
            out = self.aggregator.combine(at, np.asarray(update, np.float32))
        except AllExcluded as exc:
            raise RoundRefused(str(exc)) from exc
        self.steps += 1
        for m, why in out.excluded.items():
            if m not in self.excluded and m not in self.opposed:
                log.warning("%s: round %s step %d: excluding %s's update (%s)", c.node_id, c.round_id,
                            step, m, why)
            if m in out.opposed:
                count, first = self.opposed.get(m, (0, f"step {step}: {why}"))
                self.opposed[m] = (count + 1, first)
            elif m not in self.excluded:
                self.excluded[m] = f"step {step}: {why}"
        return out.update

    def named(self) -> dict[str, str]:
        """The members to name as excluded from the round (member -> why)."""
        out = dict(self.excluded)
        for m, (count, first) in self.opposed.items():
            if m not in out and 2 * count >= self.steps:
                out[m] = f"{first} (pointed away in {count} of {self.steps} steps)"
        return out


def agree(ctx: RoundContext, params: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, bool]:
    """``{round_id}/commit``: exchange 64 bits of every member's final parameter hash (a barrier
    and an agreement check in one); returns the parameters to commit and whether they were synced.

    Identical inputs give identical bits only if every member runs the same optimizer code on
    the same CPU semantics. A swarm may mix boards (an aarch64 build may fuse multiply-adds where
    x86-64 rounds twice), so if any hash differs one member broadcasts its parameters
    (``{round_id}/final``) and everyone commits those: the swarm always agrees. Which member: the
    first holder of the hash a strict majority reports (so a lone member reporting another hash
    imposes nothing), else the first member in ring order, whose parameters every other member
    then accepts only within :func:`sync_gap_limit` of its own (rounding drift, not a different
    model: a member that split everyone's view, e.g. by sending different rows to different peers,
    cannot use the missing majority to impose its parameters). What arrives must hash to what its
    root reported. Otherwise RoundRefused naming the root (its peers' vote is voided at once).
    """
    n, k = len(ctx.group), ctx.rank
    vec = np.zeros(n * 4, np.float32)
    vec[k * 4:(k + 1) * 4] = hash_chunks(vector_sha256(params))
    out = np.asarray(ctx.collective.allreduce(vec, group=list(ctx.group), tag=f"{ctx.round_id}/commit",
                                              op="sum", timeout=ctx.timeout))
    hashes = [tuple(float(v) for v in out[i * 4:(i + 1) * 4]) for i in range(n)]
    if len(set(hashes)) == 1:
        return params, False
    best, count = Counter(hashes).most_common(1)[0]
    majority = 2 * count > n
    root = ctx.group[hashes.index(best)] if majority else ctx.group[0]
    want = hashes[ctx.group.index(root)]
    log.warning("%s: round %s ended with differing parameters; adopting %s's (%s)", ctx.node_id, ctx.round_id,
                root, f"held by {count} of {n}" if majority else "no majority: the first member's")
    new = np.asarray(ctx.collective.broadcast(params if ctx.node_id == root else None, root=root,
                                              group=list(ctx.group), tag=f"{ctx.round_id}/final",
                                              timeout=ctx.timeout), np.float32)
    why, hint = "", "that member is faulty or hostile"
    if tuple(hash_chunks(vector_sha256(new))) != want:
        why = "sent final parameters that do not match the hash it reported"
    elif not majority and ctx.node_id != root:
        hint = "a member sent different updates to different peers, or a board computes far off"
        mine = np.asarray(params, np.float64)
        gap = float(np.linalg.norm(new.astype(np.float64) - mine))
        limit = sync_gap_limit(mine, start)
        if not gap <= limit:
            why = (f"has final parameters {gap:.3g} away from {ctx.node_id}'s, more than rounding "
                   f"explains ({limit:.3g}), and no majority backs either")
    if why:
        abort_peers(ctx, f"{ctx.round_id}/vote", f"final parameters refused: {root} {why}")
        raise RoundRefused(f"round {ctx.round_id}: {root} {why}", member=root, hint=hint)
    return new, True


def sync_gap_limit(mine: np.ndarray, start: np.ndarray) -> float:
    """How far (L2) another member's final parameters may lie from ``mine`` to be adopted without
    a majority: ``SYNC_GAP_OF_UPDATE`` x this round's own update + ``SYNC_GAP_OF_PARAMS`` x the
    parameters' norm (federation/bounds.py)."""
    mine = np.asarray(mine, np.float64)
    update = float(np.linalg.norm(mine - np.asarray(start, np.float64)))
    return SYNC_GAP_OF_UPDATE * update + SYNC_GAP_OF_PARAMS * float(np.linalg.norm(mine))


def check_update(new: np.ndarray, start: np.ndarray) -> str:
    """Why a member votes no on ``new`` (non-finite values, an update norm over
    ``UPDATE_NORM_FACTOR`` x the start norm), or "" when it may stage it."""
    if not np.isfinite(new).all():
        return f"{int(new.size - np.isfinite(new).sum())} non-finite parameter(s)"
    delta = float(np.linalg.norm((new - start).astype(np.float64)))
    limit = UPDATE_NORM_FACTOR * max(1.0, float(np.linalg.norm(np.asarray(start, np.float64))))
    if delta > limit:
        return f"update norm {delta:.3g} exceeds {limit:.3g}"
    return ""


def vote(ctx: RoundContext, yes: bool, why: str = "") -> None:
    """``{round_id}/vote``: a SUM-allreduce of one 1 per member that staged the result; returns
    only if every member voted yes, else raises RoundRefused naming who voted no (``why``: this
    member's reason, when it is one of them)."""
    vec = np.zeros(len(ctx.group), np.float32)
    vec[ctx.rank] = 1.0 if yes else 0.0
    # Always around the ring: PROTOCOL.md section 7's table of failures inside the vote is the
    # ring's (a member dying mid-vote leaves nobody with the result). On the direct path one
    # peer could already hold every vote: allowed by the protocol, but a wider split.
    out: Any = np.asarray(ctx.collective.allreduce(vec, group=list(ctx.group), tag=f"{ctx.round_id}/vote",
                                                   op="sum", timeout=ctx.timeout, algorithm="ring"))
    no = [ctx.group[i] for i in range(len(ctx.group)) if out[i] != 1.0]
    if no:
        mine = f" ({why})" if why else ""
        # Everyone voting no (e.g. the combined update diverged) names no one: the fleet leaves out
        # members their peers keep naming (api/fleet/rounds.py), so naming the first would blame it.
        raise RoundRefused(f"round {ctx.round_id} not committed: {', '.join(no)} voted no{mine}",
                           member=no[0] if len(no) < len(ctx.group) else None)
