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

Broadcast (``broadcast(vec_or_None, root=..., group=..., tag=...)``)
* Chain along the ring from the root: hop ``d`` is rank ``(root + d) % n``; each hop receives
  phase BROADCAST step ``d-1`` from its predecessor and forwards the same payload bytes as step
  ``d``, part by part (pipelined). Codec F32 only (lossless). The vector length travels in
  every frame's ``total``; an empty vector is sent as one part with 0 elements.
* Same ACK / window / retransmit / deadline rules; every member returns the root's bytes.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from federation import compression as comp
from federation import robust
from federation import schedule as sch
from federation.checks import all_finite, check_finite, clip_l2
from federation.errors import RoundAborted, TransportError, UpdateRejected
from federation.framing import Codec, Frame, FrameKind, Phase, encode
from federation.messages import Compression
from federation.session import Call, Endpoint
from federation.stats import Stats
from federation.transport import Transport

log = logging.getLogger("fractal.federation.ring")

__all__ = ["RingAllreduce", "ReduceOp", "Screen", "DIRECT_MAX_BYTES"]

# An F32 allreduce whose direct exchange sends at most this many bytes per member goes direct
# (one hop) instead of around the ring (2 (n - 1) hops): docs/benchmarks-history.md, "Direct path".
DIRECT_MAX_BYTES = 256 * 1024

# (this member's claim row, decide(all rows) -> (claims to check, whether to send our vector))
Screen = tuple[np.ndarray, Callable[[np.ndarray], tuple[np.ndarray, bool]]]


class ReduceOp(enum.StrEnum):
    SUM = "sum"
    MEAN = "mean"


@dataclass
class _Feedback:
    key: tuple
    residual: np.ndarray


def as_vector(vec: object) -> np.ndarray:
    """A contiguous 1-D float32 array (copy only if needed); ValueError otherwise."""
    a = np.asarray(vec)
    if a.ndim != 1:
        raise ValueError(f"allreduce takes a 1-D vector, got shape {a.shape}: flatten it first")
    if a.dtype != np.float32:
        if not np.issubdtype(a.dtype, np.number):
            raise ValueError(f"allreduce takes float32 numbers, got dtype {a.dtype}")
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def ordered_group(group: list[str], me: str) -> list[str]:
    """``sorted(group)``, validated: unique ids, ``me`` included."""
    members = sorted(group)
    if len(set(members)) != len(members):
        raise ValueError(f"group has duplicate members: {members}")
    if me not in members:
        raise ValueError(f"{me!r} is not in the group {members}")
    return members


