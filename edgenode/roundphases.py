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

from edgenode.common import get_logger
from edgenode.errors import RoundFailed
from edgenode.faults import NO_FAULTS, Faults, Point
from edgenode.model import ModelHolder, ParamsSnapshot
from edgenode.ports import Collective, StepRunner, Trainer
from edgenode.store import Samples
from federation import phases
from federation.errors import RoundAborted, RoundRefused
from federation.phases import MemberFacts, RoundContext, RoundPlan
from federation.steps import flatten, train_steps, unflatten

__all__ = ["RoundResult", "run_round"]

log = get_logger("training")


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
    ctx = RoundContext.of(plan, ring, node_id)
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
        # 2. steps (federation/steps.py): here, or in a worker process (edgenode.trainworker) that
        # runs the same train_steps
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
