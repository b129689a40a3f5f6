"""Reliable, flow-controlled frame exchange over an unreliable transport, shared by the ring,
the broadcast and the star baseline.

An :class:`Endpoint` owns one member's transport. Every received frame is verified (checksum,
version, swarm) and routed, on the transport's own receive thread when the transport pushes
(``capabilities.push``, the MQTT transport), else by a background *pump* thread that polls ``recv``:

* frames of the active call's tag go to that call's inbox;
* frames of a tag this member already finished are *stale*: DATA is re-acknowledged (the
  sender lost our ACK and is retransmitting), everything else is ignored;
* frames of a tag this member aborted are stale too; a DATA sender gets one ABORT reply so it
  stops waiting for us;
* frames of an unknown tag are *early* (a faster member already started the next call):
  they are buffered without ACK (so each sender can have at most ``max_in_flight`` of them,
  the buffer is bounded by the senders' windows) for at most ``max_early_tags`` tags, oldest
  dropped first, and handed to the call when it starts.

A :class:`Call` is one collective operation under one tag with a deadline. DATA frames are
queued per destination and sent while fewer than ``max_in_flight`` are unacknowledged for that
peer (credit-based flow control: the ring never relies on a broker's queue depth). Every
received DATA frame is acknowledged, duplicates too (ACKs are batched: one ACK frame names
every frame received from that sender since the last one, flushed at half a window, when the
call drains, or when the oldest of them has waited ``ack_delay`` -- a twentieth of
``retransmit_after``, at most 20 ms -- while the call would otherwise wait: in a ring every
frame arrives alone, one hop after the last, so acknowledging at once cost one ACK message per
DATA frame), and is delivered to the algorithm once
(key = sender, phase, step, chunk, part). A frame not acknowledged within the retransmit
timeout (RTO) is sent again with exponential backoff (x2, at most 8x ``retransmit_after``); the
receiver's de-duplication makes that safe. RTO = max(``retransmit_after``, 4 x smoothed RTT),
capped at 8x ``retransmit_after``; RTT samples come only from frames sent once (Karn), so a
loaded broker or machine is not mistaken for loss. Retransmissions are bounded: a frame still
unacknowledged after ``max_retransmits`` retransmissions raises :class:`RetriesExhausted` (a
``RoundAborted`` naming the silent peer, so the call tells the others with an ABORT); every
retransmission is counted in ``Stats.retransmits`` and every give-up in
``Stats.retries_exhausted``. Frames that fail verification are dropped and counted
(``Stats.rejected``), so a corrupted frame is healed by the retransmit and never stalls the
round by itself.

Finishing a call: :meth:`Call.drain` waits until every frame we sent is acknowledged (the ring,
whose result depends on frames passing through each member); :meth:`Call.linger` returns at once
and leaves the unacknowledged frames to the endpoint, which retransmits them on a helper thread
until they are acknowledged, the peer aborts that tag, or the call's deadline plus grace passes
(all-to-all calls, where every peer needs every member's frames anyway: one hop per call less).
A lingering call leaves the ACKs it owes to the endpoint as well, and *moving on acknowledges*:
a peer's DATA of the call we are in means it is past our earlier calls, so our frames of those
count as acknowledged (``_moved_on``), and our DATA of the next call to a peer implies the ACKs
we owed it (``Endpoint._skip_owed``); the owed ones go out ``ack_delay`` late otherwise. In a
round's steps no ACK message travels at all. Only the active call's tag counts: a tag we have
not started may also be a stale one we will never run (a failed round's later step, delivered
late), which proves nothing about where its sender is now.

Aborts. A member that rejects an update (NaN/Inf) sends ABORT(member, rejected=true) to every
peer; receivers raise ``UpdateRejected`` at once. At the deadline a member sends
ABORT(member = the peer it was waiting for); a member receiving such a timeout ABORT before its
own deadline does the same. Both then listen until all peers but one have been heard from,
or at most a *grace* period of ``min(1 s, max(0.05 s, timeout / 4))``: every peer heard from
is alive, and the ``RoundAborted.member`` each survivor reports is the first blamed member
nobody heard from (a dead member's absence ripples down the ring, so survivors would
otherwise blame each other). Survivors therefore raise within ``timeout + grace``, usually
right after the last survivor's deadline.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from federation.errors import (
    FrameError,
    RetriesExhausted,
    RoundAborted,
    TransportError,
    UpdateRejected,
)
from federation.framing import (
    ACK_KEY,
    Frame,
    FrameKind,
    abort_info,
    ack_keys,
    decode,
    encode_abort,
    encode_ack,
)
from federation.stats import Stats
from federation.transport import Transport

# What a Call waits on: one peer, a function naming the peers it still needs, or nothing known.
Waiting = str | Callable[[], Iterable[str]] | None

__all__ = ["Endpoint", "Call", "grace_period"]

def _same_round(a: str, b: str) -> bool:
    """Whether two call tags belong to one round: tags ``ROUND/PHASE`` (edgenode's rounds) with
    the same ``ROUND``; tags without a ``/`` belong to no round."""
    return "/" in a and "/" in b and a.rsplit("/", 1)[0] == b.rsplit("/", 1)[0]


_DONE_TAGS = 256  # how many finished tags are remembered to recognise stale frames
_MAX_EARLY_FRAMES = 4096  # hard bound per early tag, on top of the senders' windows
_MAX_EARLY_BYTES = 64 << 20  # hard bound over all early tags (a misbehaving sender ignores windows)
_MAX_ACK_KEYS = 1024  # DATA frames named by one ACK frame (12 bytes each)
_MAX_ACK_DELAY_S = 0.02  # longest an acknowledgement waits for company (never past a drain)


class Endpoint:
    """One member's reliable frame layer on top of a :class:`Transport`."""

    def __init__(self, transport: Transport, *, swarm: str = "default", max_in_flight: int = 16,
                 retransmit_after: float = 1.0, max_early_tags: int = 4, stats: Stats | None = None,
                 max_retransmits: int = 100, ack_delay: float | None = None) -> None:
        """``ack_delay``: longest a received frame's acknowledgement waits to be batched with
        others while the call waits (default: a twentieth of ``retransmit_after``, at most 20 ms)."""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if not retransmit_after > 0:
            raise ValueError("retransmit_after must be > 0")
        if max_retransmits < 0:
            raise ValueError("max_retransmits must be >= 0")
        self.transport = transport
        self.member_id: str = transport.member_id
        self.swarm = swarm
        self.max_in_flight = max_in_flight
        self.retransmit_after = retransmit_after
        self.max_retransmits = max_retransmits
        self.ack_delay = min(_MAX_ACK_DELAY_S, retransmit_after / 20) if ack_delay is None else ack_delay
        if not 0 <= self.ack_delay < retransmit_after:
            raise ValueError("ack_delay must be >= 0 and below retransmit_after")
        self.max_early_tags = max_early_tags
        self.stats = stats or Stats()
        caps = transport.capabilities
        # A transport that authenticates every frame end to end (federation/signed.py) makes the
        # frame CRC redundant: not checked on receipt; not computed when ``framing.crc`` is False.
        self.check_crc = not caps.framing.authenticated
        # ``framing.room``: spare bytes after each frame, for a transport that seals it in place.
        self.frame_kw: dict[str, Any] = {"crc": caps.framing.crc, "room": caps.framing.room}
        self.clock = caps.clock  # a simulated network's clock (federation/linkmodel.py), or None
        self._srtt: float | None = None
        self._lock = threading.Lock()
        self._active: Call | None = None
        self._done: OrderedDict[str, str | None] = OrderedDict()  # tag -> None if ok else abort reason
        self._early: OrderedDict[str, dict[tuple, Frame]] = OrderedDict()
        self._early_bytes = 0
        self._abort_replied: set[tuple[str, str]] = set()
        # (round, peer) -> the peer's ABORT of a finished call of that round (it left the round)
        self._left: OrderedDict[tuple[str, str], Frame] = OrderedDict()
        # Arrival order of the frames routed to a call (Call._heard): a call blames the peer heard
        # from least recently by when frames *arrived*, not by when its thread got to them.
        self._arrivals = itertools.count()
        # Frames of finished calls still unacknowledged (Call.linger): (dst, tag, key) ->
        # [frame bytes, sent_at, rto, expires_at, retransmissions], retransmitted by a helper
        # thread (started on first use) until acknowledged, aborted by the peer, or expired.
        self._linger: dict[tuple[str, str, tuple], list] = {}
        # ACKs this member owes for frames of its own finished all-to-all calls, (peer, tag) ->
        # frames: sent by the same helper thread ``ack_delay`` after the oldest arrived, unless a
        # DATA frame of our next call to that peer goes first, which tells the peer as much
        # (a peer that moved on needs nothing more for earlier calls: see ``_moved_on``).
        self._owed: dict[tuple[str, str], list[Frame]] = {}
        self._owed_due = math.inf
        self._linger_cv = threading.Condition(self._lock)
        self._linger_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if caps.push:
            # Push transport (MQTT): frames are verified and routed on the transport's own
            # receive thread, one thread hand-off less per frame than a pump thread.
            transport.set_receiver(self._on_buffer)
        else:
            self._thread = threading.Thread(target=self._pump, name=f"fed-pump-{self.member_id}", daemon=True)
            self._thread.start()

    # -- sending -----------------------------------------------------------------------------
    def send(self, dst: str, data: bytes, **counters: int) -> bool:
        """Send one frame; transport errors count as a lost frame (retransmit heals it)."""
        try:
            self.transport.send(dst, data)
        except TransportError as e:
            self.stats.add(send_errors=1)
            self.stats.last_send_error = str(e)
            return False
        self.stats.add(bytes_sent=len(data), frames_sent=1, **counters)
        return True

    def rtt_sample(self, seconds: float) -> None:
        """Feed one ACK round-trip time (never from a retransmitted frame) into the estimate."""
        self._srtt = seconds if self._srtt is None else 0.875 * self._srtt + 0.125 * seconds

    def rto(self) -> float:
        """Retransmit timeout: ``retransmit_after``, stretched to 4x the smoothed RTT on a
        loaded machine or broker so that slow is not mistaken for lost."""
        base = self.retransmit_after
        return base if self._srtt is None else min(max(base, 4 * self._srtt), 8 * base)

    # -- receiving ---------------------------------------------------------------------------
    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                buf = self.transport.recv(0.05)
            except Exception:  # noqa: BLE001 - a closed/broken transport must not kill the pump
                time.sleep(0.05)
                continue
            if buf is not None:
                self._on_buffer(buf)

    def _on_buffer(self, buf: bytes | bytearray | memoryview) -> None:
        """Verify and route one received transport message (pump thread or transport thread)."""
        if self._stop.is_set():
            return
        self.stats.add(frames_received=1, bytes_received=len(buf))
        try:
            fr = decode(buf, check_crc=self.check_crc)
            if fr.swarm != self.swarm:
                self.stats.reject(f"frame for swarm {fr.swarm!r} from {fr.sender}")
                return
            self._route(fr)
        except FrameError as e:
            self.stats.reject(str(e))
        except Exception as e:  # noqa: BLE001 - one bad frame or send must not stop the receiver
            self.stats.reject(f"{type(e).__name__} while handling a frame: {e}")

    def _route(self, fr: Frame) -> None:
        reply: bytes | None = None
        counters: dict[str, int] = {}
        with self._lock:
            call = self._active
            if call is not None and fr.tag == call.tag:
                if self._linger and fr.kind == FrameKind.DATA:
                    self._moved_on(fr.sender)
                call.arrived(fr, next(self._arrivals))
                return
            if fr.tag in self._done:
                self.stats.add(stale=1)
                reason = self._done[fr.tag]
                if self._linger and fr.kind != FrameKind.DATA:
                    self._retire(fr)
                if fr.kind == FrameKind.ABORT and "/" in fr.tag:
                    # a peer gave up a call of a round we had already finished (a member relaying
                    # the fleet's abort while still in a call we left, e.g. a lingering exchange):
                    # it has left the round, so it takes part in no later call of it; waiting for
                    # it would last until our deadline. This call, or the next of the round.
                    if call is not None and fr.sender in call.peers and _same_round(fr.tag, call.tag):
                        call.arrived(fr, next(self._arrivals))
                        return
                    self._left[(fr.tag.rsplit("/", 1)[0], fr.sender)] = fr
                    while len(self._left) > _DONE_TAGS:
                        self._left.popitem(last=False)
                if fr.kind == FrameKind.DATA:
                    if reason is None:
                        reply = encode_ack(fr, sender=self.member_id, **self.frame_kw)
                        counters = {"acks_sent": 1}
                    elif (fr.tag, fr.sender) not in self._abort_replied:
                        if len(self._abort_replied) > 4096:  # bound memory; worst case one more reply
                            self._abort_replied.clear()
                        self._abort_replied.add((fr.tag, fr.sender))
                        why = f"{self.member_id} already aborted: {reason}"
                        reply = encode_abort(swarm=self.swarm, tag=fr.tag, sender=self.member_id,
                                             member=None, reason=why, **self.frame_kw)
                        counters = {"aborts_sent": 1}
            elif fr.kind == FrameKind.ACK:
                self.stats.add(stale=1)  # an ACK for a call we are not in: nothing to do
            else:
                box = self._early.get(fr.tag)
                if box is None:
                    while len(self._early) >= self.max_early_tags:
                        self._drop_early_tag()
                    box = self._early[fr.tag] = {}
                k = (fr.sender, fr.kind, fr.key)
                size = fr.size
                if k in box:
                    self.stats.add(duplicates=1)
                elif len(box) >= _MAX_EARLY_FRAMES or self._early_bytes + size > _MAX_EARLY_BYTES:
                    self.stats.add(early_dropped=1)  # not acked: the sender retransmits later
                else:
                    box[k] = fr
                    self._early_bytes += size
                    self.stats.add(early=1)
        if reply is not None:
            self.send(fr.sender, reply, **counters)

    def _drop_early_tag(self) -> None:
        dropped = self._early.popitem(last=False)[1]
        self._early_bytes -= sum(f.size for f in dropped.values())
        self.stats.add(early_dropped=len(dropped))

    # -- frames of finished calls (Call.linger) ------------------------------------------------
    def _moved_on(self, peer: str) -> None:
        """``peer`` sent DATA of the call this member is in, so it has finished or given up every
        call before that one: it needs nothing more from us for them, and our frames of those
        (all finished, lingering) count as acknowledged (``acks_implied``). Lock held."""
        gone = _drop(self._linger, peer)
        if gone:
            self.stats.add(acks_implied=gone)

    def _skip_owed(self, peer: str) -> None:
        """A DATA frame of our next call goes to ``peer``: the ACKs we owe it for earlier calls are
        implied by it (``_moved_on`` on its side, when it gets there) and need not be sent
        (``acks_skipped``)."""
        with self._lock:
            gone = _drop(self._owed, peer)
            if not self._owed:
                self._owed_due = math.inf
        if gone:
            self.stats.add(acks_skipped=gone)

    def ack_frames(self, frames: list[Frame]) -> Iterator[bytes]:
        """The ACK frames acknowledging ``frames`` (one tag and sender), batched."""
        me = self.member_id
        while frames:
            # as many keys as the transport's message holds: an ACK over max_payload is refused
            # by the transport, and its frames then wait for retransmits to be acknowledged
            head = len(encode_ack(frames[0], sender=me, **self.frame_kw))
            n = 1 + min(_MAX_ACK_KEYS - 1, max(0, self.transport.max_payload - head) // ACK_KEY.size)
            batch, frames = frames[:n], frames[n:]
            yield encode_ack(batch[0], sender=me, more=batch[1:], **self.frame_kw)

    def _retire(self, fr: Frame) -> None:
        """An ACK (or an ABORT: the peer gave the call up) for a finished call's frames. Lock held."""
        if fr.kind == FrameKind.ACK:
            for key in ack_keys(fr):
                self._linger.pop((fr.sender, fr.tag, key), None)
        elif fr.kind == FrameKind.ABORT:
            _drop(self._linger, fr.sender, fr.tag)

    def _adopt(self, c: Call) -> None:
        """Take over ``c``'s unacknowledged frames when it finishes (lock held)."""
        expires = c.deadline + grace_period(c.timeout)
        for (dst, key), ent in c._unacked.items():
            self._linger[(dst, c.tag, key)] = [ent[0], ent[1], ent[2], expires, ent[4]]
        c._unacked = {}
        for sender, frames in c._acks.items():  # the call finished without flushing them (linger)
            self._owed.setdefault((sender, c.tag), []).extend(frames)
            self._owed_due = min(self._owed_due, c._ack_due)
        c._acks = {}
        while True:  # ACKs that reached the call's inbox after its last wait
            try:
                fr = c.inbox.get_nowait()
            except queue.Empty:
                break
            if fr is not None and fr.kind != FrameKind.DATA:
                self._retire(fr)
        idle = self._linger_thread is None or not self._linger_thread.is_alive()
        if (self._linger or self._owed) and idle:
            self._linger_thread = threading.Thread(target=self._linger_loop, daemon=True,
                                                   name=f"fed-linger-{self.member_id}")
            self._linger_thread.start()
        self._linger_cv.notify_all()

    def _linger_loop(self) -> None:
        """Retransmit finished calls' unacknowledged frames (as a call would), drop the expired."""
        while not self._stop.is_set():
            resend: list[tuple[str, bytes]] = []
            owed: list[tuple[str, list[Frame]]] = []
            with self._lock:
                now = time.monotonic()
                if now >= self._owed_due:
                    owed = [(k[0], f) for k, f in self._owed.items()]
                    self._owed, self._owed_due = {}, math.inf
                cap = 8 * self.retransmit_after
                for k, ent in list(self._linger.items()):
                    if now >= ent[3] or (now - ent[1] >= ent[2] and ent[4] >= self.max_retransmits):
                        del self._linger[k]  # the peer's own deadline has passed: it gave up too
                        self.stats.add(linger_expired=1)
                    elif now - ent[1] >= ent[2]:
                        resend.append((k[0], ent[0]))
                        ent[1], ent[2], ent[4] = now, _backoff(ent[2], cap), ent[4] + 1
                if not resend and not owed:
                    due = min((min(e[1] + e[2], e[3]) for e in self._linger.values()), default=math.inf)
                    due = min(due, self._owed_due)
                    self._linger_cv.wait(None if due == math.inf else max(0.0, due - now))
                    continue
            for peer, frames in owed:
                for ack in self.ack_frames(frames):
                    self.send(peer, ack, acks_sent=1)
            for dst, data in resend:
                self.send(dst, data, retransmits=1)

    # -- calls -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self, tag: str, peers: list[str], timeout: float) -> Iterator[Call]:
        """Run one collective under ``tag`` with ``peers`` (other members) and a deadline.

        Leaving the block normally marks the tag finished; an exception marks it aborted and,
        unless the abort came from a peer, tells every peer with an ABORT frame.
        """
        if not tag:
            raise ValueError("tag must be a non-empty string")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        c = Call(self, tag, peers, timeout)
        with self._lock:
            if self._active is not None:
                raise RuntimeError(f"{self.member_id}: call {self._active.tag!r} still running")
            if tag in self._done:
                raise ValueError(f"tag {tag!r} already used by {self.member_id}: each call needs a new tag")
            for fr in self._early.pop(tag, {}).values():
                self._early_bytes -= fr.size
                if self._linger and fr.kind == FrameKind.DATA:
                    self._moved_on(fr.sender)  # a row of this call that came before we started it
                c.arrived(fr, next(self._arrivals))  # in the order the early frames came
            if "/" in tag:  # peers that left this round before the call began (see _route)
                for p in peers:
                    left = self._left.get((tag.rsplit("/", 1)[0], p))
                    if left is not None:
                        c.arrived(left, next(self._arrivals))
            self._active = c
        reason: str | None = None
        try:
            yield c
            if not c.lingering or self.ack_delay == 0:
                c.flush_acks()
        except RoundAborted as e:
            reason = str(e)
            c.broadcast_abort(e.member, reason, rejected=isinstance(e, UpdateRejected))
            raise
        except BaseException as e:
            reason = f"{type(e).__name__}: {e}"
            c.broadcast_abort(self.member_id, f"{self.member_id} failed: {reason}")
            raise
        finally:
            with self._lock:
                self._active = None
                if c.lingering and reason is None:
                    self._adopt(c)
                self._done[tag] = reason
                while len(self._done) > _DONE_TAGS:
                    self._done.popitem(last=False)

    def cancel(self, reason: str) -> bool:
        """Fail the running call now (e.g. the fleet aborted the round): its ``wait`` raises
        RoundAborted, and the call's exit sends ABORT to every peer, so nobody waits for the
        deadline. Returns whether a call was running. Thread-safe."""
        with self._lock:
            c = self._active
            if c is None:
                return False
            c.cancelled = reason
            c.inbox.put(None)
            return True

    def close(self) -> None:
        """Stop the pump thread and close the transport."""
        self._stop.set()
        with self._lock:
            self._linger.clear()
            self._owed.clear()
            self._linger_cv.notify_all()
        for t in (self._thread, self._linger_thread):
            if t is not None:
                t.join(timeout=1.0)
        with contextlib.suppress(Exception):
            self.transport.close()


class Call:
    """Reliable exchange for one tag: windowed sends, ACKs, retransmits, de-dup, deadline."""

    def __init__(self, ep: Endpoint, tag: str, peers: list[str], timeout: float) -> None:
        self.ep = ep
        self.tag = tag
        self.peers = set(peers)
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.inbox: queue.SimpleQueue[Frame | None] = queue.SimpleQueue()  # None: cancel() wakes us
        self.cancelled: str | None = None
        self.abort_sent = False  # our ABORT already went out (or a peer's made it pointless)
        self.lingering = False  # linger(): unacknowledged frames go to the endpoint at exit
        self._received: set[tuple] = set()
        # sender -> arrival order (Endpoint._arrivals) of its newest frame of this call: names the
        # silent peer at a deadline when we wait on several (see _timeout_abort). Written by the
        # endpoint's receiver as frames arrive, so a call whose own thread was starved past its
        # deadline (a loaded board) still knows who was heard from before it, frames it has not
        # handled yet included, and never takes a peer still sending for the silent one.
        self._heard: dict[str, int] = {}
        self._pending: dict[str, deque[tuple[tuple, Callable[[], bytes]]]] = {}
        # (dst, key) -> [frame bytes, sent_at, rto, first_sent|None, retransmissions so far]
        self._unacked: dict[tuple, list] = {}
        self._inflight: dict[str, int] = {}
        # DATA frames received but not yet acknowledged, per sender: ACKs go out in batches
        # (half a window, a drain, or ``ep.ack_delay`` after the oldest), not one message per frame.
        self._acks: dict[str, list[Frame]] = {}
        self._ack_batch = max(1, ep.max_in_flight // 2)
        self._ack_due = math.inf  # when the oldest pending acknowledgement must go out

    # -- sending -----------------------------------------------------------------------------
    def queue(self, dst: str, key: tuple, build: Callable[[], bytes]) -> None:
        """Queue a DATA frame for ``dst``; ``build()`` makes its bytes when the window allows."""
        self._pending.setdefault(dst, deque()).append((key, build))

    def _send_ready(self) -> None:
        ep, limit = self.ep, self.ep.max_in_flight
        for dst, q in self._pending.items():
            if q and ep._owed:
                ep._skip_owed(dst)
            while q and self._inflight.get(dst, 0) < limit:
                key, build = q.popleft()
                data = build()
                now = time.monotonic()
                ep.send(dst, data, data_frames_sent=1)
                self._unacked[(dst, key)] = [data, now, ep.rto(), now, 0]
                self._inflight[dst] = self._inflight.get(dst, 0) + 1

    def _retransmit(self) -> None:
        now = time.monotonic()
        cap = 8 * self.ep.retransmit_after
        for (dst, key), ent in self._unacked.items():
            if now - ent[1] >= ent[2]:
                if ent[4] >= self.ep.max_retransmits:
                    self.ep.stats.add(retries_exhausted=1)
                    raise RetriesExhausted(
                        f"{dst} did not acknowledge frame {key} of {self.tag!r} after "
                        f"{ent[4]} retransmissions", member=dst,
                        hint="check that the peer is alive and reachable (max_retransmits bounds this)")
                ent[4] += 1
                self.ep.send(dst, ent[0], retransmits=1)
                ent[1] = now
                ent[2] = _backoff(ent[2], cap)
                ent[3] = None  # Karn: no RTT sample from a retransmitted frame

    def flushed(self) -> bool:
        """Everything queued was sent and acknowledged."""
        return not self._unacked and not any(self._pending.values())

    def unacked_peer(self) -> str | None:
        """A peer we are waiting on for acknowledgements (for error messages)."""
        for dst, _ in self._unacked:
            return dst
        for dst, q in self._pending.items():
            if q:
                return dst
        return None

    # -- receiving ---------------------------------------------------------------------------
    def arrived(self, fr: Frame, order: int) -> None:
        """The endpoint's receiver hands over a frame of this call (``order``: its arrival order)."""
        if fr.sender in self.peers:
            self._heard[fr.sender] = order
        self.inbox.put(fr)

    def wait(self, waiting_for: Waiting, *, raise_on_deadline: bool = True) -> Frame | None:
        """Make progress: send what the window allows, retransmit what is overdue, and return
        the next *new* DATA frame (already acknowledged), or None if nothing new came yet.

        ``waiting_for`` is the peer whose frames we need next, or a function returning the peers
        we still need frames from (an exchange, which needs every peer at once): at a deadline we
        blame the one of them we heard from least recently, not a slow one still sending.

        At the deadline (or on a peer's timeout ABORT) raises :class:`RoundAborted` after a
        short vote that names the member nobody heard from (see :meth:`_timeout_abort`); a
        peer's ABORT for a rejected update raises :class:`UpdateRejected` at once.
        """
        if self.cancelled is not None:
            raise RoundAborted(f"round {self.tag!r} cancelled: {self.cancelled}", member=self.ep.member_id)
        self._send_ready()
        now = time.monotonic()
        if self._acks and now >= self._ack_due:
            self.flush_acks()  # the oldest waited long enough for company
        if now >= self.deadline:
            if not raise_on_deadline:
                return None
            self._timeout_abort(waiting_for, None)
        due = min((e[1] + e[2] for e in self._unacked.values()), default=math.inf)
        try:
            fr = self.inbox.get(timeout=max(0.0, min(self.deadline, due, self._ack_due) - now))
        except queue.Empty:
            if time.monotonic() >= due:
                self._retransmit()
            return None
        if fr is None:  # cancel(): the next wait() raises
            return None
        if time.monotonic() >= due:
            self._retransmit()
        got = self._handle(fr, waiting_for)
        if got is not None and self.ep.clock is not None:
            self.ep.clock.consumed(self.ep.member_id, got)
        return got

    def _handle(self, fr: Frame, waiting_for: Waiting) -> Frame | None:
        if fr.sender not in self.peers:
            self.ep.stats.reject(f"{fr.kind.name} for {fr.tag!r} from non-member {fr.sender}")
            return None
        now = time.monotonic()
        if fr.kind == FrameKind.ACK:
            for key in ack_keys(fr):
                ent = self._unacked.pop((fr.sender, key), None)
                if ent is not None:
                    self._inflight[fr.sender] -= 1
                    if ent[3] is not None:
                        self.ep.rtt_sample(now - ent[3])
            return None
        if fr.kind == FrameKind.ABORT:
            member, reason, rejected = _abort_fields(fr)
            if rejected:
                self.abort_sent = True  # the sender told everyone already
                raise UpdateRejected(f"round {self.tag!r} aborted by {fr.sender}: {reason}", member=member)
            self._timeout_abort(waiting_for, (fr.sender, member, reason))
        if not self._acks:
            self._ack_due = time.monotonic() + self.ep.ack_delay
        due = self._acks.setdefault(fr.sender, [])
        due.append(fr)
        if len(due) >= self._ack_batch:
            self._flush_acks_to(fr.sender)
        k = (fr.sender, fr.key)
        if k in self._received:
            self.ep.stats.add(duplicates=1)
            return None
        self._received.add(k)
        return fr

    def flush_acks(self) -> None:
        """Send every pending acknowledgement now (batched: one ACK frame per sender)."""
        for sender in list(self._acks):
            self._flush_acks_to(sender)

    def _flush_acks_to(self, sender: str) -> None:
        frames = self._acks.pop(sender, None)
        if not self._acks:
            self._ack_due = math.inf
        for ack in self.ep.ack_frames(frames or []):
            self.ep.send(sender, ack, acks_sent=1)

    def _silent(self, waiting_for: Waiting) -> str | None:
        """The peer to blame at a deadline: ``waiting_for``, or of several the one heard from
        least recently (by arrival, frames not handled yet included; never heard first, ties in
        the order given), or an unacknowledging one."""
        if callable(waiting_for):
            order = list(waiting_for())
            return min(order, key=lambda m: self._heard.get(m, -math.inf), default=None)
        return waiting_for if waiting_for is not None else self.unacked_peer()

    def _timeout_abort(self, waiting_for: Waiting, first: tuple[str, str | None, str] | None) -> None:
        """Abort on a deadline (ours or a peer's) and name the member that is really gone.

        Every member that times out blames the peer it was waiting for, so a dead member's
        absence ripples down the ring and the survivors blame each other too. Each member
        therefore broadcasts its ABORT and listens for ``grace`` seconds: whoever sends anything
        is alive, and the culprit is the blamed member nobody heard from (of several, the one
        silent longest: a slow member still sending is not the dead one).
        """
        me = self.ep.member_id
        mine = self._silent(waiting_for)
        if first is None:
            reason = f"{me} got nothing from {mine} within {self.timeout:g}s"
        else:
            reason = f"{first[0]}: {first[2]}"
        self.broadcast_abort(mine, reason)
        alive, blamed = {me}, []
        if first is not None:
            alive.add(first[0])
            blamed.append(first[1])
        blamed.append(mine)
        end = time.monotonic() + grace_period(self.timeout)
        # Stop early once at most one peer is unheard: that one is the culprit.
        while len(self.peers - alive) > 1 and (left := end - time.monotonic()) > 0:
            try:
                fr = self.inbox.get(timeout=left)
            except queue.Empty:
                break
            if fr is None or fr.sender not in self.peers:
                continue
            alive.add(fr.sender)
            if fr.kind == FrameKind.ABORT:
                member, why, rejected = _abort_fields(fr)
                if rejected:
                    raise UpdateRejected(f"round {self.tag!r} aborted by {fr.sender}: {why}", member=member)
                blamed.append(member)
        named = [m for m in blamed if m is not None]
        # Of the blamed members nobody heard from in the grace period, the one silent longest.
        unheard = [m for m in named if m not in alive]
        culprit = (min(unheard, key=lambda m: self._heard.get(m, -math.inf)) if unheard
                   else named[0] if named else None)
        raise RoundAborted(
            f"round {self.tag!r} aborted: no progress from {culprit} ({reason})", member=culprit,
            hint="the member is dead, partitioned or too slow; re-form the ring without it",
        )

    def drain(self) -> None:
        """Wait until everything we sent is acknowledged; at the deadline give up quietly
        (our own result is complete; the receiver's fate is its own deadline's business).
        A peer's ABORT still raises."""
        self._settle(self.flushed)

    def linger(self) -> None:
        """Finish without waiting for acknowledgements (instead of :meth:`drain`): for a call
        whose every peer needs every member's frames to finish it, so a peer that lacks ours fails
        (or retransmits heal it) whether or not we wait. Sends what the window still holds back,
        then leaves the unacknowledged frames to the endpoint, which retransmits them as the call
        would until they are acknowledged, the peer aborts the call, or the call's deadline plus
        grace passes. Saves the ACK's hop per call: the caller's next call starts at once.
        The ACKs this call still owes are left to the endpoint too (sent ``ack_delay`` after the
        oldest, unless our DATA of the next call to that peer implies them first)."""
        self._settle(lambda: not any(self._pending.values()), flush=False)
        self.lingering = True

    def _settle(self, done: Callable[[], bool], *, flush: bool = True) -> None:
        """Send every pending ACK (``flush``), then keep the call going until ``done()`` or the
        deadline."""
        if flush:
            self.flush_acks()
        while not done():
            if time.monotonic() >= self.deadline:
                return
            fr = self.wait(None, raise_on_deadline=False)
            if fr is not None:
                self.ep.stats.reject(f"unexpected DATA {fr.key} from {fr.sender} after completion")

    def broadcast_abort(self, member: str | None, reason: str, *, rejected: bool = False) -> None:
        """Tell every peer (best effort, no ACK) that this tag is aborted."""
        if self.abort_sent:
            return
        self.abort_sent = True
        data = encode_abort(swarm=self.ep.swarm, tag=self.tag, sender=self.ep.member_id, member=member,
                            reason=reason, rejected=rejected, **self.ep.frame_kw)
        for p in sorted(self.peers):
            self.ep.send(p, data, aborts_sent=1)


def _drop(d: dict[Any, Any], *prefix: str) -> int:
    """Delete the entries of ``d`` whose tuple key starts with ``prefix``; returns how many."""
    n = len(prefix)
    gone = [k for k in d if k[:n] == prefix]
    for k in gone:
        del d[k]
    return len(gone)


def _backoff(rto: float, cap: float) -> float:
    """The next retransmit timeout: doubled, never above ``cap`` (unless it already was)."""
    return min(rto * 2, max(cap, rto))


def grace_period(timeout: float) -> float:
    """How long a timed-out member listens for its peers' ABORTs before naming the culprit."""
    return min(1.0, max(0.05, 0.25 * timeout))


def _abort_fields(fr: Frame) -> tuple[str | None, str, bool]:
    try:
        return abort_info(fr)
    except FrameError as e:
        return fr.sender, str(e), False