class _Collective:
    """What the ring and the star share: one reliable :class:`Endpoint` on a transport, stats,
    the error-feedback state of compressed rounds, and close/context-manager plumbing."""

    def __init__(self, transport: Transport, *, swarm: str = "default", max_in_flight: int = 16,
                 retransmit_after: float = 1.0, topk_ratio: float = 0.01, max_early_tags: int = 4,
                 max_retransmits: int = 100) -> None:
        self.endpoint = Endpoint(transport, swarm=swarm, max_in_flight=max_in_flight,
                                 retransmit_after=retransmit_after, max_early_tags=max_early_tags,
                                 max_retransmits=max_retransmits)
        self.member_id: str = transport.member_id
        self.swarm = swarm
        self.max_payload: int = int(transport.max_payload)
        self.topk_ratio = topk_ratio
        self._feedback: _Feedback | None = None
        self._lock = threading.Lock()

    @property
    def stats(self) -> Stats:
        return self.endpoint.stats

    @property
    def feedback_residual(self) -> np.ndarray | None:
        """A copy of this member's error-feedback residual (INT8 / TOPK rounds), or None."""
        return None if self._feedback is None else self._feedback.residual.copy()

    def reset_feedback(self) -> None:
        """Forget error-feedback residuals (e.g. after the parameters were replaced)."""
        self._feedback = None

    def cancel(self, reason: str) -> bool:
        """Fail the collective this member is blocked in right now (if any), e.g. when the fleet
        aborts the round: its peers get ABORT frames. Returns whether one was running."""
        return self.endpoint.cancel(reason)

    def abort(self, tag: str, peers: list[str], reason: str) -> None:
        """Void the collective ``tag`` at once: the session sends ABORT to every peer, so members
        blocked in (or about to start) that collective stop now instead of at their deadline.
        Best effort: a peer that misses it still times out on its own."""
        try:
            with self.endpoint.call(tag, [p for p in peers if p != self.member_id], 1.0):
                raise RoundAborted(reason)
        except (RoundAborted, TransportError, RuntimeError, ValueError) as exc:
            log.debug("abort of %s: %s", tag, exc)

    def close(self) -> None:
        """Stop the receive thread and close the transport."""
        self.endpoint.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RingAllreduce(_Collective):
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

    def _finish(self, call: Call) -> None:
        """End an all-to-all call: every peer needs our row to finish it, so its ACK need not be
        waited for (``linger``)."""
        if self.linger:
            call.linger()
        else:
            call.drain()

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
        ``decide(rows)`` (n x n, the same bits on every member) returns ``(claims, send)``: the
        claims to check (as above) and whether this member contributes its ``vec`` (else zeros).
        One call instead of an exchange and an allreduce: one set-up and one drain per step.
        On the direct path (small F32 vectors) no claims travel: ``decide`` gets
        ``robust.chunk_norms`` of every member's actual vector (so ``claim`` must be that of
        ``vec``, or zeros for a member that sends zeros) and the chunks it bounds to 0 count as
        zeros.

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
        run = _DirectRun if algorithm == "direct" else _RingRun
        with self._lock:
            return run(self, x, members, tag, op, timeout, codec, clip_norm, claims, screen).run()

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
            if codec == Codec.F32:
                return self._exchange(x, members, tag, timeout)
            return self._exchange_coded(x, members, tag, timeout, codec)

    def _exchange(self, x: np.ndarray, members: list[str], tag: str, timeout: float) -> np.ndarray:
        with self.endpoint.call(tag, [m for m in members if m != self.member_id], timeout) as call:
            out = self._gather_rows(call, x, members, 0)
            self._finish(call)
        return out

    def _exchange_coded(self, x: np.ndarray, members: list[str], tag: str, timeout: float,
                        codec: Codec) -> np.ndarray:
        key = (tuple(members), "exchange", codec, x.size, self.topk_ratio)
        fb = self._feedback
        residual = (fb.residual.copy() if fb is not None and fb.key == key
                    else np.zeros(x.size, np.float32)) if codec in comp.FEEDBACK_CODECS else None
        parts = sch.part_bounds(0, x.size, comp.per_part(codec, self.max_payload, self.topk_ratio),
                                at_least_one=True)
        if all_finite(x):
            pieces = [comp.encode(codec, x[a:b], None if residual is None else residual[a:b],
                                  topk_ratio=self.topk_ratio) for a, b in parts]
        else:  # carried as non-finite (int8 would zero it); the residual is left as it was
            pieces = [comp.encode_nonfinite(codec, b - a) for a, b in parts]
        with self.endpoint.call(tag, [m for m in members if m != self.member_id], timeout) as call:
            out = self._gather_rows(call, x, members, 0, codec=codec, pieces=pieces)
            self._finish(call)
        if residual is not None:
            self._feedback = _Feedback(key, residual)
        return out

    def _gather_rows(self, call: Call, x: np.ndarray, members: list[str], step: int,
                     stash: list[Frame] | None = None, *, codec: Codec = Codec.F32,
                     pieces: list[list] | None = None) -> np.ndarray:
        """Send ``x`` to every peer (phase EXCHANGE, ``step``, chunk = our rank) and receive
        theirs: the ``(n, L)`` rows in ``members`` order (frames in ``stash`` are taken first).
        With ``pieces`` (one list of encoded payload pieces per part, see :meth:`exchange`) those
        go out instead, with ``codec``, and every row is the decoded one, ours too."""
        n, me, size = len(members), self.member_id, x.size
        rank = members.index(me)
        per = comp.per_part(codec, self.max_payload, self.topk_ratio)
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
                               self._exchange_builder(call.tag, step, rank, p, parts, x, codec, pieces))
        pending = {(j, p) for j in range(n) if j != rank for p in range(len(parts))}
        while pending:
            fr = stash.pop(0) if stash else call.wait(lambda: [members[j] for j, _ in sorted(pending)])
            if fr is None:
                continue
            j = members.index(fr.sender) if fr.sender in members else -1
            if (fr.phase != Phase.EXCHANGE or fr.codec != codec or fr.step != step or fr.chunk != j
                    or fr.total != size or fr.nparts != len(parts) or (j, fr.part) not in pending
                    or (fr.offset, fr.offset + fr.count) != parts[fr.part]):
                _violation(fr, "unexpected exchange frame")
            a, b = parts[fr.part]
            out[j, a:b] = comp.decode(codec, fr.payload, b - a)
            pending.discard((j, fr.part))
        return out

    def _exchange_builder(self, tag: str, step: int, rank: int, part: int, parts: list[tuple[int, int]],
                          x: np.ndarray, codec: Codec = Codec.F32, pieces: list[list] | None = None):
        a, b = parts[part]
        payload = [x[a:b]] if pieces is None else pieces[part]

        def build() -> bytes:
            return encode(FrameKind.DATA, Phase.EXCHANGE, swarm=self.swarm, tag=tag, sender=self.member_id,
                          codec=codec, step=step, chunk=rank, part=part, nparts=len(parts), offset=a,
                          count=b - a, total=x.size, payload=payload, **self.endpoint.frame_kw)
        return build

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
                    _violation(fr, "unexpected broadcast frame")
                if result is None:
                    result = np.empty(fr.total, np.float32)
                    parts = sch.part_bounds(0, fr.total, per, at_least_one=True)
                    pending = set(range(len(parts)))
                assert pending is not None
                if (fr.total != result.size or fr.nparts != len(parts) or fr.part not in pending
                        or (fr.offset, fr.offset + fr.count) != parts[fr.part]):
                    _violation(fr, "broadcast part layout mismatch (same max_payload everywhere?)")
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


