"""In-process transport: N members in one process, with fault injection for tests.

``MemoryHub().transport("a", drop=0.1, duplicate=0.2, reorder=0.3, delay=0.001)`` returns a
:class:`~federation.transport.Transport`. Faults apply to what that member *sends*:

* ``drop``: probability a message is lost.
* ``duplicate``: probability it is delivered twice (QoS 1 redelivery).
* ``reorder``: probability it is held back by a random delay up to ``reorder_window`` seconds,
  so later messages overtake it.
* ``delay``: fixed latency in seconds added to every message.
* ``corrupt``: probability one byte of it is flipped (the receiver's checksum must catch it).
* ``kill_after``: the member dies (sends and receives nothing) after that many sends;
  :meth:`MemoryHub.kill` kills a member at any time. A dead member's pending mail is dropped.

Payloads are passed by reference (no copy) unless corrupted.

``SimHub(network, broker)`` is the same in-process routing on a *modelled* network
(:mod:`federation.linkmodel`): per-node uplink bandwidth, a broker's shared relay throughput and
latency, loss, all in causal virtual time. Its transports push every payload to the receiver
synchronously on the sender's thread (no pump thread per member, so a thousand members fit in one
process) and declare the network's clock in their capabilities; the session tells that clock
which frames each member acts on, and ``network.elapsed()`` is the modelled round time. Several
hubs on one :class:`~federation.linkmodel.Network` are several brokers (a site's and the backbone)
whose members share their node's one uplink.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from dataclasses import dataclass

from federation.errors import FrameError, TransportError
from federation.framing import Frame, FrameKind, decode
from federation.linkmodel import Network
from federation.transport import Capabilities, Polled, Receiver

__all__ = ["MemoryHub", "MemoryTransport", "FaultCounts", "SimHub", "SimTransport"]

DEFAULT_MAX_PAYLOAD = 128 * 1024


class _Inbox:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.heap: list[tuple[float, int, bytes]] = []
        self.dead = False


@dataclass
class FaultCounts:
    """What the fault injector did to this member's outgoing messages."""

    sent: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    corrupted: int = 0


