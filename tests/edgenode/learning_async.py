"""Asynchronous (FedBuff) versus synchronous rounds on the learning-quality split, with stragglers.

The sklearn digits split of :mod:`tests.edgenode.learning` (4 members, non-IID, 90% of a class on
its home member) and its compiled ``digits-mlp``. Every member trains ``local_steps`` SGD steps of
the compiled training module per update; members differ in speed (``SPEEDS``: the duration of one
local step, relative to the fastest) to simulate stragglers. Time is a simulated clock in units of
one measured local step of the compiled model, kept in integers (so the order of events, hence
every figure but the seconds, is the same on any machine and under any load); the training itself
is real.

* ``sync``: synchronous rounds as the ring's ``local-sgd`` mode runs them: every member trains
  from the same parameters, the sample-weighted mean of the members' parameters is the next
  version; a round lasts as long as its slowest member.
* ``async``: each member, as soon as it is done, takes the newest version, trains, and sends its
  update to the real :class:`federation.asyncbuf.Buffer` (encoded, admitted, aggregated as the
  aggregator does it); ``buffer`` updates make a version, older than ``max_staleness`` are refused.

Run: ``PYTHONPATH=$PWD TVM_NUM_THREADS=1 .venv/bin/python -m tests.edgenode.learning_async ARTIFACT_DIR``
(BENCHMARKS.md "asynchronous rounds").
"""

from __future__ import annotations

import heapq
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from federation.asyncagg import initial_version
from federation.asyncbuf import Buffer, Refused, Update, encode_update
from tests.edgenode.learning import N_NODES, accuracy, load_split, non_iid_shards

SPEEDS = (1, 1, 2, 5)  # local steps' duration per member: member 3 is 5x slower than members 0 and 1
# The "intermittent" scenario: equal speeds, member k online in [off_k, off_k + W) of every period P
# (each one 5/8 of the time; all four together 1/4 of the time).
INTERMITTENT = {"speeds": (1, 1, 1, 1), "period": 200, "window": 125, "offsets": (0, 25, 50, 75)}


@dataclass(frozen=True)
class Scenario:
    speeds: tuple[int, ...]
    period: int = 0  # 0: always online
    window: int = 0
    offsets: tuple[int, ...] = (0, 0, 0, 0)

    def _phase(self, k: int, t: int) -> int:
        return (t - self.offsets[k]) % self.period

    def finish(self, k: int, start: int, work: int) -> int:
        """When member ``k``, starting at ``start``, has done ``work`` units (it computes only online)."""
        if not self.period:
            return start + work
        t = start
        while work > 0:
            phase = self._phase(k, t)
            if phase >= self.window:
                t += self.period - phase
                continue
            run = min(work, self.window - phase)
            t, work = t + run, work - run
        return t

    def all_online_for(self, t: int, span: int) -> bool:
        last = self.window - span  # the latest phase a span of work can start at and end online
        return not self.period or all(self._phase(k, t) <= last for k in range(len(self.speeds)))


@dataclass
class Result:
    mode: str
    versions: int
    updates: int
    refused: int
    acc: float
    sim_s: float
    to_90_s: float | None  # simulated seconds until test accuracy first reached 90%


class Flat:
    """Flattens the model's parameter list to one float32 vector and back."""

    def __init__(self, params: list[np.ndarray]) -> None:
        self.shapes = [np.shape(p) for p in params]
        self.sizes = [int(np.prod(s)) for s in self.shapes]

    def flat(self, params: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(p, np.float32).ravel() for p in params])

    def unflat(self, v: np.ndarray) -> list[np.ndarray]:
        out, a = [], 0
        for s, n in zip(self.shapes, self.sizes, strict=True):
            out.append(np.array(v[a:a + n], np.float32).reshape(s))
            a += n
        return out


def local_train(tr: Any, params: list[np.ndarray], x: np.ndarray, y: np.ndarray, steps: int, lr: float,
                rng: np.random.Generator) -> list[np.ndarray]:
    state = tr.init_state(params)
    for _ in range(steps):
        idx = rng.choice(len(y), tr.batch, replace=len(y) < tr.batch)
        _, g = tr.loss_and_grad(params, x[idx], y[idx])
        params, state = tr.apply(params, g, state, lr=lr)
    return params


def run_sync(art, data, *, budget: int, local_steps: int, lr: float, step_s: float,
             seed: int = 0, scn: Scenario = Scenario(SPEEDS)) -> Result:
    xtr, xte, ytr, yte, shards = data
    flat = Flat(art.params)
    g = flat.flat(art.params)
    rngs = [np.random.default_rng(seed * 1000 + 100 + k) for k in range(N_NODES)]
    w = np.array([len(s) for s in shards], np.float64)
    t, rounds, to90 = 0, 0, None
    round_t = max(scn.speeds) * local_steps
    while True:
        while not scn.all_online_for(t, round_t):  # a round needs every member online throughout
            t += 1
        if t + round_t > budget:
            break
        trained = [flat.flat(local_train(art.trainer, flat.unflat(g), xtr[s], ytr[s], local_steps, lr,
                                         rngs[k])) for k, s in enumerate(shards)]
        g = (np.tensordot(w, np.stack(trained).astype(np.float64), 1) / w.sum()).astype(np.float32)
        t += round_t
        rounds += 1
        if to90 is None and accuracy(art, flat.unflat(g), xte, yte) >= 0.9:
            to90 = t * step_s
    acc = accuracy(art, flat.unflat(g), xte, yte)
    return Result("sync (local-sgd ring)", rounds, rounds * N_NODES, 0, acc, t * step_s, to90)


