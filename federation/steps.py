"""A round's steps (the phase between the hello and the agreement, federation/PROTOCOL.md
section 5): ``plan.steps`` synchronous steps of a member, each combined with the other members'
by the round's aggregator (:class:`~federation.phases.StepCombiner`).

- ``gradient``: sample a batch, ``loss_and_grad``, combine the flat gradients, ``apply``
  (Horovod-style synchronous SGD). Identical inputs to a deterministic optimizer keep the
  parameters bit-identical on every member.
- ``local-sgd``: ``local_steps`` local updates, then combine the parameter deltas; every member
  sets ``start + combined delta``.

A member without samples contributes zeros. A member told to abort fails the next step's
collective on purpose, so its peers stop now instead of at the step deadline. The training step
itself is the caller's (:class:`Learner`: a node's compiled training module).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from federation import phases
from federation.errors import RoundRefused
from federation.modes import SyncMode
from federation.phases import Members, RoundContext, RoundPlan, StepCombiner

__all__ = ["Learner", "SampleSet", "BatchSampler", "train_steps", "flatten", "unflatten"]


class Learner(Protocol):
    """Loss + gradients and the optimizer step at a fixed batch (``compiler.trainstep.Trainer``)."""

    @property
    def batch(self) -> int: ...

    def loss_and_grad(self, params: list[np.ndarray], x: Any,
                      y: np.ndarray) -> tuple[float, list[np.ndarray]]: ...

    def init_state(self, params: list[np.ndarray]) -> list[np.ndarray]: ...

    def apply(self, params: list[np.ndarray], grads: list[np.ndarray], state: list[np.ndarray],
              lr: float | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]: ...


class SampleSet(Protocol):
    """A member's training samples: inputs by name (N, ...) and labels (N, ...)."""

    @property
    def inputs(self) -> Mapping[str, np.ndarray]: ...

    @property
    def labels(self) -> np.ndarray: ...

    def __len__(self) -> int: ...


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate arrays into one float32 vector (parameter order)."""
    return np.concatenate([np.asarray(a, dtype=np.float32).ravel() for a in arrays]) if len(arrays) else \
        np.zeros(0, np.float32)


def unflatten(vec: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Split a flat float32 vector back into arrays shaped like ``like``."""
    out, off = [], 0
    for a in like:
        n = int(np.prod(a.shape, dtype=np.int64))
        out.append(np.asarray(vec[off:off + n], dtype=np.float32).reshape(a.shape).copy())
        off += n
    if off != vec.size:
        raise ValueError(f"vector has {vec.size} values, parameters need {off}")
    return out


class BatchSampler:
    """Epoch-style batches over a fixed snapshot: shuffle, walk, reshuffle (no replacement)."""

    def __init__(self, samples: SampleSet, batch: int, rng: np.random.Generator) -> None:
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


def train_steps(plan: RoundPlan, *, node_id: str, trainer: Learner, params: list[np.ndarray],
                samples: SampleSet, ring: Members, rng: np.random.Generator, contributors: list[bool],
                abort: threading.Event, on_step: Callable[[int, float], None] | None = None
                ) -> tuple[list[np.ndarray], list[float], dict[str, str]]:
    """``plan.steps`` synchronous steps from ``params``; returns (params, losses, the members
    excluded as outliers with the reason). ``contributors``: which members (in ring order) have
    samples (the others send zeros).

    Checks ``abort`` before every step (and local step): an aborted round stops within one step
    and tells its peers (RoundRefused). Deterministic for equal inputs (the swarm compares
    parameter hashes).
    """
    ctx = RoundContext.of(plan, ring, node_id)
    combiner = StepCombiner(ctx, plan, tuple(contributors))
    sampler = BatchSampler(samples, int(trainer.batch), rng) if len(samples) else None
    losses: list[float] = []
    state = trainer.init_state(params)
    for step in range(plan.steps):
        if abort.is_set():
            _abort_step(ctx, step)
            raise RoundRefused(f"round {plan.round_id} aborted")
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


def _abort_step(ctx: RoundContext, step: int) -> None:
    """Void the collective of ``step`` for every peer."""
    phases.abort_peers(ctx, f"{ctx.round_id}/{step}", "round aborted")


def _batch_xy(sampler: BatchSampler) -> tuple[np.ndarray, np.ndarray]:
    inputs, y = sampler.next()
    (x,) = inputs.values()  # training modules take one input tensor
    return x, y


_Step = tuple[float, list[np.ndarray], list[np.ndarray]]


def _gradient_step(plan: RoundPlan, trainer: Learner, params: list[np.ndarray], state: list[np.ndarray],
                   sampler: BatchSampler | None, combiner: StepCombiner, step: int) -> _Step:
    if sampler is not None:
        x, y = _batch_xy(sampler)
        loss, grads = trainer.loss_and_grad(params, x, y)
        flat = flatten(grads)
    else:
        loss, flat = float("nan"), np.zeros(sum(int(p.size) for p in params), np.float32)
    avg = combiner.combine(flat, step)
    params, state = trainer.apply(params, unflatten(avg, params), state, lr=plan.lr)
    return float(loss), [np.asarray(p, np.float32) for p in params], state


def _local_sgd_step(plan: RoundPlan, trainer: Learner, params: list[np.ndarray], state: list[np.ndarray],
                    sampler: BatchSampler | None, combiner: StepCombiner, step: int,
                    abort: threading.Event | None = None) -> _Step:
    start = flatten(params)
    losses = []
    if sampler is not None:
        for _ in range(plan.local_steps):
            if abort is not None and abort.is_set():  # an abort frees the node within one local step
                _abort_step(combiner.ctx, step)
                raise RoundRefused(f"round {plan.round_id} aborted")
            x, y = _batch_xy(sampler)
            loss, grads = trainer.loss_and_grad(params, x, y)
            params, state = trainer.apply(params, grads, state, lr=plan.lr)
            losses.append(float(loss))
    delta = flatten(params) - start
    avg = combiner.combine(delta, step)
    # start + avg is computed from bit-identical operands on every member -> identical params
    new = unflatten(start + avg, params)
    return (float(np.mean(losses)) if losses else float("nan")), new, state