class MemoryHub:
    """Routes payloads between the transports it created."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, _Inbox] = {}
        self._seq = itertools.count()

    def transport(
        self,
        member_id: str,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        drop: float = 0.0,
        duplicate: float = 0.0,
        reorder: float = 0.0,
        reorder_window: float = 0.01,
        delay: float = 0.0,
        corrupt: float = 0.0,
        kill_after: int | None = None,
        seed: int | None = None,
    ) -> MemoryTransport:
        """Register ``member_id`` and return its transport (with the given send-side faults)."""
        with self._lock:
            if member_id in self._inboxes and not self._inboxes[member_id].dead:
                raise ValueError(f"member {member_id!r} already has a transport on this hub")
            inbox = _Inbox()
            self._inboxes[member_id] = inbox
        return MemoryTransport(
            self, member_id, inbox, max_payload=max_payload, drop=drop, duplicate=duplicate,
            reorder=reorder, reorder_window=reorder_window, delay=delay, corrupt=corrupt,
            kill_after=kill_after, seed=seed,
        )

    def kill(self, member_id: str) -> None:
        """Simulate the sudden death of a member: it neither sends nor receives from now on."""
        with self._lock:
            inbox = self._inboxes.get(member_id)
        if inbox is not None:
            with inbox.cond:
                inbox.dead = True
                inbox.heap.clear()
                inbox.cond.notify_all()

    def alive(self, member_id: str) -> bool:
        with self._lock:
            inbox = self._inboxes.get(member_id)
        return inbox is not None and not inbox.dead

    def _deliver(self, dst: str, payload: bytes, due: float) -> None:
        with self._lock:
            inbox = self._inboxes.get(dst)
        if inbox is None:
            return  # like a publish nobody subscribed to
        with inbox.cond:
            if inbox.dead:
                return
            heapq.heappush(inbox.heap, (due, next(self._seq), payload))
            inbox.cond.notify()

    def _unregister(self, member_id: str, inbox: _Inbox) -> None:
        with self._lock:
            if self._inboxes.get(member_id) is inbox:
                del self._inboxes[member_id]


class MemoryTransport(Polled):
    """One member's end of a :class:`MemoryHub` (implements ``federation.transport.Transport``):
    frames with their CRC, received by polling :meth:`recv`."""

    def __init__(self, hub: MemoryHub, member_id: str, inbox: _Inbox, *, max_payload: int, drop: float,
                 duplicate: float, reorder: float, reorder_window: float, delay: float, corrupt: float,
                 kill_after: int | None, seed: int | None) -> None:
        self.member_id = member_id
        self.max_payload = max_payload
        self.faults = FaultCounts()
        self._hub, self._inbox = hub, inbox
        self._drop, self._dup, self._reorder, self._window = drop, duplicate, reorder, reorder_window
        self._delay, self._corrupt, self._kill_after = delay, corrupt, kill_after
        self._rng = random.Random(seed if seed is not None else hash(member_id))
        self._lock = threading.Lock()
        self._closed = False

    @property
    def dead(self) -> bool:
        return self._inbox.dead

    def kill(self) -> None:
        """Die now (see :meth:`MemoryHub.kill`)."""
        self._hub.kill(self.member_id)

    def send(self, dst: str, payload: bytes) -> None:
        """Queue ``payload`` for ``dst`` (never blocks); faults are applied here."""
        if self._closed:
            raise TransportError(f"transport of {self.member_id} is closed")
        if len(payload) > self.max_payload:
            raise TransportError(f"payload of {len(payload)} bytes exceeds max_payload {self.max_payload}")
        with self._lock:
            if self._inbox.dead:
                return
            f = self.faults
            f.sent += 1
            if self._kill_after is not None and f.sent > self._kill_after:
                self.kill()
                return
            rng = self._rng
            if self._drop and rng.random() < self._drop:
                f.dropped += 1
                return
            if self._corrupt and rng.random() < self._corrupt:
                f.corrupted += 1
                buf = bytearray(payload)
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
                payload = bytes(buf)
            now = time.monotonic()
            due = now + self._delay
            if self._reorder and rng.random() < self._reorder:
                f.reordered += 1
                due += rng.random() * self._window
            copies = [due]
            if self._dup and rng.random() < self._dup:
                f.duplicated += 1
                copies.append(due + rng.random() * self._window)
        for d in copies:
            self._hub._deliver(dst, payload, d)

    def recv(self, timeout: float) -> bytes | None:
        """Next payload whose delivery time has come, or None after ``timeout`` seconds."""
        inbox = self._inbox
        end = time.monotonic() + max(0.0, timeout)
        with inbox.cond:
            while True:
                now = time.monotonic()
                if inbox.heap and not inbox.dead and inbox.heap[0][0] <= now:
                    return heapq.heappop(inbox.heap)[2]
                wait = end - now
                if inbox.heap and not inbox.dead:
                    wait = min(wait, inbox.heap[0][0] - now)
                if end - now <= 0:
                    return None
                inbox.cond.wait(max(wait, 0.0005))

    def close(self) -> None:
        self._closed = True
        self._hub._unregister(self.member_id, self._inbox)


class SimHub:
    """One simulated broker of a :class:`~federation.linkmodel.Network` (see the module docstring);
    implements :class:`~federation.transport.VirtualClock` for its transports."""

    def __init__(self, network: Network, broker: str = "broker", *, latency_s: float = 0.001,
                 relay_bps: float = float("inf")) -> None:
        self.network = network
        self.broker = network.broker(broker, latency_s=latency_s, relay_bps=relay_bps)
        self._lock = threading.Lock()
        self._receivers: dict[str, Receiver | None] = {}
        self.capabilities = Capabilities(push=True, clock=self)

    def transport(self, member_id: str, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> SimTransport:
        """Register ``member_id`` on this broker and return its transport."""
        with self._lock:
            if member_id in self._receivers:
                raise ValueError(f"member {member_id!r} already has a transport on this hub")
            self._receivers[member_id] = None
        return SimTransport(self, member_id, max_payload)

    def consumed(self, member: str, frame: Frame) -> None:
        if frame.kind == FrameKind.DATA:
            self.network.consumed(member, (frame.sender, frame.tag, frame.key))

    def _send(self, src: str, dst: str, payload: bytes) -> None:
        # DATA frames go through the model; ACKs and ABORTs are delivered as they are sent (their
        # timing follows this machine's threads, so the model neither charges nor loses them).
        if len(payload) > 3 and payload[3] == FrameKind.DATA:
            try:
                fr = decode(payload, check_crc=False)
            except FrameError:
                pass  # the receiver rejects it as well
            else:
                frame_id = (fr.sender, fr.tag, fr.key)
                if not self.network.transmit(self.broker, src, dst, len(payload), frame_id):
                    return
        with self._lock:
            receiver = self._receivers.get(dst)
        if receiver is not None:
            receiver(payload)

    def _unregister(self, member_id: str) -> None:
        with self._lock:
            self._receivers.pop(member_id, None)


class SimTransport:
    """One member's end of a :class:`SimHub` (a push ``federation.transport.Transport``)."""

    def __init__(self, hub: SimHub, member_id: str, max_payload: int) -> None:
        self.member_id = member_id
        self.max_payload = max_payload
        self._hub = hub

    @property
    def capabilities(self) -> Capabilities:
        return self._hub.capabilities

    def send(self, dst: str, payload: bytes) -> None:
        """Deliver ``payload`` to ``dst``'s receiver now (on this thread); the model stamps it."""
        if len(payload) > self.max_payload:
            raise TransportError(f"payload of {len(payload)} bytes exceeds max_payload {self.max_payload}")
        self._hub._send(self.member_id, dst, payload)

    def recv(self, timeout: float) -> bytes | None:
        raise TransportError("a SimTransport pushes every payload: set_receiver() instead of recv()")

    def set_receiver(self, receiver: Receiver | None) -> None:
        with self._hub._lock:
            self._hub._receivers[self.member_id] = receiver

    def close(self) -> None:
        self._hub._unregister(self.member_id)
