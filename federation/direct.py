"""The direct exchange: every member sends its vector straight to every other member (one hop).

Two uses, both by :class:`~federation.ring.RingAllreduce`:

* :func:`exchange` (``RingAllreduce.exchange``): every member gets the ``(n, L)`` rows in
  ``sorted(group)`` order, each exactly as its sender sent it (optionally encoded once with a
  codec with error feedback). Robust and screened aggregators (:mod:`federation.aggregators`)
  combine those rows themselves.
* :class:`DirectRun`: an allreduce that skips the ring for small float32 vectors.

Direct path (small F32 vectors)
* When the whole vector, sent to every peer, is at most ``direct_max_bytes`` per member
  (``(n - 1) * 4 * L``; default ``DIRECT_MAX_BYTES``), the allreduce skips the ring: every member
  sends its own (checked, clipped) vector to every peer (phase EXCHANGE, step 1, chunk = its rank,
  F32 parts) and sums the n rows itself in ``sorted(group)`` order, so the result is still
  bit-identical everywhere. One hop instead of ``2 (n - 1)``: a small vector's allreduce is bound
  by per-frame latency, not bytes (``(n - 1) L`` floats sent instead of ``2 (n - 1) L / n``).
* Same START, DRAIN, deadline and ABORT rules as the ring. Checks are per member rather than
  per partial sum: a row with NaN/Inf, or longer in any ring chunk than its sender claimed
  (``claims=``), is rejected naming its sender. With ``screen=`` no claims travel: every member
  has every row, so ``decide`` gets the rows' own chunk norms (``robust.chunk_norms``, what an
  honest member claims) and the chunks it bounds to 0 count as zeros: one hop per step, not two,
  and no norm to lie about.
* The choice depends only on ``n``, ``L``, the codec and ``direct_max_bytes``: every member of a
  swarm makes the same one (a member that differs breaks the schedule and the round aborts).
"""

from __future__ import annotations

import numpy as np

from federation import compression as comp
from federation import robust
from federation import schedule as sch
from federation.checks import all_finite, check_finite, clip_l2
from federation.collective import CollectiveBase, Feedback, ReduceOp, Screen, violation
from federation.errors import RoundAborted, UpdateRejected
from federation.framing import Codec, Frame, FrameKind, Phase, encode
from federation.session import Call

__all__ = ["DIRECT_MAX_BYTES", "DirectRun", "exchange", "gather_rows", "finish"]

# An F32 allreduce whose direct exchange sends at most this many bytes per member goes direct
# (one hop) instead of around the ring (2 (n - 1) hops): docs/benchmarks-history.md, "Direct path".
DIRECT_MAX_BYTES = 256 * 1024


def finish(call: Call, linger: bool) -> None:
    """End an all-to-all call: every peer needs our row to finish it, so its ACK need not be
    waited for (``linger``; False = drain like the ring)."""
    if linger:
        call.linger()
    else:
        call.drain()


def exchange(eng: CollectiveBase, x: np.ndarray, members: list[str], tag: str, timeout: float,
             codec: Codec, linger: bool) -> np.ndarray:
    """``RingAllreduce.exchange`` for checked arguments (see its docstring); the caller holds the
    engine's lock."""
    if codec == Codec.F32:
        with eng.endpoint.call(tag, [m for m in members if m != eng.member_id], timeout) as call:
            out = gather_rows(eng, call, x, members, 0)
            finish(call, linger)
        return out
    key = (tuple(members), "exchange", codec, x.size, eng.topk_ratio)
    fb = eng._feedback
    residual = (fb.residual.copy() if fb is not None and fb.key == key
                else np.zeros(x.size, np.float32)) if codec in comp.FEEDBACK_CODECS else None
    parts = sch.part_bounds(0, x.size, comp.per_part(codec, eng.max_payload, eng.topk_ratio),
                            at_least_one=True)
    if all_finite(x):
        pieces = [comp.encode(codec, x[a:b], None if residual is None else residual[a:b],
                              topk_ratio=eng.topk_ratio) for a, b in parts]
    else:  # carried as non-finite (int8 would zero it); the residual is left as it was
        pieces = [comp.encode_nonfinite(codec, b - a) for a, b in parts]
    with eng.endpoint.call(tag, [m for m in members if m != eng.member_id], timeout) as call:
        out = gather_rows(eng, call, x, members, 0, codec=codec, pieces=pieces)
        finish(call, linger)
    if residual is not None:
        eng._feedback = Feedback(key, residual)
    return out


