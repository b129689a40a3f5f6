"""The ring-allreduce engine: :class:`RingAllreduce` runs the pure schedule of
:mod:`federation.schedule` over any :class:`~federation.transport.Transport`.

Call life cycle (``allreduce(vec, group=..., tag=..., timeout=...)``), per member
--------------------------------------------------------------------------------------
Ring order is ``sorted(group)``; rank ``r`` sends only to ``r+1`` and receives only from
``r-1`` (mod n). One call = one ``tag``; a tag is never reused by a member.

1. START: the deadline is ``now + timeout``. Frames of this tag that arrived early (buffered by
   the receive pump, unacknowledged) are handed over. The member's own vector is checked: any
   NaN/Inf -> ABORT(member = self, rejected) to every peer and ``UpdateRejected`` locally.
   Optional L2 clipping (``clip_norm``) scales the member's copy, never the caller's array.
2. REDUCE-SCATTER, steps 0..n-2: step 0 queues every part of chunk ``r``. When part ``p`` of
   step ``s`` arrives from ``r-1`` it is decoded, checked (NaN/Inf -> ABORT naming the sender),
   added into the member's buffer and part ``p`` of step ``s+1`` is queued (pipelined per
   part, no waiting for whole chunks). After step n-2 the member owns chunk ``r+1``.
3. FINALISE (owner, per part): ``mean`` divides by n; the part is encoded once with the round's
   codec (error feedback: residual of this member); the owner's own result is *decoded from
   those payload bytes*, exactly as every other member will decode them.
4. ALL-GATHER, steps 0..n-2: step 0 sends the owner's payload; a member receiving part ``p`` of
   step ``s`` decodes it into its result and forwards the *same payload bytes* (new header) as
   step ``s+1``. Hence results are bit-identical on every member, with any codec.
5. DRAIN: when every expected part has arrived, the member waits until its own frames are
   acknowledged (so the successor is not left needing a retransmit), then returns. If the
   deadline passes while only ACKs are missing it returns anyway: its result is complete.
6. COMMIT: the error-feedback residuals are committed only on success (an aborted round leaves
   no trace). The caller commits its parameters only if the call returned.

Reliability rules (see :mod:`federation.session`)
* Every DATA frame is acknowledged (ACKs batched per sender), duplicates included; at most ``max_in_flight``
  unacknowledged frames per peer; unacknowledged frames are retransmitted after
  ``retransmit_after`` s, doubling up to 8x. The window, not the broker's queue, bounds memory.
* De-duplication key: ``(sender, phase, step, chunk, part)`` within the tag; a duplicate is
  re-acknowledged, counted in ``stats.duplicates`` and otherwise ignored.
* Reordering is harmless: parts are independent; a part is forwarded when it arrives.
* Frames of an unknown tag are buffered (not acknowledged) for up to 4 tags; frames of a
  finished tag are re-acknowledged; frames of an aborted tag get one ABORT reply.
* Malformed frames (checksum, version, length, ids) are dropped unacknowledged and counted in
  ``stats.rejected``; the sender's retransmission repairs them.
* A frame that breaks the schedule (wrong sender, step, chunk, layout, codec or length)
  aborts the round blaming its sender: all members must run the same release with the same
  ``max_payload`` and ``topk_ratio``.
* Deadline: if the expected frames have not arrived by ``now + timeout`` the member sends ABORT
  to every peer, listens for its peers' ABORTs (until all but one were heard, at most
  ``min(1 s, max(0.05 s, timeout / 4))``) and raises
  ``RoundAborted(member=<the blamed member no peer heard from>)`` (see the abort vote in
  :mod:`federation.session`). A NaN/Inf anywhere raises ``UpdateRejected`` (a RoundAborted)
  naming the member whose data was bad, on every member. Nobody returns a partial result.
* Ranks, chunks and parts are all derived from ``sorted(group)``, the vector length (equal on
  every member; a mismatch aborts), the codec, ``max_payload`` and ``topk_ratio``.

Direct path (small F32 vectors): see :mod:`federation.direct` (the choice is
:meth:`RingAllreduce.algorithm`).

Broadcast (``broadcast(vec_or_None, root=..., group=..., tag=...)``)
* Chain along the ring from the root: hop ``d`` is rank ``(root + d) % n``; each hop receives
  phase BROADCAST step ``d-1`` from its predecessor and forwards the same payload bytes as step
  ``d``, part by part (pipelined). Codec F32 only (lossless). The vector length travels in
  every frame's ``total``; an empty vector is sent as one part with 0 elements.
* Same ACK / window / retransmit / deadline rules; every member returns the root's bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from federation import compression as comp
from federation import direct, robust
from federation import schedule as sch
from federation.checks import all_finite, check_finite, clip_l2
from federation.collective import (
    CollectiveBase,
    Feedback,
    ReduceOp,
    Screen,
    as_vector,
    ordered_group,
    violation,
)
from federation.direct import DIRECT_MAX_BYTES, DirectRun
from federation.errors import RoundAborted, UpdateRejected
from federation.framing import Codec, Frame, FrameKind, Phase, encode
from federation.modes import Compression
from federation.session import Call
from federation.transport import Transport

__all__ = ["RingAllreduce", "ReduceOp", "Screen", "DIRECT_MAX_BYTES"]


class RingAllreduce(CollectiveBase):
    """Ring allreduce and ring broadcast for one member (see the module docstring).

    ``transport.max_payload`` bounds every frame; all members of a swarm must use the same
    ``max_payload``, ``topk_ratio`` and ``direct_max_bytes``. ``stats`` counts bytes, frames,
    duplicates, rejects.

    ``direct_max_bytes``: an F32 allreduce whose direct exchange sends at most this many bytes
    per member (``(n - 1) * 4 * len(vec)``) skips the ring (see "Direct path" in the module
    docstring); 0 = always the ring.
    ``linger``: all-to-all calls (the direct path, :meth:`exchange`) return once every row is in,
    leaving their unacknowledged frames to the session (PROTOCOL.md section 5); False = they drain
    like the ring (the baseline of ``python -m bench.linger``).
    """

    def __init__(self, transport: Transport, *, direct_max_bytes: int = DIRECT_MAX_BYTES, linger: bool = True,
                 **kw: Any) -> None:
        super().__init__(transport, **kw)
        if not isinstance(direct_max_bytes, int) or direct_max_bytes < 0:
            raise ValueError(f"direct_max_bytes must be an int >= 0, got {direct_max_bytes!r}")
        self.direct_max_bytes = direct_max_bytes
        self.linger = bool(linger)

    def algorithm(self, n: int, size: int, compression: Compression | str = Compression.NONE) -> str:
        """``"direct"`` or ``"ring"``: how an allreduce of ``size`` floats over ``n`` members runs
        (the same answer on every member of a swarm: it depends only on arguments they share)."""
        codec = comp.codec_for(compression)
        if n > 1 and codec == Codec.F32 and (n - 1) * 4 * size <= self.direct_max_bytes:
            return "direct"
        return "ring"

    # -- allreduce ---------------------------------------------------------------------------
    def allreduce(self, vec: np.ndarray, *, group: list[str], tag: str, op: ReduceOp | str = "mean",
                  timeout: float = 30.0, compression: Compression | str = Compression.NONE,
                  clip_norm: float | None = None, claims: np.ndarray | None = None,
                  screen: Screen | None = None, algorithm: str = "auto") -> np.ndarray:
        """Sum or mean of every member's ``vec``; every member gets bit-identical bytes.

        ``algorithm``: ``"auto"`` (:meth:`algorithm` decides: the direct path for small F32
        vectors), ``"ring"`` or ``"direct"`` (F32 only); every member of a call must pass the same.

        ``claims`` (n x n, rows in ``sorted(group)`` order, columns = ring chunks): the L2 norm
        each member claimed for its contribution to each chunk (``federation.robust``); every
        received partial sum is checked against the sum of its contributors' claims and a
        violation aborts the call blaming the sender. Codecs F32 and F16 only (INT8/TOPK send
        error-feedback residuals, which no claim covers).

        ``screen = (claim, decide)``: the claims are exchanged inside this call first (one hop,
        phase EXCHANGE, chunk = the sender's rank): ``claim`` is this member's row (n floats), and
        ``decide(rows, None)`` (rows n x n, the same bits on every member) returns
        ``(claims, send)``: the claims to check (as above) and whether this member contributes its
        ``vec`` (else zeros). One call instead of an exchange and an allreduce: one set-up and one
        drain per step. On the direct path (small F32 vectors) no claims travel: ``decide(rows,
        vectors)`` gets ``robust.chunk_norms`` of every member's actual vector (so ``claim`` must
        be that of ``vec``, or zeros for a member that sends zeros) and the ``(n, L)`` vectors
        themselves (e.g. for a direction check); the chunks it bounds to 0 count as zeros.

        Raises :class:`RoundAborted` (deadline, dead member, peer abort) or
        :class:`UpdateRejected` (NaN/Inf or a broken claim, naming the sender); on either nothing
        is committed.
        """
        x = as_vector(vec)
        op = ReduceOp(op)
        codec = comp.codec_for(compression)
        members = ordered_group(group, self.member_id)
        if claims is not None:
            claims = np.asarray(claims, np.float64).reshape(len(members), len(members))
            if codec not in (Codec.F32, Codec.F16):
                raise ValueError(f"claims cannot be checked with codec {codec.name} (error feedback)")
        if screen is not None and codec not in (Codec.F32, Codec.F16):
            raise ValueError(f"claims cannot be checked with codec {codec.name} (error feedback)")
        if algorithm == "auto":
            algorithm = self.algorithm(len(members), x.size, compression)
        elif algorithm not in ("ring", "direct"):
            raise ValueError(f"unknown algorithm {algorithm!r} (auto, ring or direct)")
        elif algorithm == "direct" and codec != Codec.F32:
            raise ValueError(f"the direct path sends float32 only, not {codec.name}")
        with self._lock:
            if algorithm == "direct":
                return DirectRun(self, x, members, tag, op, timeout, codec, clip_norm, claims, screen,
                                 linger=self.linger).run()
            return _RingRun(self, x, members, tag, op, timeout, codec, clip_norm, claims, screen).run()

    # -- exchange ----------------------------------------------------------------------------
    def exchange(self, vec: np.ndarray, *, group: list[str], tag: str, timeout: float = 30.0,
                 compression: Compression | str = Compression.NONE) -> np.ndarray:
        """Every member's float32 vector, sent **directly** to every other member (one hop, phase
        EXCHANGE, chunk = the sender's rank, F32 parts); returns an ``(n, L)`` array in
        ``sorted(group)`` order. Row j is exactly what member j sent (in a signed swarm: what its
        authenticated sender sent; no other member can alter it, unlike a slot of a sum-allreduce).
        NaN/Inf are carried as sent. Each member sends ``(n - 1) L`` floats: half of a ring
        all-gather of the same rows, in one hop instead of ``2 (n - 1)``.

        ``compression`` other than none: each member sends its row encoded once with that codec
        (``int8``, ``topk``, ``fp16``) with error feedback (its residual of the last successful
        exchange of the same group, codec and length is added first, and what the codec dropped is
        kept for the next; committed only when the call succeeds, like the ring's), and every
        member, the sender included, gets the *decoded* rows: the same bits everywhere. A row
        whose int8 scale is not finite decodes to non-finite values, carried as received."""
        x = as_vector(vec)
        members = ordered_group(group, self.member_id)
        codec = comp.codec_for(compression)
        with self._lock:
            return direct.exchange(self, x, members, tag, timeout, codec, self.linger)

    # -- broadcast ---------------------------------------------------------------------------
    def broadcast(self, vec: np.ndarray | None, *, root: str, group: list[str], tag: str,
                  timeout: float = 30.0) -> np.ndarray:
        """``root``'s float32 vector, delivered along the ring (pipelined, forwarded bytes).

        Only the root's ``vec`` is used (others may pass None); every member returns a copy
        bit-identical to the root's.
        """
        members = ordered_group(group, self.member_id)
        if root not in members:
            raise ValueError(f"broadcast root {root!r} is not in the group {members}")
        x = None
        if self.member_id == root:
            if vec is None:
                raise ValueError("the broadcast root must pass its vector")
            x = as_vector(vec)
        with self._lock:
            return self._broadcast(x, root, members, tag, timeout)

    def _broadcast(self, x: np.ndarray | None, root: str, members: list[str], tag: str,
                   timeout: float) -> np.ndarray:
        n, me = len(members), self.member_id
        rank = members.index(me)
        order = sch.chain(n, members.index(root))
        hop = order.index(rank)
        succ, pred = members[sch.successor(rank, n)], members[sch.predecessor(rank, n)]
        per = comp.per_part(Codec.F32, self.max_payload)
        with self.endpoint.call(tag, [m for m in members if m != me], timeout) as call:
            if hop == 0:
                assert x is not None
                if n > 1:
                    root_parts = sch.part_bounds(0, x.size, per, at_least_one=True)
                    for p, (a, b) in enumerate(root_parts):
                        call.queue(succ, (Phase.BROADCAST, 0, 0, p),
                                   self._data_builder(tag, 0, p, len(root_parts), a, b, x.size, [x[a:b]]))
                    call.drain()
                return x.copy()
            result: np.ndarray | None = None
            parts: list[tuple[int, int]] = []
            pending: set[int] | None = None
            while pending is None or pending:
                fr = call.wait(pred)
                if fr is None:
                    continue
                if (fr.phase != Phase.BROADCAST or fr.sender != pred or fr.step != hop - 1
                        or fr.codec != Codec.F32):
                    violation(fr, "unexpected broadcast frame")
                if result is None:
                    result = np.empty(fr.total, np.float32)
                    parts = sch.part_bounds(0, fr.total, per, at_least_one=True)
                    pending = set(range(len(parts)))
                assert pending is not None
                if (fr.total != result.size or fr.nparts != len(parts) or fr.part not in pending
                        or (fr.offset, fr.offset + fr.count) != parts[fr.part]):
                    violation(fr, "broadcast part layout mismatch (same max_payload everywhere?)")
                a, b = parts[fr.part]
                result[a:b] = comp.decode(Codec.F32, fr.payload, b - a)
                pending.discard(fr.part)
                if hop < n - 1:
                    call.queue(succ, (Phase.BROADCAST, hop, 0, fr.part),
                               self._data_builder(tag, hop, fr.part, len(parts), a, b, result.size,
                                                  [fr.payload]))
            call.drain()
            assert result is not None
            return result

    def _data_builder(self, tag: str, step: int, part: int, nparts: int, a: int, b: int, total: int,
                      pieces: list):
        def build() -> bytes:
            return encode(FrameKind.DATA, Phase.BROADCAST, swarm=self.swarm, tag=tag, sender=self.member_id,
                          codec=Codec.F32, step=step, chunk=0, part=part, nparts=nparts, offset=a,
                          count=b - a, total=total, payload=pieces, **self.endpoint.frame_kw)
        return build



class _RingRun:
    """State of one allreduce call on one member."""

    def __init__(self, eng: RingAllreduce, x: np.ndarray, members: list[str], tag: str, op: ReduceOp,
                 timeout: float, codec: Codec, clip_norm: float | None,
                 claims: np.ndarray | None = None, screen: Screen | None = None) -> None:
        self.eng, self.x, self.members, self.tag, self.op = eng, x, members, tag, op
        self.claims = claims
        self.screen = screen
        self._stash: list[Frame] = []  # ring frames that arrived while we waited for the claims
        self._sq: dict[tuple[int, int], float] = {}  # (phase, step) -> sum of squares received so far
        self.timeout, self.codec, self.clip_norm = timeout, codec, clip_norm
        self.n = len(members)
        self.me = eng.member_id
        self.rank = members.index(self.me)
        self.succ = members[sch.successor(self.rank, self.n)]
        self.pred = members[sch.predecessor(self.rank, self.n)]
        self.L = x.size
        self.per = comp.per_part(codec, eng.max_payload, eng.topk_ratio)
        self.parts = [sch.part_bounds(a, b, self.per) for a, b in sch.chunk_bounds(self.n, self.L)]
        self.rs = sch.reduce_scatter(self.n, self.rank)
        self.ag = sch.all_gather(self.n, self.rank)

    def _residual(self) -> np.ndarray | None:
        if self.codec not in comp.FEEDBACK_CODECS:
            return None
        key = (tuple(self.members), self.op, self.codec, self.L, self.eng.topk_ratio)
        fb = self.eng._feedback
        if fb is not None and fb.key == key:
            return fb.residual.copy()
        return np.zeros(self.L, np.float32)

    def _build(self, phase: Phase, step: int, chunk: int, part: int, pieces: list) -> bytes:
        a, b = self.parts[chunk][part]
        return encode(FrameKind.DATA, phase, swarm=self.eng.swarm, tag=self.tag, sender=self.me,
                      codec=self.codec, step=step, chunk=chunk, part=part, nparts=len(self.parts[chunk]),
                      offset=a, count=b - a, total=self.L, payload=pieces, **self.eng.endpoint.frame_kw)

    def _queue_rs(self, call: Call, step: int, part: int) -> None:
        chunk = self.rs[step].send_chunk
        a, b = self.parts[chunk][part]
        res = self.residual

        def build() -> bytes:
            # Encoded lazily: the buffer slice is final once its part of step-1 was added.
            pieces = comp.encode(self.codec, self.work[a:b], None if res is None else res[a:b],
                                 topk_ratio=self.eng.topk_ratio)
            return self._build(Phase.REDUCE_SCATTER, step, chunk, part, pieces)

        call.queue(self.succ, (Phase.REDUCE_SCATTER, step, chunk, part), build)

    def _finalise(self, chunk: int, part: int) -> bytes | np.ndarray:
        """Owner: apply the op to one part, encode it once, set our result from those bytes."""
        a, b = self.parts[chunk][part]
        w = self.work[a:b]
        if self.op == ReduceOp.MEAN:
            np.divide(w, np.float32(self.n), out=w)
        if not all_finite(w):
            raise RoundAborted(f"round {self.tag!r}: the reduced sum overflowed float32 on {self.me}",
                               member=self.me, hint="scale the updates down or enable clip_norm")
        res = self.residual
        pieces = comp.encode(self.codec, w, None if res is None else res[a:b], topk_ratio=self.eng.topk_ratio)
        if self.codec == Codec.F32:
            return w  # lossless: ``result`` is ``work``, already what the others will decode
        payload = comp.join_pieces(pieces)
        self.result[a:b] = comp.decode(self.codec, payload, b - a)
        return payload

    def _queue_ag(self, call: Call, step: int, part: int, payload) -> None:
        chunk = self.ag[step].send_chunk
        call.queue(self.succ, (Phase.ALL_GATHER, step, chunk, part),
                   lambda: self._build(Phase.ALL_GATHER, step, chunk, part, [payload]))

    def _check_claim(self, fr: Frame, chunk: int, vals: np.ndarray) -> None:
        """A partial sum can be no longer than the sum of its contributors' claimed norms."""
        assert self.claims is not None
        n = self.n
        if fr.phase == Phase.REDUCE_SCATTER:  # step s carries ranks r-1, ..., r-1-s
            bound = sum(self.claims[(self.rank - 1 - i) % n, chunk] for i in range(fr.step + 1))
        else:  # all-gather carries the owner's finished chunk
            bound = float(self.claims[:, chunk].sum()) / (n if self.op == ReduceOp.MEAN else 1)
        key = (int(fr.phase), fr.step)
        v = vals.astype(np.float64)
        sq = self._sq.get(key, 0.0) + float(np.dot(v, v))
        self._sq[key] = sq
        limit = bound * robust.claims_tolerance(n, self.codec != Codec.F32)
        if sq > limit * limit + 1e-30:
            raise UpdateRejected(
                f"round {self.tag!r}: {fr.phase.name.lower()} data from {fr.sender} has norm "
                f"{sq ** 0.5:.3g}, above the {limit:.3g} its contributors claimed",
                member=fr.sender, hint="that member lied about its update norm (or sent an excluded update)")

    def run(self) -> np.ndarray:
        ep = self.eng.endpoint
        peers = [m for m in self.members if m != self.me]
        with ep.call(self.tag, peers, self.timeout) as call:
            if self.screen is not None:
                self._screen(call)
            check_finite(self.x, member=self.me)
            clipped, _ = clip_l2(self.x, self.clip_norm)
            self.work = np.array(clipped, dtype=np.float32, copy=True)
            self.residual = self._residual()
            # The result is assembled in the work buffer itself (one 4L-byte buffer per call, not
            # two): a region is overwritten by all-gather only after our reduce-scatter frame for
            # it was built (the owner cannot finish a part before our contribution reached it,
            # and retransmits resend the built bytes).
            self.result = self.work
            n = self.n
            if n == 1:
                for p in range(len(self.parts[0])):
                    self._finalise(0, p)
            else:
                self._exchange(call)
            call.drain()
        if self.residual is not None:
            self.eng._feedback = Feedback((tuple(self.members), self.op, self.codec, self.L,
                                            self.eng.topk_ratio), self.residual)
        return self.result

    def _screen(self, call: Call) -> None:
        """Exchange the claims (one hop, inside this call), then let the caller decide."""
        assert self.screen is not None
        claim, decide = self.screen
        row = as_vector(claim)
        n = self.n
        if row.size != n:
            raise ValueError(f"a claim row has {n} values (one per ring chunk), got {row.size}")
        rows = np.empty((n, n), np.float32)
        rows[self.rank] = row
        for dst in self.members:
            if dst != self.me:
                call.queue(dst, (Phase.EXCHANGE, 0, self.rank, 0), lambda: encode(
                    FrameKind.DATA, Phase.EXCHANGE, swarm=self.eng.swarm, tag=self.tag, sender=self.me,
                    codec=Codec.F32, step=0, chunk=self.rank, part=0, nparts=1, offset=0, count=n, total=n,
                    payload=[row], **self.eng.endpoint.frame_kw))
        pending = {j for j in range(n) if j != self.rank}
        while pending:
            fr = call.wait(lambda: [self.members[j] for j in sorted(pending)])
            if fr is None:
                continue
            if fr.phase != Phase.EXCHANGE:
                self._stash.append(fr)  # a predecessor that decided first already started
                continue
            j = self.members.index(fr.sender) if fr.sender in self.members else -1
            if (j not in pending or fr.chunk != j or fr.codec != Codec.F32 or fr.step != 0
                    or fr.total != n or fr.count != n or fr.nparts != 1):
                violation(fr, "unexpected claim frame")
            rows[j] = comp.decode(Codec.F32, fr.payload, n)
            pending.discard(j)
        claims, send = decide(rows, None)
        self.claims = np.asarray(claims, np.float64).reshape(n, n)
        if not send:
            self.x = np.zeros_like(self.x)

    def _exchange(self, call: Call) -> None:
        n, last = self.n, self.n - 2
        # Stage and Phase share codes, so (stage, step, part) matches (frame.phase, step, part).
        pending = {(t.stage, t.step, p) for t in self.rs + self.ag
                   for p in range(len(self.parts[t.recv_chunk]))}
        for p in range(len(self.parts[self.rs[0].send_chunk])):
            self._queue_rs(call, 0, p)
        while pending:
            fr = self._stash.pop(0) if self._stash else call.wait(self.pred)
            if fr is None:
                continue
            k = (fr.phase, fr.step, fr.part)
            if (k not in pending or fr.sender != self.pred or fr.codec != self.codec or fr.total != self.L
                    or fr.step >= n - 1):
                violation(fr, "unexpected allreduce frame")
            t = (self.rs if fr.phase == Phase.REDUCE_SCATTER else self.ag)[fr.step]
            parts = self.parts[t.recv_chunk]
            span = (fr.offset, fr.offset + fr.count)
            if fr.chunk != t.recv_chunk or fr.nparts != len(parts) or parts[fr.part] != span:
                violation(fr, "allreduce part layout mismatch (same max_payload and topk_ratio everywhere?)")
            a, b = parts[fr.part]
            vals = comp.decode(self.codec, fr.payload, b - a)
            if not all_finite(vals):
                raise UpdateRejected(
                    f"round {self.tag!r}: {fr.phase.name.lower()} data from {fr.sender} is not finite",
                    member=fr.sender, hint="that member's update diverged",
                )
            if self.claims is not None:
                self._check_claim(fr, t.recv_chunk, vals)
            pending.discard(k)
            if fr.phase == Phase.REDUCE_SCATTER:
                self.work[a:b] += vals
                if fr.step < last:
                    self._queue_rs(call, fr.step + 1, fr.part)
                else:
                    self._queue_ag(call, 0, fr.part, self._finalise(t.recv_chunk, fr.part))
            else:
                self.result[a:b] = vals
                if fr.step < last:
                    self._queue_ag(call, fr.step + 1, fr.part, fr.payload)