def _violation(fr: Frame, what: str) -> None:
    raise RoundAborted(
        f"{what}: {fr.phase.name} step {fr.step} chunk {fr.chunk} part {fr.part}/{fr.nparts} "
        f"[{fr.offset}+{fr.count} of {fr.total}] codec {fr.codec.name} from {fr.sender}",
        member=fr.sender, hint="every member must run the same release with the same max_payload",
    )


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
            self.eng._feedback = _Feedback((tuple(self.members), self.op, self.codec, self.L,
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
                _violation(fr, "unexpected claim frame")
            rows[j] = comp.decode(Codec.F32, fr.payload, n)
            pending.discard(j)
        claims, send = decide(rows)
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
                _violation(fr, "unexpected allreduce frame")
            t = (self.rs if fr.phase == Phase.REDUCE_SCATTER else self.ag)[fr.step]
            parts = self.parts[t.recv_chunk]
            span = (fr.offset, fr.offset + fr.count)
            if fr.chunk != t.recv_chunk or fr.nparts != len(parts) or parts[fr.part] != span:
                _violation(fr, "allreduce part layout mismatch (same max_payload and topk_ratio everywhere?)")
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


class _DirectRun(_RingRun):
    """One allreduce as a direct exchange ("Direct path" in the module docstring): the checks,
    clipping and drain of :class:`_RingRun` without its claims exchange; every row travels
    straight from its sender, so ``decide`` gets the chunk norms of the rows themselves."""

    def run(self) -> np.ndarray:
        n, peers = self.n, [m for m in self.members if m != self.me]
        with self.eng.endpoint.call(self.tag, peers, self.timeout) as call:
            if self.screen is None:
                check_finite(self.x, member=self.me)
            x = self.x
            if self.clip_norm is not None and all_finite(x):  # a non-finite one is screened out below
                x, _ = clip_l2(x, self.clip_norm)
            rows = self.eng._gather_rows(call, np.ascontiguousarray(x, np.float32), self.members, 1)
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
            self.eng._finish(call)
        return self.result

    def _screen_rows(self, rows: np.ndarray) -> None:
        """``decide`` on the rows' own chunk norms (what honest members claim); the chunks it
        bounds to 0 (excluded members, members without samples) count as zeros."""
        assert self.screen is not None
        n = self.n
        claims = np.stack([robust.chunk_norms(rows[j], n) for j in range(n)])
        bounds, _ = self.screen[1](claims)
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
