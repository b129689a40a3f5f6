"""The allreduce :class:`~federation.transport.Transport` over MQTT.

By default (``flow_control=False``) a transport is a thin pipe: ``send(dst, p)`` publishes ``p``
unchanged at QoS 1 on ``fractal/v1/{swarm}/ar/{dst}`` and every message on this member's topic
lands in its inbox. The ring engine above frames, acknowledges, bounds what is in flight per
peer and retransmits (``federation/ring.py``), which is what the swarm protocol uses.

With ``flow_control=True`` the transport adds its own *link layer* for users that move bytes
without such an engine (both ends must enable it). Why a link layer: Mosquitto silently drops
QoS 1 messages once a subscriber's queue passes ``max_queued_messages`` (measured: 2000
publishes -> 1909 delivered), and a broker restart loses whatever it held. So every payload
travels in a small *link envelope* with a sequence number; the receiver acknowledges it on
``topics.ack(swarm, sender)`` as soon as it is in its inbox; the sender keeps at most
``window`` unacknowledged messages per peer (the rest wait in a local backlog, so
:meth:`MqttTransport.send` never blocks) and re-publishes what stays unacknowledged for
``retransmit_s``. The receiver drops duplicates (QoS 1 redelivery, retransmits) before they
reach the inbox. Byte layout (big-endian)::

    DATA on fractal/v1/{swarm}/ar/{dst}:
        magic "FL" | ver u8 = 1 | kind u8 = 1 | nonce u32 | seq u64 | src_len u8 | src | payload
    ACK on fractal/v1/{swarm}/ack/{src}:
        magic "FL" | ver u8 = 1 | kind u8 = 2 | nonce u32 | count u16 | from_len u8 | from | seq u64 * count

``nonce`` is random per transport instance, so a restarted member's new sequence numbers are
never mistaken for duplicates of its previous life. ``payload`` is opaque here (a ring frame,
see ``federation/framing.py``).
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from federation import topics
from federation.errors import FrameError, TransportError

__all__ = ["PubSubLink", "LinkKind", "LINK_VERSION", "MqttTransport", "encode_data", "decode_data",
           "encode_ack", "decode_ack", "ENVELOPE_OVERHEAD"]

log = logging.getLogger(__name__)


class _Cancellable(Protocol):
    def cancel(self) -> None: ...


class PubSubLink(Protocol):
    """What a transport needs from its MQTT connection (:class:`federation.mqtt.MqttLink` is one).

    Declared here so this module never imports :mod:`federation.mqtt`: the link builds
    transports, transports only see this interface (no import cycle).
    """

    swarm: str

    def publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1) -> object: ...

    def subscribe(self, filter: str, callback: Callable[[str, bytes], None], *, inline: bool = False,
                  copy: bool = True) -> _Cancellable: ...

    def on_connect(self, hook: Callable[[bool], None]) -> None: ...

LINK_VERSION = 1
_MAGIC = b"FL"
_DATA = struct.Struct(">2sBBIQB")  # magic, version, kind, nonce, seq, src_len
_ACK = struct.Struct(">2sBBIHB")  # magic, version, kind, nonce, count, from_len
ENVELOPE_OVERHEAD = _DATA.size + 64  # upper bound (ids are at most 64 bytes)


class LinkKind(enum.IntEnum):
    DATA = 1
    ACK = 2


def encode_data(nonce: int, seq: int, src: str, payload: bytes) -> bytes:
    s = src.encode()
    return _DATA.pack(_MAGIC, LINK_VERSION, LinkKind.DATA, nonce, seq, len(s)) + s + payload


def decode_data(buf: bytes) -> tuple[int, int, str, bytes]:
    """-> (nonce, seq, src, payload); FrameError on anything malformed."""
    if len(buf) < _DATA.size:
        raise FrameError(f"link frame too short ({len(buf)} bytes)")
    magic, ver, kind, nonce, seq, n = _DATA.unpack_from(buf)
    if magic != _MAGIC or ver != LINK_VERSION or kind != LinkKind.DATA:
        raise FrameError(f"not a v{LINK_VERSION} link DATA frame (magic={magic!r} v={ver} kind={kind})")
    end = _DATA.size + n
    try:
        src = topics.validate_id(bytes(buf[_DATA.size:end]).decode(), "sender")
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"bad sender in link frame: {exc}") from None
    return nonce, seq, src, bytes(buf[end:])


def encode_ack(nonce: int, acker: str, seqs: list[int]) -> bytes:
    a = acker.encode()
    return (_ACK.pack(_MAGIC, LINK_VERSION, LinkKind.ACK, nonce, len(seqs), len(a)) + a
            + struct.pack(f">{len(seqs)}Q", *seqs))


def decode_ack(buf: bytes) -> tuple[int, str, list[int]]:
    if len(buf) < _ACK.size:
        raise FrameError("ack too short")
    magic, ver, kind, nonce, count, n = _ACK.unpack_from(buf)
    if (magic != _MAGIC or ver != LINK_VERSION or kind != LinkKind.ACK
            or len(buf) != _ACK.size + n + 8 * count):
        raise FrameError("malformed link ACK")
    acker = bytes(buf[_ACK.size:_ACK.size + n]).decode(errors="replace")
    return nonce, acker, list(struct.unpack_from(f">{count}Q", buf, _ACK.size + n))


@dataclass
class _Peer:
    """Sender-side state towards one destination."""

    inflight: dict[int, list] = field(default_factory=dict)  # seq -> [envelope, sent_at, tries]
    backlog: deque = field(default_factory=deque)  # (seq, envelope) waiting for window space


@dataclass
class _Seen:
    """Receiver-side duplicate filter for one (sender, nonce): all seq <= low were seen."""

    low: int = 0
    above: set[int] = field(default_factory=set)

    def add(self, seq: int) -> bool:
        if seq <= self.low or seq in self.above:
            return False
        self.above.add(seq)
        while self.low + 1 in self.above:
            self.low += 1
            self.above.discard(self.low)
        return True


class MqttTransport:
    """See module docstring. Created by :meth:`federation.mqtt.MqttLink.transport`."""

    def __init__(self, link: PubSubLink, member_id: str, *, max_payload: int = 256 * 1024, window: int = 16,
                 retransmit_s: float = 3.0, give_up_s: float = 120.0, flow_control: bool = False) -> None:
        if window < 1 or max_payload < 64:
            raise TransportError("window must be >= 1 and max_payload >= 64 bytes")
        self.link = link
        self.member_id = topics.validate_id(member_id, "member id")
        self.max_payload = int(max_payload)
        self.window = int(window)
        self.retransmit_s = float(retransmit_s)
        self.give_up_s = float(give_up_s)
        self.closed = False
        self.flow_control = flow_control
        self.stats = {"sent": 0, "sent_bytes": 0, "payload_bytes": 0, "retransmits": 0, "received": 0,
                      "duplicates": 0, "rejected": 0, "acks_sent": 0, "acks_received": 0, "given_up": 0}
        self._nonce = int.from_bytes(os.urandom(4), "big")
        self._seq = 0
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._seen: dict[tuple[str, int], _Seen] = {}
        self._inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._receiver: Callable[[bytes], None] | None = None
        self._acks: dict[tuple[str, int], list[int]] = {}  # (sender, its nonce) -> seqs to ack
        self._wake = threading.Event()
        swarm = link.swarm
        # Inline: the handlers only parse, enqueue and publish; they never wait.
        self._subs: list[_Cancellable] = [
            link.subscribe(topics.allreduce(swarm, member_id),
                           self._on_data if flow_control else self._on_raw, inline=True, copy=False)]
        if flow_control:
            self._subs.append(link.subscribe(topics.ack(swarm, member_id), self._on_ack, inline=True))
            link.on_connect(self._on_reconnect)
            self._pump = threading.Thread(target=self._run, name=f"mqtt-transport:{member_id}", daemon=True)
            self._pump.start()

    # --- Transport API ------------------------------------------------------------------------
    def send(self, dst: str, payload: bytes) -> None:
        """Queue ``payload`` for ``dst``; publishes now if the peer's window has room."""
        if self.closed:
            raise TransportError(f"transport of {self.member_id} is closed")
        if len(payload) > self.max_payload:
            raise TransportError(f"payload of {len(payload)} bytes exceeds max_payload={self.max_payload}",
                                 hint="split it with the framing layer")
        if dst == self.member_id:  # a ring of one, or a root broadcasting to itself
            self._deliver(bytes(payload))
            return
        if not self.flow_control:
            self.stats["payload_bytes"] += len(payload)
            self._publish([(dst, bytes(payload))])
            return
        with self._lock:
            self._seq += 1
            env = encode_data(self._nonce, self._seq, self.member_id, payload)
            peer = self._peers.setdefault(dst, _Peer())
            self.stats["payload_bytes"] += len(payload)
            if len(peer.inflight) < self.window and not peer.backlog:
                peer.inflight[self._seq] = [env, time.monotonic(), 1]
                out = [(dst, env)]
            else:
                peer.backlog.append((self._seq, env))
                out = []
        self._publish(out)

    def set_receiver(self, receiver: Callable[[bytes], None] | None) -> None:
        """Push mode: call ``receiver(payload)`` on the MQTT network thread for every message
        instead of queueing it for :meth:`recv` (saves a thread hand-off per message). The
        receiver must be quick and never block. ``None`` goes back to :meth:`recv`."""
        self._receiver = receiver

    def _deliver(self, payload: bytes) -> None:
        receiver = self._receiver
        if receiver is not None and not self.closed:
            receiver(payload)
        else:
            self._inbox.put(payload)

    def recv(self, timeout: float) -> bytes | None:
        try:
            return self._inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._receiver = None
        self._wake.set()
        for s in self._subs:
            s.cancel()

    # --- internals ----------------------------------------------------------------------------
    def pending(self, dst: str | None = None) -> int:
        """Messages sent but not yet acknowledged (to ``dst`` or to anyone), incl. the backlog."""
        with self._lock:
            peers = [self._peers[dst]] if dst else list(self._peers.values())
            return sum(len(p.inflight) + len(p.backlog) for p in peers if p is not None)

    def _publish(self, out: list[tuple[str, bytes]], *, retransmit: bool = False) -> None:
        for dst, env in out:
            self.link.publish(topics.allreduce(self.link.swarm, dst), env, qos=1)
            self.stats["retransmits" if retransmit else "sent"] += 1
            self.stats["sent_bytes"] += len(env)

    def _on_raw(self, topic: str, buf: bytes) -> None:
        # ``buf`` is paho's own copy of the message (not copied again: ``copy=False``).
        self.stats["received"] += 1
        self._deliver(buf)

    def _on_data(self, topic: str, buf: bytes) -> None:
        try:
            nonce, seq, src, payload = decode_data(buf)
        except FrameError as exc:
            self.stats["rejected"] += 1
            log.warning("%s: rejected link frame on %s: %s", self.member_id, topic, exc)
            return
        with self._lock:
            fresh = self._seen.setdefault((src, nonce), _Seen()).add(seq)
            self._acks.setdefault((src, nonce), []).append(seq)  # re-ack duplicates: the ack was lost
        if fresh:
            self.stats["received"] += 1
            self._deliver(payload)
        else:
            self.stats["duplicates"] += 1
        self._wake.set()

    def _on_ack(self, topic: str, buf: bytes) -> None:
        try:
            nonce, acker, seqs = decode_ack(buf)
        except FrameError as exc:
            self.stats["rejected"] += 1
            log.warning("%s: rejected ack: %s", self.member_id, exc)
            return
        if nonce != self._nonce:
            return  # for a previous incarnation of this member
        out: list[tuple[str, bytes]] = []
        now = time.monotonic()
        with self._lock:
            peer = self._peers.get(acker)
            if peer is None:
                return
            for s in seqs:
                if peer.inflight.pop(s, None) is not None:
                    self.stats["acks_received"] += 1
            while peer.backlog and len(peer.inflight) < self.window:
                s, env = peer.backlog.popleft()
                peer.inflight[s] = [env, now, 1]
                out.append((acker, env))
        self._publish(out)

    def _on_reconnect(self, reconnected: bool) -> None:
        if not reconnected:
            return
        # The broker may have restarted and lost what it held; paho re-sends only what the
        # broker never PUBACKed. Make every unacked message due for retransmission soon (once the
        # receivers have re-subscribed).
        soon = time.monotonic() - self.retransmit_s + 0.5
        with self._lock:
            for peer in self._peers.values():
                for entry in peer.inflight.values():
                    entry[1] = min(entry[1], soon)
        self._wake.set()

    def _flush_acks(self) -> None:
        with self._lock:
            acks, self._acks = self._acks, {}
        for (src, nonce), seqs in acks.items():
            for i in range(0, len(seqs), 4096):
                self.link.publish(topics.ack(self.link.swarm, src), encode_ack(nonce, self.member_id,
                                                                              seqs[i:i + 4096]), qos=1)
                self.stats["acks_sent"] += 1

    def _retransmit_due(self) -> None:
        now = time.monotonic()
        out: list[tuple[str, bytes]] = []
        with self._lock:
            for dst, peer in list(self._peers.items()):
                if any(e[2] * self.retransmit_s > self.give_up_s for e in peer.inflight.values()):
                    # The peer is gone (the ring aborted long ago): stop spending bandwidth on it.
                    self.stats["given_up"] += len(peer.inflight) + len(peer.backlog)
                    del self._peers[dst]
                    continue
                for entry in peer.inflight.values():
                    if now - entry[1] > self.retransmit_s:
                        entry[1] = now
                        entry[2] += 1
                        out.append((dst, entry[0]))
        if out:
            self._publish(out, retransmit=True)

    def _run(self) -> None:
        last_check = time.monotonic()
        while not self.closed:
            self._wake.wait(0.25)
            self._wake.clear()
            try:
                self._flush_acks()
                if time.monotonic() - last_check > 0.25:
                    last_check = time.monotonic()
                    self._retransmit_due()
            except TransportError as exc:  # e.g. a publish refused while closing
                log.debug("transport pump: %s", exc)
