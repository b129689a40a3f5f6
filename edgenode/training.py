"""One training round on one node, in lock-step with the other participants.

Phases (every collective uses a tag unique to the round, so late frames of an old round are
never mixed into a new one):

1. ``{round_id}/hello``: a SUM-allreduce in which each member fills only its own slot with
   (model_version, 64 bits of params_sha256 as four exact 16-bit floats, parameter count,
   has-samples). Afterwards every member knows the same facts about every other member.
2. ``{round_id}/params``: only if the hashes differ, one holder of the start parameters
   broadcasts them and everyone continues from them. The start parameters are those the fleet
   named in the signed command (``start_sha256``), else those a strict majority holds; never
   the highest version claimed (a rogue member could claim any). No decision: the round fails.
3. Steps ``{round_id}/{step}``:
   - ``gradient``: sample a batch, ``loss_and_grad``, allreduce(mean) of the flat gradient,
     ``apply`` -- Horovod-style synchronous SGD. Identical inputs to a deterministic optimizer
     keep the parameters bit-identical on every member.
   - ``local-sgd``: ``local_steps`` local updates, then allreduce(mean) of the parameter delta;
     every member sets ``start + mean_delta``.
   A member without samples contributes zeros; the mean is rescaled by n/k (k = members with
   samples, known to all from the hello), so it does not dilute the others.
   A member told to abort (RoundAbort) fails the next step's collective on purpose, so the
   session layer sends ABORT frames and its peers stop now instead of at the step deadline.
4. ``{round_id}/commit``: a SUM-allreduce of every member's final params hash (barrier and
   agreement check in one). If the hashes differ (boards whose float code rounds differently),
   ``{round_id}/final`` broadcasts the first member's parameters.
5. Two-phase commit. **Prepare**: every member checks the final parameters (all finite, update
   norm within ``bounds.UPDATE_NORM_FACTOR`` x the start norm) and writes them durably next to
   the current ones (``params.npz.prepared``, fsynced). **Vote** (``{round_id}/vote``, a
   SUM-allreduce of one 1 per member that prepared, 0 otherwise): the decision is "commit" iff
   the sum is n. Then each member renames the prepared file over ``params.npz`` and swaps its
   parameters, version = start version + 1. Any failure before the decision (a timeout, a no
   vote, a write error) discards the prepared file: nothing was applied anywhere. A member that
   dies after the decision restarts on its old parameters (a leftover prepared file is
   discarded at start) and is brought back by the next round's start-version rule.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edgenode.common import RoundFailed, get_logger
from edgenode.faults import NO_FAULTS, Faults, Point
from edgenode.model import ModelHolder, ParamsSnapshot, flatten, unflatten
from edgenode.ports import Collective, StepRunner, Trainer
from edgenode.store import Samples
from federation.aggregators import Step, aggregator_for
from federation.errors import AllExcluded, RoundAborted
from federation.limits import (
    OUTLIER_FACTOR_DEFAULT,
    SYNC_GAP_OF_PARAMS,
    SYNC_GAP_OF_UPDATE,
    UPDATE_NORM_FACTOR,
)
from federation.modes import Compression, SyncMode
from federation.robust import Aggregation

if TYPE_CHECKING:  # the node's side only: the worker's train_steps never loads the message models
    from federation.messages import RoundCommand
    from federation.roundspec import RoundDefaults

__all__ = ["RoundPlan", "RoundResult", "BatchSampler", "run_round", "train_steps", "choose_start"]

log = get_logger("training")
_SLOT = 7  # hello values per member: version, 4 x 16-bit hash chunks, n_params mod 2^24, has_samples


@dataclass(frozen=True)
class RoundPlan:
    """A RoundCommand resolved against the node's defaults."""

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
        """The command's settings, those it leaves null or out taken from the node's ``[training]``
        table (``federation.roundspec.resolve``); an unset ``lr`` everywhere means the artifact's
        compiled rate."""
        from federation.roundspec import resolve

        r = resolve(cmd, defaults)
        return cls(round_id=cmd.round_id, steps=r.steps, lr=r.lr, sync=r.sync, local_steps=r.local_steps,
                   group=tuple(sorted(set(cmd.participants))), compression=r.compression,
                   step_timeout_s=r.step_timeout_s, start_sha256=cmd.start_sha256,
                   aggregation=r.aggregation, outlier_factor=r.outlier_factor)


