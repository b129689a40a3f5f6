"""Star allreduce: the FedAvg-style baseline the ring is compared against.

The coordinator is ``sorted(group)[0]``. Every other member sends its whole (checked,
clipped, encoded) vector to the coordinator (phase GATHER); the coordinator adds the parts in
arrival order, applies the op, encodes each final part once and sends those same bytes to
every member (phase SCATTER); every member, the coordinator too, decodes exactly those bytes,
so results are bit-identical. Reliability (ACKs, window per peer, retransmit, de-dup,
deadline, ABORT) is the shared :mod:`federation.session` layer, as for the ring.

Traffic: each member sends L x 4 bytes, the coordinator (n - 1) x L x 4, so the coordinator's
link is the bottleneck that the ring avoids (ring: 2 (n - 1) / n x L x 4 per member).
"""

from __future__ import annotations

import functools

import numpy as np

from federation import compression as comp
from federation import schedule as sch
from federation.checks import all_finite, check_finite, clip_l2
from federation.collective import CollectiveBase, Feedback, ReduceOp, as_vector, ordered_group, violation
from federation.errors import RoundAborted, UpdateRejected
from federation.framing import Codec, FrameKind, Phase, encode
from federation.modes import Compression
from federation.session import Call

__all__ = ["StarAllreduce"]


class StarAllreduce(CollectiveBase):
    """Same ``allreduce`` API as the ring; the coordinator is ``sorted(group)[0]``."""

    def allreduce(self, vec: np.ndarray, *, group: list[str], tag: str, op: ReduceOp | str = "mean",
                  timeout: float = 30.0, compression: Compression | str = Compression.NONE,
                  clip_norm: float | None = None) -> np.ndarray:
        """Sum or mean of every member's ``vec`` via the coordinator; bit-identical everywhere."""
        x = as_vector(vec)
        op = ReduceOp(op)
        codec = comp.codec_for(compression)
        members = ordered_group(group, self.member_id)
        with self._lock:
            return _StarRun(self, x, members, tag, op, timeout, codec, clip_norm).run()


class _StarRun:
    def __init__(self, eng: StarAllreduce, x: np.ndarray, members: list[str], tag: str, op: ReduceOp,
                 timeout: float, codec: Codec, clip_norm: float | None) -> None:
        self.eng, self.x, self.members, self.tag, self.op = eng, x, members, tag, op
        self.timeout, self.codec, self.clip_norm = timeout, codec, clip_norm
        self.me, self.coord, self.n, self.L = eng.member_id, members[0], len(members), x.size
        self.parts = sch.part_bounds(0, self.L, comp.per_part(codec, eng.max_payload, eng.topk_ratio))

    def _frame(self, phase: Phase, part: int, pieces: list) -> bytes:
        a, b = self.parts[part]
        return encode(FrameKind.DATA, phase, swarm=self.eng.swarm, tag=self.tag, sender=self.me,
                      codec=self.codec, part=part, nparts=len(self.parts), offset=a, count=b - a,
                      total=self.L, payload=pieces, **self.eng.endpoint.frame_kw)

    def _encode(self, part: int) -> list:
        a, b = self.parts[part]
        res = self.residual
        return comp.encode(self.codec, self.work[a:b], None if res is None else res[a:b],
                           topk_ratio=self.eng.topk_ratio)

    def _check(self, fr, phase: Phase, sender: str) -> tuple[int, int]:
        if (fr.phase != phase or (phase == Phase.SCATTER and fr.sender != sender) or fr.codec != self.codec
                or fr.total != self.L or fr.nparts != len(self.parts)
                or self.parts[fr.part] != (fr.offset, fr.offset + fr.count)):
            violation(fr, "unexpected star frame (same vector length and max_payload everywhere?)")
        a, b = self.parts[fr.part]
        return a, b

    def run(self) -> np.ndarray:
        peers = [m for m in self.members if m != self.me]
        key = ("star", tuple(self.members), self.op, self.codec, self.L, self.eng.topk_ratio)
        with self.eng.endpoint.call(self.tag, peers, self.timeout) as call:
            check_finite(self.x, member=self.me)
            self.work = np.array(clip_l2(self.x, self.clip_norm)[0], dtype=np.float32, copy=True)
            fb = self.eng._feedback
            self.residual = None
            if self.codec in comp.FEEDBACK_CODECS:
                self.residual = fb.residual.copy() if fb is not None and fb.key == key else np.zeros(self.L,
                                                                                                    np.float32)
            # Results land in the work buffer (no second 4L-byte buffer): the coordinator
            # cannot send part p back before our part p, built from work when sent, arrived.
            self.result = self.work
            if self.me == self.coord:
                self._coordinate(call, peers)
            else:
                self._member(call)
            call.drain()
        if self.residual is not None:
            self.eng._feedback = Feedback(key, self.residual)
        return self.result

    def _gather_frame(self, p: int) -> bytes:
        return self._frame(Phase.GATHER, p, self._encode(p))

    def _member(self, call: Call) -> None:
        for p in range(len(self.parts)):
            call.queue(self.coord, (Phase.GATHER, 0, 0, p), functools.partial(self._gather_frame, p))
        pending = set(range(len(self.parts)))
        while pending:
            fr = call.wait(self.coord)
            if fr is None:
                continue
            a, b = self._check(fr, Phase.SCATTER, self.coord)
            vals = comp.decode(self.codec, fr.payload, b - a)
            if not all_finite(vals):
                raise UpdateRejected(f"round {self.tag!r}: result from {fr.sender} is not finite",
                                     member=fr.sender)
            self.result[a:b] = vals
            pending.discard(fr.part)

    def _coordinate(self, call: Call, peers: list[str]) -> None:
        missing = {p: set(peers) for p in range(len(self.parts))}
        for p in [p for p, who in missing.items() if not who]:
            self._finish_part(call, peers, p)  # n == 1: nothing to wait for
            del missing[p]
        while missing:
            waiting = sorted({m for who in missing.values() for m in who})
            fr = call.wait(waiting[0])
            if fr is None:
                continue
            a, b = self._check(fr, Phase.GATHER, fr.sender)
            if fr.sender not in missing.get(fr.part, ()):
                violation(fr, "unexpected star frame")
            vals = comp.decode(self.codec, fr.payload, b - a)
            if not all_finite(vals):
                raise UpdateRejected(f"round {self.tag!r}: update from {fr.sender} is not finite",
                                     member=fr.sender)
            self.work[a:b] += vals
            missing[fr.part].discard(fr.sender)
            if not missing[fr.part]:
                del missing[fr.part]
                self._finish_part(call, peers, fr.part)

    def _finish_part(self, call: Call, peers: list[str], p: int) -> None:
        a, b = self.parts[p]
        w = self.work[a:b]
        if self.op == ReduceOp.MEAN:
            np.divide(w, np.float32(self.n), out=w)
        if not all_finite(w):
            raise RoundAborted(f"round {self.tag!r}: the reduced sum overflowed float32 on {self.me}",
                               member=self.me)
        pieces = self._encode(p)
        payload = comp.join_pieces(pieces)
        self.result[a:b] = comp.decode(self.codec, payload, b - a)
        frame = self._frame(Phase.SCATTER, p, [payload])
        for m in peers:
            call.queue(m, (Phase.SCATTER, 0, 0, p), functools.partial(bytes, frame))