def run_async(art, data, *, budget: int, local_steps: int, lr: float, step_s: float, buffer: int,
              max_staleness: int, seed: int = 0, scn: Scenario = Scenario(SPEEDS)) -> Result:
    xtr, xte, ytr, yte, shards = data
    flat = Flat(art.params)
    buf = Buffer(initial_version(flat.flat(art.params)), buffer=buffer, max_staleness=max_staleness)
    rngs = [np.random.default_rng(seed * 1000 + 100 + k) for k in range(N_NODES)]
    # (time the member finishes, member, the version it trained from)
    events = [(scn.finish(k, 0, scn.speeds[k] * local_steps), k, buf.current) for k in range(N_NODES)]
    heapq.heapify(events)
    updates = refused = 0
    to90: float | None = None
    t = 0
    waiting: list[int] = []  # members whose update is in the buffer: they train again from the next version
    while events:
        t, k, base = heapq.heappop(events)
        if t > budget:
            break
        s = shards[k]
        start = flat.unflat(base.params)
        trained = flat.flat(local_train(art.trainer, start, xtr[s], ytr[s], local_steps, lr, rngs[k]))
        u = Update(f"m{k}", base.version, base.sha256, len(s), trained - base.params)
        try:
            nxt = buf.admit(f"m{k}", encode_update(u))
            updates += 1
        except Refused:
            refused += 1
            nxt = None
        if nxt is None and f"m{k}" in buf.pending:
            waiting.append(k)  # as AsyncMember does: one update per version it holds
            continue
        if nxt is not None:
            if to90 is None and accuracy(art, flat.unflat(nxt.params), xte, yte) >= 0.9:
                to90 = t * step_s
            for j in waiting:
                heapq.heappush(events, (scn.finish(j, t, scn.speeds[j] * local_steps), j, nxt))
            waiting.clear()
        heapq.heappush(events, (scn.finish(k, t, scn.speeds[k] * local_steps), k, buf.current))
    return Result(f"async K={buffer} S={max_staleness}", buf.current.version, updates, refused,
                  accuracy(art, flat.unflat(buf.current.params), xte, yte), min(t, budget) * step_s, to90)


def step_seconds(art, x, y) -> float:
    tr = art.trainer
    params = [np.array(p) for p in art.params]
    idx = np.arange(tr.batch)
    tr.loss_and_grad(params, x[idx], y[idx])
    t0 = time.perf_counter()
    for _ in range(50):
        _, g = tr.loss_and_grad(params, x[idx], y[idx])
        tr.apply(params, g, tr.init_state(params), lr=0.1)
    return (time.perf_counter() - t0) / 50


def main(artifact_dir: Path, rounds: int = 40, local_steps: int = 10, lr: float = 0.1,
         seed: int = 0, intermittent: bool = False) -> list[Result]:
    from compiler import load_artifact

    art = load_artifact(artifact_dir)
    xtr, xte, ytr, yte = load_split()
    data = (xtr, xte, ytr, yte, non_iid_shards(ytr))
    step_s = step_seconds(art, xtr, ytr)
    budget = rounds * max(SPEEDS) * local_steps  # local steps: the sync run's `rounds` rounds
    scn = Scenario(SPEEDS)
    if intermittent:
        scn = Scenario(**INTERMITTENT)  # type: ignore[arg-type]
    print(f"one local step {step_s * 1e3:.2f} ms; {scn}; {local_steps} local steps per update; "
          f"budget {budget * step_s:.2f} s simulated; seed {seed}", flush=True)
    out = [run_sync(art, data, budget=budget, local_steps=local_steps, lr=lr, step_s=step_s, seed=seed,
                    scn=scn)]
    for k, s in ((2, 4), (3, 4), (4, 8)):
        out.append(run_async(art, data, budget=budget, local_steps=local_steps, lr=lr, step_s=step_s,
                             buffer=k, max_staleness=s, seed=seed, scn=scn))
    print("| mode | versions | updates used | refused as stale | test accuracy | local steps to 90% |")
    print("|---|---|---|---|---|---|")
    for r in out:
        t90 = "never" if r.to_90_s is None else f"{round(r.to_90_s / step_s)}"
        print(f"| {r.mode} | {r.versions} | {r.updates} | {r.refused} | {r.acc:.2%} | {t90} |")
    return out


if __name__ == "__main__":
    # ARTIFACT_DIR [ROUNDS [SEED]] [--intermittent]: SEED varies the members' batch sampling
    flags = [a for a in sys.argv[2:] if a.startswith("--")]
    args = [int(a) for a in sys.argv[2:] if not a.startswith("--")]
    main(Path(sys.argv[1]), args[0] if args else 40, seed=args[1] if len(args) > 1 else 0,
         intermittent="--intermittent" in flags)