@dataclass
class RoundResult:
    round_id: str
    version: int
    sha256: str
    losses: list[float] = field(default_factory=list)
    synced_from: str | None = None  # root of the pre-round parameter broadcast, if one happened
    seconds: float = 0.0
    final_sync: bool = False  # members ended with different bits and adopted the first member's
    excluded: dict[str, str] = field(default_factory=dict)  # member -> why (first excluded step)


class BatchSampler:
    """Epoch-style batches over a fixed snapshot: shuffle, walk, reshuffle (no replacement)."""

    def __init__(self, samples: Samples, batch: int, rng: np.random.Generator) -> None:
        self.samples, self.batch, self.rng = samples, batch, rng
        self._order = np.zeros(0, np.int64)
        self._pos = 0

    def next(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        n = len(self.samples)
        if n < self.batch:  # too few samples for one batch: draw with replacement
            idx = self.rng.integers(0, n, self.batch)
        else:
            if self._pos + self.batch > self._order.size:
                self._order, self._pos = self.rng.permutation(n), 0
            idx = self._order[self._pos:self._pos + self.batch]
            self._pos += self.batch
        return {k: v[idx] for k, v in self.samples.inputs.items()}, self.samples.labels[idx]


def choose_start(hashes: dict[str, tuple[int, ...]], start_sha256: str | None) -> str:
    """The member whose parameters the round starts from (the first in ring order among the
    holders of the start parameters): those named by the fleet, else a strict majority's.
    Raises RoundFailed when nobody holds the named parameters or there is no majority."""
    if start_sha256:
        want = tuple(int(c) for c in _hash_chunks(start_sha256))
        holders = [m for m in sorted(hashes) if hashes[m] == want]
        if not holders:
            raise RoundFailed(f"no participant holds the start parameters {start_sha256[:12]} named by "
                              "the fleet", hint="include a node that holds them")
        return holders[0]
    counts: dict[tuple[int, ...], list[str]] = {}
    for m in sorted(hashes):
        counts.setdefault(hashes[m], []).append(m)
    best = max(counts.values(), key=len)
    if 2 * len(best) <= len(hashes):
        raise RoundFailed("participants hold different parameters and none has a majority",
                          hint="start the round from the fleet, which names the start parameters")
    return best[0]


def _hash_chunks(sha: str) -> list[float]:
    return [float(int(sha[i * 4:(i + 1) * 4], 16)) for i in range(4)]  # each < 2^16: exact in float32


def run_round(plan: RoundPlan, *, node_id: str, model: ModelHolder, trainer: Trainer, samples: Samples,
              ring: Collective, rng: np.random.Generator | None = None, abort: threading.Event | None = None,
              on_step: Callable[[int, float], None] | None = None, faults: Faults = NO_FAULTS,
              steps: StepRunner | None = None) -> RoundResult:
    """Run ``plan`` as member ``node_id``; commits to ``model`` only if every phase succeeded.

    The steps (phase 3) run on this thread with ``trainer`` and ``ring`` (:func:`train_steps`),
    or in ``steps`` when given (a worker process that runs the same function).

    Raises :class:`RoundFailed` (nothing applied) on a dead member, deadline, abort, or bad data.
    """
    t0 = time.monotonic()
    group = list(plan.group)
    if node_id not in group:
        raise RoundFailed(f"{node_id} is not a participant of round {plan.round_id}")
    abort = abort or threading.Event()
    rng = rng or np.random.default_rng([zlib.crc32(node_id.encode()), zlib.crc32(plan.round_id.encode())])
    start = model.snapshot
    try:
        if abort.is_set():
            raise RoundFailed(f"round {plan.round_id} aborted")
        facts = _hello(plan, node_id, group, start, len(samples) > 0, ring)
        versions = {m: int(f[0]) for m, f in facts.items()}
        hashes = {m: tuple(int(v) for v in f[1:5]) for m, f in facts.items()}
        root = choose_start(hashes, plan.start_sha256)
        if len({int(f[5]) for f in facts.values()}) != 1:
            raise RoundFailed("participants run models with different parameter counts")
        contributors = sum(int(f[6]) for f in facts.values())
        if contributors == 0:
            raise RoundFailed("no participant has training samples", hint="POST /v1/samples first")
        params = [np.array(p) for p in start.params]
        synced_from = None
        if len(set(hashes.values())) > 1:
            synced_from = root
            mine = flatten(params) if synced_from == node_id else None
            vec = ring.broadcast(mine, root=synced_from, group=group, tag=f"{plan.round_id}/params",
                                 timeout=plan.step_timeout_s)
            params = unflatten(np.asarray(vec, np.float32), params)
            ring.reset_feedback()  # residuals belong to the parameters we just replaced
            log.info("%s: round %s starts from %s's parameters", node_id, plan.round_id, synced_from)
        start_flat = flatten(params)
        contributing = [bool(int(facts[m][6])) for m in group]  # members with samples
        if steps is None:
            params, losses, excluded = train_steps(plan, node_id=node_id, trainer=trainer, params=params,
                                                   samples=samples, ring=ring, rng=rng,
                                                   contributors=contributing, abort=abort, on_step=on_step)
        else:  # e.g. edgenode.trainproc.TrainingWorker: the same loop, in a worker process
            params, losses, excluded = steps.run_steps(plan, node_id=node_id, params=params, samples=samples,
                                                       rng=rng, contributors=contributing, abort=abort,
                                                       on_step=on_step)
        if abort.is_set():
            _abort_peers(ring, f"{plan.round_id}/commit", group, node_id, "round aborted")
            raise RoundFailed(f"round {plan.round_id} aborted")
        # Barrier + agreement check: nobody commits unless everybody got through the last step,
        # and everybody commits the same bits (see _agree).
        params, final_sync = _agree(plan, node_id, group, params, ring, start_flat)
        prepared = _prepare_and_vote(plan, node_id, group, model, params, start_flat,
                                     versions[root] + 1, ring, faults)
    except RoundFailed:
        raise
    except Exception as exc:  # RoundAborted, TransportError, trainer errors: the round is void
        member = exc.member if isinstance(exc, RoundAborted) else None
        raise RoundFailed(f"round {plan.round_id} failed: {exc}", member=member) from exc
    # Decided: commit. A failure from here on is the protocol's "failure after the decision": the
    # others commit, this member keeps its old parameters (its staged file is dropped) and the next
    # round's start-version rule brings it onto the committed ones.
    try:
        faults.at(Point.DECIDED, plan.round_id)
        snap = model.commit_prepared(prepared)
    except OSError as exc:
        model.discard(prepared)
        raise RoundFailed(f"round {plan.round_id} was committed by the swarm but not by {node_id}: {exc}",
                          member=node_id, hint="the next round brings this node onto the committed "
                                               "parameters") from exc
    faults.at(Point.COMMITTED, plan.round_id)
    return RoundResult(plan.round_id, snap.version, snap.sha256, losses, synced_from, time.monotonic() - t0,
                       final_sync, excluded)


def train_steps(plan: RoundPlan, *, node_id: str, trainer: Trainer, params: list[np.ndarray],
                samples: Samples, ring: Collective, rng: np.random.Generator, contributors: list[bool],
                abort: threading.Event, on_step: Callable[[int, float], None] | None = None
                ) -> tuple[list[np.ndarray], list[float], dict[str, str]]:
    """Phase 3: ``plan.steps`` synchronous steps from ``params``; returns (params, losses, the
    members excluded as outliers with the reason). ``contributors``: which members (in ring order)
    have samples (the others send zeros).

    Checks ``abort`` before every step (and local step): an aborted round stops within one step
    and tells its peers. Deterministic for equal inputs (the swarm compares parameter hashes).
    """
    group = list(plan.group)
    reducer = _Combiner(plan, node_id, group, ring, contributors)
    sampler = BatchSampler(samples, int(trainer.batch), rng) if len(samples) else None
    losses: list[float] = []
    state = trainer.init_state(params)
    for step in range(plan.steps):
        if abort.is_set():
            _abort_step(ring, plan.round_id, step, group, node_id)
            raise RoundFailed(f"round {plan.round_id} aborted")
        try:
            if plan.sync == SyncMode.GRADIENT:
                loss, params, state = _gradient_step(plan, trainer, params, state, sampler, reducer, step)
            else:
                loss, params, state = _local_sgd_step(plan, trainer, params, state, sampler, reducer,
                                                      step, abort)
        except Exception:
            if abort.is_set():  # cancelled mid-step: peers already in the next step learn it too
                _abort_step(ring, plan.round_id, step, group, node_id)
                _abort_step(ring, plan.round_id, step + 1, group, node_id)
            raise
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return params, losses, reducer.named()


def _prepare_and_vote(plan: RoundPlan, node_id: str, group: list[str], model: ModelHolder,
                      params: list[np.ndarray], start_flat: np.ndarray, version: int, ring: Any,
                      faults: Faults = NO_FAULTS) -> Any:
    """Phase 1 of the commit: check and durably stage ``params``, then vote; returns the
    prepared state only if every member voted yes (else RoundFailed, the staged file discarded)."""
    prepared, why = None, ""
    try:
        new = flatten(params)
        if not np.isfinite(new).all():
            why = f"{int(new.size - np.isfinite(new).sum())} non-finite parameter(s)"
        else:
            delta = float(np.linalg.norm((new - start_flat).astype(np.float64)))
            limit = UPDATE_NORM_FACTOR * max(1.0, float(np.linalg.norm(start_flat.astype(np.float64))))
            if delta > limit:
                why = f"update norm {delta:.3g} exceeds {limit:.3g}"
            else:
                faults.at(Point.PREPARE, plan.round_id)
                prepared = model.prepare(params, version)
    except Exception as exc:  # noqa: BLE001 - e.g. a full or read-only disk: vote no, say why
        why = f"cannot stage the new parameters: {exc}"
    if prepared is not None:
        faults.at(Point.VOTE, plan.round_id)
    k = group.index(node_id)
    vote = np.zeros(len(group), np.float32)
    vote[k] = 1.0 if prepared is not None else 0.0
    try:
        # Always around the ring: PROTOCOL.md section 7's table of failures inside the vote is the
        # ring's (a member dying mid-vote leaves nobody with the result). On the direct path one
        # peer could already hold every vote: allowed by the protocol, but a wider split.
        out = np.asarray(ring.allreduce(vote, group=group, tag=f"{plan.round_id}/vote", op="sum",
                                        timeout=plan.step_timeout_s, algorithm="ring"))
    except Exception:
        if prepared is not None:
            model.discard(prepared)
        raise
    no = [group[i] for i in range(len(group)) if out[i] != 1.0]
    if no:
        if prepared is not None:
            model.discard(prepared)
        mine = f" ({why})" if why else ""
        # Everyone voting no (e.g. the combined update diverged) names no one: the fleet leaves out
        # members their peers keep naming (api/fleet/rounds.py), so naming the first would blame it.
        raise RoundFailed(f"round {plan.round_id} not committed: {', '.join(no)} voted no{mine}",
                          member=no[0] if len(no) < len(group) else None)
    return prepared


def _abort_step(ring: Collective, round_id: str, step: int, group: list[str], node_id: str) -> None:
    """Void the collective of ``step`` for every peer."""
    _abort_peers(ring, f"{round_id}/{step}", group, node_id, "round aborted")


def _abort_peers(ring: Collective, tag: str, group: list[str], node_id: str, reason: str) -> None:
    """Void the collective ``tag`` for every peer, so members blocked in (or about to start)
    that step stop now instead of at the deadline."""
    ring.abort(tag, [m for m in group if m != node_id], reason)


def _agree(plan: RoundPlan, node_id: str, group: list[str], params: list[np.ndarray],
           ring: Collective, start_flat: np.ndarray) -> tuple[list[np.ndarray], bool]:
    """Exchange 64 bits of every member's final params_sha256 (exact SUM-allreduce, one slot each).

    Identical inputs give identical bits only if every member runs the same optimizer code on
    the same CPU semantics. A swarm may mix boards (an aarch64 build may fuse multiply-adds where
    x86-64 rounds twice), so if any hash differs one member broadcasts its parameters and everyone
    commits those: the swarm always agrees on ``params_sha256``. Which member: the first holder of
    the hash a strict majority reports (so a lone member reporting another hash imposes nothing),
    else the first member in ring order, whose parameters every other member then accepts only
    within :func:`sync_gap_limit` of its own (rounding drift, not a different model: a member
    that split everyone's view, e.g. by sending different rows to different peers, cannot use
    the missing majority to impose its parameters). What arrives must hash to what its root
    reported. Otherwise the round fails naming the root (its peers' vote is voided at once).
    """
    from edgenode.common import params_sha256

    n, k = len(group), group.index(node_id)
    vec = np.zeros(n * 4, np.float32)
    vec[k * 4:(k + 1) * 4] = _hash_chunks(params_sha256(params))
    out = np.asarray(ring.allreduce(vec, group=group, tag=f"{plan.round_id}/commit", op="sum",
                                    timeout=plan.step_timeout_s))
    hashes = [tuple(float(v) for v in out[i * 4:(i + 1) * 4]) for i in range(n)]
    if len(set(hashes)) == 1:
        return params, False
    best, count = Counter(hashes).most_common(1)[0]
    majority = 2 * count > n
    root = group[hashes.index(best)] if majority else group[0]
    want = hashes[group.index(root)]
    log.warning("%s: round %s ended with differing parameters; adopting %s's (%s)", node_id, plan.round_id,
                root, f"held by {count} of {n}" if majority else "no majority: the first member's")
    vec = ring.broadcast(flatten(params) if node_id == root else None, root=root, group=group,
                         tag=f"{plan.round_id}/final", timeout=plan.step_timeout_s)
    new = unflatten(np.asarray(vec, np.float32), params)
    why, hint = "", "that member is faulty or hostile"
    if tuple(_hash_chunks(params_sha256(new))) != want:
        why = "sent final parameters that do not match the hash it reported"
    elif not majority and node_id != root:
        hint = "a member sent different updates to different peers, or a board computes far off"
        mine = flatten(params).astype(np.float64)
        gap = float(np.linalg.norm(np.asarray(vec, np.float64) - mine))
        limit = sync_gap_limit(mine, start_flat)
        if not gap <= limit:
            why = (f"has final parameters {gap:.3g} away from {node_id}'s, more than rounding "
                   f"explains ({limit:.3g}), and no majority backs either")
    if why:
        _abort_peers(ring, f"{plan.round_id}/vote", group, node_id, f"final parameters refused: {root} {why}")
        raise RoundFailed(f"round {plan.round_id}: {root} {why}", member=root, hint=hint)
    return new, True


def sync_gap_limit(mine: np.ndarray, start: np.ndarray) -> float:
    """How far (L2) another member's final parameters may lie from ``mine`` to be adopted without
    a majority: ``SYNC_GAP_OF_UPDATE`` x this round's own update + ``SYNC_GAP_OF_PARAMS`` x the
    parameters' norm (federation/bounds.py)."""
    mine = np.asarray(mine, np.float64)
    update = float(np.linalg.norm(mine - np.asarray(start, np.float64)))
    return SYNC_GAP_OF_UPDATE * update + SYNC_GAP_OF_PARAMS * float(np.linalg.norm(mine))


def _hello(plan: RoundPlan, node_id: str, group: list[str], snap: ParamsSnapshot, has_samples: bool,
           ring: Collective) -> dict[str, list[float]]:
    n_params = sum(int(p.size) for p in snap.params)
    vec = np.zeros(len(group) * _SLOT, np.float32)
    i = group.index(node_id) * _SLOT
    vec[i:i + _SLOT] = [snap.version, *_hash_chunks(snap.sha256), n_params % (1 << 24), float(has_samples)]
    # Integers below 2^24 sum exactly in float32 and only one member is non-zero per slot.
    out = ring.allreduce(vec, group=group, tag=f"{plan.round_id}/hello", op="sum",
                         timeout=plan.step_timeout_s)
    out = np.asarray(out)
    return {m: out[k * _SLOT:(k + 1) * _SLOT].tolist() for k, m in enumerate(group)}


def _batch_xy(trainer: Trainer, sampler: BatchSampler) -> tuple[np.ndarray, np.ndarray]:
    inputs, y = sampler.next()
    (x,) = inputs.values()  # training modules take one input tensor
    return x, y


_Step = tuple[float, list[np.ndarray], list[np.ndarray]]


def _gradient_step(plan: RoundPlan, trainer: Trainer, params: list[np.ndarray], state: list[np.ndarray],
                   sampler: BatchSampler | None, reducer: _Combiner, step: int) -> _Step:
    if sampler is not None:
        x, y = _batch_xy(trainer, sampler)
        loss, grads = trainer.loss_and_grad(params, x, y)
        flat = flatten(grads)
    else:
        loss, flat = float("nan"), np.zeros(sum(int(p.size) for p in params), np.float32)
    avg = reducer.reduce(flat, step)
    params, state = trainer.apply(params, unflatten(avg, params), state, lr=plan.lr)
    return float(loss), [np.asarray(p, np.float32) for p in params], state


def _local_sgd_step(plan: RoundPlan, trainer: Trainer, params: list[np.ndarray], state: list[np.ndarray],
                    sampler: BatchSampler | None, reducer: _Combiner, step: int,
                    abort: threading.Event | None = None) -> _Step:
    start = flatten(params)
    losses = []
    if sampler is not None:
        for _ in range(plan.local_steps):
            if abort is not None and abort.is_set():  # an abort frees the node within one local step
                _abort_step(reducer.ring, plan.round_id, step, reducer.group, reducer.node_id)
                raise RoundFailed(f"round {plan.round_id} aborted")
            x, y = _batch_xy(trainer, sampler)
            loss, grads = trainer.loss_and_grad(params, x, y)
            params, state = trainer.apply(params, grads, state, lr=plan.lr)
            losses.append(float(loss))
    delta = flatten(params) - start
    avg = reducer.reduce(delta, step)
    # start + avg is computed from bit-identical operands on every member -> identical params
    new = unflatten(start + avg, params)
    return (float(np.mean(losses)) if losses else float("nan")), new, state


class _Combiner:
    """This round's aggregator (``federation.aggregators``, picked by the round's settings) applied
    step after step; ``excluded`` collects who was left out (and why) over the round.

    A member left out by the direction check alone is named only when that happened in at least
    half of the round's steps (:meth:`named`): an honest member on skewed data can look like a
    flipped one now and then (PROTOCOL.md section 7.1), an insider does so step after step. Its
    update is left out of those steps either way."""

    def __init__(self, plan: RoundPlan, node_id: str, group: list[str], ring: Collective,
                 contributors: list[bool]) -> None:
        self.plan, self.node_id, self.group, self.ring = plan, node_id, group, ring
        self.contributors = tuple(contributors)  # members with samples (the others send zeros)
        self.aggregator = aggregator_for(plan)
        self.excluded: dict[str, str] = {}
        self.opposed: dict[str, tuple[int, str]] = {}  # member -> (steps, first reason)
        self.steps = 0

    def reduce(self, update: np.ndarray, step: int) -> np.ndarray:
        p = self.plan
        at = Step(self.ring, self.node_id, tuple(self.group), self.contributors, p.round_id, step,
                  p.step_timeout_s, p.compression, p.outlier_factor)
        try:
            out = self.aggregator.combine(at, np.asarray(update, np.float32))
        except AllExcluded as exc:
            raise RoundFailed(str(exc)) from exc
        self.steps += 1
        for m, why in out.excluded.items():
            if m not in self.excluded and m not in self.opposed:
                log.warning("%s: round %s step %d: excluding %s's update (%s)", self.node_id, p.round_id,
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
