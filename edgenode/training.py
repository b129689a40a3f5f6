"""One training round on one node, in lock-step with the other participants: the sequence of
federation's phases (``federation/phases.py``, PROTOCOL.md sections 5-7) around this node's
parameters, trainer and samples.

:func:`run_round` reads top to bottom:

1. hello (``{round_id}/hello``): every member learns every member's version, parameter hash,
   parameter count and whether it has samples; the start parameters are those the fleet named
   in the signed command (``start_sha256``), else those a strict majority holds; a member whose
   hash differs gets them (``{round_id}/params``).
2. steps (``{round_id}/{step}``, :func:`train_steps`, here or in a worker process): ``gradient``
   (sample a batch, ``loss_and_grad``, combine the flat gradients, ``apply``: Horovod-style
   synchronous SGD) or ``local-sgd`` (``local_steps`` local updates, then combine the parameter
   deltas). The round's aggregator combines (``federation/aggregators``); a member without
   samples contributes zeros. A member told to abort fails the next step's collective on purpose,
   so its peers stop now instead of at the step deadline.
3. agree (``{round_id}/commit``): the final hashes are compared; differing boards adopt one
   member's parameters (``{round_id}/final``).
4. two-phase commit: every member checks the result (finite, update norm within
   ``bounds.UPDATE_NORM_FACTOR`` x the start norm), stages it durably (``params.npz.prepared``,
   fsynced) and votes (``{round_id}/vote``); only a unanimous yes renames the staged file over
   ``params.npz``, version = start version + 1. Any failure before the decision discards the
   staged file: nothing was applied anywhere. A member that dies after the decision restarts on
   its old parameters and is brought back by the next round's start-version rule.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgenode.common import RoundFailed, get_logger
from edgenode.faults import NO_FAULTS, Faults, Point
from edgenode.model import ModelHolder, ParamsSnapshot, flatten, unflatten
from edgenode.ports import Collective, StepRunner, Trainer
from edgenode.store import Samples
from federation import phases
from federation.bounds import OUTLIER_FACTOR_DEFAULT
from federation.errors import RoundAborted, RoundRefused
from federation.messages import Compression, RoundCommand, SyncMode
from federation.phases import MemberFacts, RoundContext, StepCombiner
from federation.robust import Aggregation
from federation.roundspec import RoundDefaults, resolve

__all__ = ["RoundPlan", "RoundResult", "BatchSampler", "run_round", "train_steps"]

log = get_logger("training")


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
    if node_id not in plan.group:
        raise RoundFailed(f"{node_id} is not a participant of round {plan.round_id}")
    abort = abort or threading.Event()
    rng = rng or np.random.default_rng([zlib.crc32(node_id.encode()), zlib.crc32(plan.round_id.encode())])
    ctx = RoundContext(ring, plan.round_id, node_id, plan.group, plan.step_timeout_s)
    start = model.snapshot
    try:
        if abort.is_set():
            raise RoundFailed(f"round {plan.round_id} aborted")
        # 1. hello: who holds what; the round starts from the fleet's (or a majority's) parameters
        n_params = sum(int(p.size) for p in start.params)
        met = phases.hello(ctx, MemberFacts(start.version, start.sha256, n_params, len(samples) > 0))
        root = phases.choose_start(met.hashes, plan.start_sha256)
        if len(met.n_params) != 1:
            raise RoundFailed("participants run models with different parameter counts")
        if not any(met.contributors):
            raise RoundFailed("no participant has training samples", hint="POST /v1/samples first")
        params = [np.array(p) for p in start.params]
        synced_from = None
        if len(set(met.hashes.values())) > 1:
            synced_from = root
            params = unflatten(phases.start_from(ctx, root, flatten(params)), params)
            ring.reset_feedback()  # residuals belong to the parameters we just replaced
            log.info("%s: round %s starts from %s's parameters", node_id, plan.round_id, synced_from)
        start_flat = flatten(params)
        # 2. steps: here, or in a worker process (edgenode.trainproc) that runs train_steps too
        contributors = list(met.contributors)
        if steps is None:
            params, losses, excluded = train_steps(plan, node_id=node_id, trainer=trainer, params=params,
                                                   samples=samples, ring=ring, rng=rng,
                                                   contributors=contributors, abort=abort, on_step=on_step)
        else:
            params, losses, excluded = steps.run_steps(plan, node_id=node_id, params=params, samples=samples,
                                                       rng=rng, contributors=contributors, abort=abort,
                                                       on_step=on_step)
        if abort.is_set():
            phases.abort_peers(ctx, f"{plan.round_id}/commit", "round aborted")
            raise RoundFailed(f"round {plan.round_id} aborted")
        # 3. agree: nobody commits unless everybody got through the last step, and everybody
        # commits the same bits
        final, final_sync = phases.agree(ctx, flatten(params), start_flat)
        # 4. check, stage and vote
        prepared = _stage_and_vote(ctx, model, unflatten(final, params), start_flat, met.versions[root] + 1,
                                   faults)
    except RoundFailed:
        raise
    except RoundRefused as exc:  # a phase's verdict, as it stands
        raise RoundFailed(str(exc), member=exc.member, hint=exc.hint) from exc
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
    """Phase 2: ``plan.steps`` synchronous steps from ``params``; returns (params, losses, the
    members excluded as outliers with the reason). ``contributors``: which members (in ring order)
    have samples (the others send zeros).

    Checks ``abort`` before every step (and local step): an aborted round stops within one step
    and tells its peers. Deterministic for equal inputs (the swarm compares parameter hashes).
    """
    ctx = RoundContext(ring, plan.round_id, node_id, plan.group, plan.step_timeout_s)
    combiner = StepCombiner(ctx, plan, tuple(contributors))
    sampler = BatchSampler(samples, int(trainer.batch), rng) if len(samples) else None
    losses: list[float] = []
    state = trainer.init_state(params)
    for step in range(plan.steps):
        if abort.is_set():
            _abort_step(ctx, step)
            raise RoundFailed(f"round {plan.round_id} aborted")
        try:
            if plan.sync == SyncMode.GRADIENT:
                loss, params, state = _gradient_step(plan, trainer, params, state, sampler, combiner, step)
            else:
                loss, params, state = _local_sgd_step(plan, trainer, params, state, sampler, combiner,
                                                      step, abort)
        except Exception:
            if abort.is_set():  # cancelled mid-step: peers already in the next step learn it too
                _abort_step(ctx, step)
                _abort_step(ctx, step + 1)
            raise
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return params, losses, combiner.named()


def _stage_and_vote(ctx: RoundContext, model: ModelHolder, params: list[np.ndarray], start_flat: np.ndarray,
                    version: int, faults: Faults = NO_FAULTS) -> ParamsSnapshot:
    """The commit's first phase: check and durably stage ``params``, then vote; returns the staged
    parameters only if every member voted yes (else the staged file is discarded and the vote's
    RoundRefused raised)."""
    prepared: ParamsSnapshot | None = None
    try:
        why = phases.check_update(flatten(params), start_flat)
        if not why:
            faults.at(Point.PREPARE, ctx.round_id)
            prepared = model.prepare(params, version)
    except Exception as exc:  # noqa: BLE001 - e.g. a full or read-only disk: vote no, say why
        why = f"cannot stage the new parameters: {exc}"
    if prepared is not None:
        faults.at(Point.VOTE, ctx.round_id)
    try:
        phases.vote(ctx, prepared is not None, why)
    except Exception:
        if prepared is not None:
            model.discard(prepared)
        raise
    assert prepared is not None  # a unanimous yes includes this member's
    return prepared


def _abort_step(ctx: RoundContext, step: int) -> None:
    """Void the collective of ``step`` for every peer."""
    phases.abort_peers(ctx, f"{ctx.round_id}/{step}", "round aborted")


def _batch_xy(trainer: Trainer, sampler: BatchSampler) -> tuple[np.ndarray, np.ndarray]:
    inputs, y = sampler.next()
    (x,) = inputs.values()  # training modules take one input tensor
    return x, y


_Step = tuple[float, list[np.ndarray], list[np.ndarray]]


def _gradient_step(plan: RoundPlan, trainer: Trainer, params: list[np.ndarray], state: list[np.ndarray],
                   sampler: BatchSampler | None, combiner: StepCombiner, step: int) -> _Step:
    if sampler is not None:
        x, y = _batch_xy(trainer, sampler)
        loss, grads = trainer.loss_and_grad(params, x, y)
        flat = flatten(grads)
    else:
        loss, flat = float("nan"), np.zeros(sum(int(p.size) for p in params), np.float32)
    avg = combiner.combine(flat, step)
    params, state = trainer.apply(params, unflatten(avg, params), state, lr=plan.lr)
    return float(loss), [np.asarray(p, np.float32) for p in params], state


def _local_sgd_step(plan: RoundPlan, trainer: Trainer, params: list[np.ndarray], state: list[np.ndarray],
                    sampler: BatchSampler | None, combiner: StepCombiner, step: int,
                    abort: threading.Event | None = None) -> _Step:
    start = flatten(params)
    losses = []
    if sampler is not None:
        for _ in range(plan.local_steps):
            if abort is not None and abort.is_set():  # an abort frees the node within one local step
                _abort_step(combiner.ctx, step)
                raise RoundFailed(f"round {plan.round_id} aborted")
            x, y = _batch_xy(trainer, sampler)
            loss, grads = trainer.loss_and_grad(params, x, y)
            params, state = trainer.apply(params, grads, state, lr=plan.lr)
            losses.append(float(loss))
    delta = flatten(params) - start
    avg = combiner.combine(delta, step)
    # start + avg is computed from bit-identical operands on every member -> identical params
    new = unflatten(start + avg, params)
    return (float(np.mean(losses)) if losses else float("nan")), new, state