def gather_rows(eng: CollectiveBase, call: Call, x: np.ndarray, members: list[str], step: int,
                stash: list[Frame] | None = None, *, codec: Codec = Codec.F32,
                pieces: list[list] | None = None) -> np.ndarray:
    """Send ``x`` to every peer (phase EXCHANGE, ``step``, chunk = our rank) and receive
    theirs: the ``(n, L)`` rows in ``members`` order (frames in ``stash`` are taken first).
    With ``pieces`` (one list of encoded payload pieces per part, see :func:`exchange`) those
    go out instead, with ``codec``, and every row is the decoded one, ours too."""
    n, me, size = len(members), eng.member_id, x.size
    rank = members.index(me)
    per = comp.per_part(codec, eng.max_payload, eng.topk_ratio)
    parts = sch.part_bounds(0, size, per, at_least_one=True)
    out = np.empty((n, size), np.float32)
    if pieces is None:
        out[rank] = x
    else:
        for p, (a, b) in enumerate(parts):
            out[rank, a:b] = comp.decode(codec, comp.join_pieces(pieces[p]), b - a)
    for dst in members:
        if dst != me:
            for p in range(len(parts)):
                call.queue(dst, (Phase.EXCHANGE, step, rank, p),
                           _exchange_builder(eng, call.tag, step, rank, p, parts, x, codec, pieces))
    pending = {(j, p) for j in range(n) if j != rank for p in range(len(parts))}
    while pending:
        fr = stash.pop(0) if stash else call.wait(lambda: [members[j] for j, _ in sorted(pending)])
        if fr is None:
            continue
        j = members.index(fr.sender) if fr.sender in members else -1
        if (fr.phase != Phase.EXCHANGE or fr.codec != codec or fr.step != step or fr.chunk != j
                or fr.total != size or fr.nparts != len(parts) or (j, fr.part) not in pending
                or (fr.offset, fr.offset + fr.count) != parts[fr.part]):
            violation(fr, "unexpected exchange frame")
        a, b = parts[fr.part]
        out[j, a:b] = comp.decode(codec, fr.payload, b - a)
        pending.discard((j, fr.part))
    return out


def _exchange_builder(eng: CollectiveBase, tag: str, step: int, rank: int, part: int,
                      parts: list[tuple[int, int]], x: np.ndarray, codec: Codec = Codec.F32,
                      pieces: list[list] | None = None):
    a, b = parts[part]
    payload = [x[a:b]] if pieces is None else pieces[part]

    def build() -> bytes:
        return encode(FrameKind.DATA, Phase.EXCHANGE, swarm=eng.swarm, tag=tag, sender=eng.member_id,
                      codec=codec, step=step, chunk=rank, part=part, nparts=len(parts), offset=a,
                      count=b - a, total=x.size, payload=payload, **eng.endpoint.frame_kw)
    return build


class DirectRun:
    """One allreduce as a direct exchange (module docstring): the checks and clipping of the
    ring's call without its claims exchange; every row travels straight from its sender, so
    ``decide`` gets the chunk norms of the rows themselves."""

    def __init__(self, eng: CollectiveBase, x: np.ndarray, members: list[str], tag: str, op: ReduceOp,
                 timeout: float, codec: Codec, clip_norm: float | None, claims: np.ndarray | None = None,
                 screen: Screen | None = None, *, linger: bool = True) -> None:
        self.eng, self.x, self.members, self.tag, self.op = eng, x, members, tag, op
        self.timeout, self.codec, self.clip_norm = timeout, codec, clip_norm
        self.claims, self.screen, self.linger = claims, screen, linger
        self.n, self.me, self.L = len(members), eng.member_id, x.size

    def run(self) -> np.ndarray:
        n, peers = self.n, [m for m in self.members if m != self.me]
        with self.eng.endpoint.call(self.tag, peers, self.timeout) as call:
            if self.screen is None:
                check_finite(self.x, member=self.me)
            x = self.x
            if self.clip_norm is not None and all_finite(x):  # a non-finite one is screened out below
                x, _ = clip_l2(x, self.clip_norm)
            rows = gather_rows(self.eng, call, np.ascontiguousarray(x, np.float32), self.members, 1)
            if self.screen is not None:
                self._screen_rows(rows)
            for j, m in enumerate(self.members):
                if not all_finite(rows[j]):
                    raise UpdateRejected(f"round {self.tag!r}: data from {m} is not finite", member=m,
                                         hint="that member's update diverged")
            if self.claims is not None:
                self._check_rows(rows)
            acc = rows[0].copy()
            for j in range(1, n):  # in sorted(group) order on every member: bit-identical sums
                acc += rows[j]
            if self.op == ReduceOp.MEAN:
                np.divide(acc, np.float32(n), out=acc)
            if not all_finite(acc):
                raise RoundAborted(f"round {self.tag!r}: the reduced sum overflowed float32 on {self.me}",
                                   member=self.me, hint="scale the updates down or enable clip_norm")
            self.result = acc
            finish(call, self.linger)
        return self.result

    def _screen_rows(self, rows: np.ndarray) -> None:
        """``decide`` on the rows' own chunk norms (what honest members claim); the chunks it
        bounds to 0 (excluded members, members without samples) count as zeros."""
        assert self.screen is not None
        n = self.n
        claims = np.stack([robust.chunk_norms(rows[j], n) for j in range(n)])
        bounds, _ = self.screen[1](claims, rows)
        bounds = np.asarray(bounds, np.float64).reshape(n, n)
        for c, (a, b) in enumerate(sch.chunk_bounds(n, self.L)):
            for j in range(n):
                if bounds[j, c] == 0:
                    rows[j, a:b] = 0.0

    def _check_rows(self, rows: np.ndarray) -> None:
        """Each member's own vector, chunk by chunk, can be no longer than it claimed (our own
        row too: a member that breaks its claim fails like its peers, not only by their ABORT)."""
        assert self.claims is not None
        tol = robust.claims_tolerance(self.n, False)
        for j, m in enumerate(self.members):
            norms = robust.chunk_norms(rows[j], self.n)  # as its sender computes its claims
            over = np.flatnonzero(norms > self.claims[j] * tol)
            if over.size:
                c = int(over[0])
                raise UpdateRejected(
                    f"round {self.tag!r}: the update from {m} has norm {norms[c]:.3g} in chunk {c}, "
                    f"above the {self.claims[j, c] * tol:.3g} it claimed", member=m,
                    hint="that member lied about its update norm (or sent an excluded update)")
