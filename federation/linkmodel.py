"""A link model for simulated swarms: causal virtual time over node uplinks, brokers and latency.

Used by :class:`federation.memory.SimHub` to run hundreds or thousands of members in one process
through the real ring, session and aggregation code, and to tell how long a round *would* take
on a modelled network (``fractal bench scale``). Pure: no threads, no I/O, no wall clock.

The model (PROTOCOL.md section "Simulated swarms"):

* Every node has a virtual clock, starting at 0. A frame sent by a node leaves at the node's
  clock; it queues FIFO on the node's **uplink** (``uplink_bps`` bytes/s, one per node, shared by
  every hub the node is on: a site leader's backbone frames queue behind its site frames), then
  on its **broker's relay** (``relay_bps``, shared by every member of that broker: a capacity
  timeline in ``bin_s`` bins, filled in whatever order frames are offered, so late offers still
  find earlier free capacity), then takes the broker's one-way **latency** (node -> broker ->
  node, ``latency_s``: the alpha of the ring's 2(N-1) alpha term) and arrives.
* A node's clock moves to a frame's arrival when the node's collective *acts on* that frame
  (the session's ``Call`` returns it to the algorithm: :meth:`Network.consumed`), so every frame
  the node sends next leaves no earlier than the data it depends on. Computation is free.
* ``loss``: a frame is lost with that probability (it still used the uplink); the session's
  real retransmit resends it, and the resend leaves no earlier than ``rto_s`` after the first
  copy (the modelled retransmit timeout).
* Only DATA frames are modelled (:meth:`Network.transmit`); ACKs and ABORTs are delivered
  uncharged (their timing is the machine's, not the model's), and the model assumes the
  session's window (``max_in_flight``) does not bind: a simulated swarm runs with a window larger
  than any call's frames so that it really does not.

The round's modelled time is the largest node clock once every member returned
(:meth:`Network.elapsed`).
"""

from __future__ import annotations

import math
import random
import threading
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["LinkModel", "Broker", "Network", "ring_bound", "broadcast_bound"]


@dataclass(frozen=True)
class LinkModel:
    """Per-node link parameters of a simulated swarm."""

    uplink_bps: float = 128 * 1024.0  # bytes/s each node can send
    loss: float = 0.0  # probability a frame is lost
    rto_s: float = 0.2  # modelled delay before a lost frame's resend leaves
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.uplink_bps > 0:
            raise ValueError("uplink_bps must be > 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError("loss must be in [0, 1)")
        if self.rto_s < 0:
            raise ValueError("rto_s must be >= 0")


class Broker:
    """One broker's relay: a shared capacity timeline plus a one-way latency."""

    def __init__(self, name: str, *, latency_s: float, relay_bps: float = math.inf,
                 bin_s: float = 1e-3) -> None:
        if latency_s < 0 or not relay_bps > 0 or not bin_s > 0:
            raise ValueError("a broker needs latency_s >= 0, relay_bps > 0 and bin_s > 0")
        self.name = name
        self.latency_s = latency_s
        self.relay_bps = relay_bps
        self.bin_s = bin_s
        self._used: dict[int, float] = defaultdict(float)  # bin -> bytes relayed in it
        self.relayed = 0  # bytes

    def relay(self, t: float, size: int) -> float:
        """A frame of ``size`` bytes offered at ``t``: when its last byte leaves the broker."""
        self.relayed += size
        if math.isinf(self.relay_bps):
            return t
        cap = self.relay_bps * self.bin_s
        i = int(t / self.bin_s)
        left = float(size)
        while True:
            take = min(cap - self._used[i], left)
            if take > 0:
                self._used[i] += take
                left -= take
            if left <= 0:
                break
            i += 1
        end = i * self.bin_s + self.bin_s * self._used[i] / cap
        return max(end, t + size / self.relay_bps)

    def reset(self) -> None:
        self._used.clear()
        self.relayed = 0


class Network:
    """Node clocks, uplinks and brokers of one simulated swarm (thread-safe)."""

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self._lock = threading.Lock()
        self._rng = random.Random(link.seed)
        self._clock: dict[str, float] = defaultdict(float)
        self._uplink_free: dict[str, float] = defaultdict(float)
        self._stamps: dict[str, dict[tuple, float]] = defaultdict(dict)  # receiver -> frame id -> arrival
        self._first: dict[tuple, float] = {}  # (src, dst, frame id) -> first departure (loss only)
        self.brokers: dict[str, Broker] = {}
        self.frames = 0
        self.lost = 0

    def broker(self, name: str, *, latency_s: float, relay_bps: float = math.inf) -> Broker:
        """Add (or return) the broker ``name``."""
        with self._lock:
            if name not in self.brokers:
                self.brokers[name] = Broker(name, latency_s=latency_s, relay_bps=relay_bps)
            return self.brokers[name]

    def transmit(self, broker: Broker, src: str, dst: str, size: int, frame: tuple) -> bool:
        """``src`` sends the DATA frame ``frame`` (an id unique within ``dst``'s calls) of ``size``
        bytes to ``dst`` through ``broker`` now, at ``src``'s clock; its arrival is stamped for
        :meth:`consumed`. Returns False if the model lost it."""
        link = self.link
        with self._lock:
            self.frames += 1
            t = self._clock[src]
            if link.loss:
                key = (src, dst, frame)
                first = self._first.get(key)
                if first is None:
                    self._first[key] = t
                else:  # a resend: it leaves one modelled retransmit timeout after the first copy
                    t = max(t, first + link.rto_s)
            start = max(t, self._uplink_free[src])
            sent = start + size / link.uplink_bps
            self._uplink_free[src] = sent
            if link.loss and self._rng.random() < link.loss:
                self.lost += 1
                return False
            arrival = broker.relay(sent, size) + broker.latency_s
            stamps = self._stamps[dst]
            stamps[frame] = min(arrival, stamps.get(frame, math.inf))
            return True

    def consumed(self, node: str, frame: tuple) -> None:
        """``node`` acted on ``frame``: its clock moves to the frame's arrival."""
        with self._lock:
            at = self._stamps[node].pop(frame, None)
            if at is not None and at > self._clock[node]:
                self._clock[node] = at

    def clock(self, node: str) -> float:
        with self._lock:
            return self._clock[node]

    def elapsed(self) -> float:
        """The modelled time so far: the latest node clock."""
        with self._lock:
            return max(self._clock.values(), default=0.0)

    def reset(self) -> None:
        """Every clock, uplink and broker back to time 0 (before a new timed round)."""
        with self._lock:
            self._clock.clear()
            self._uplink_free.clear()
            self._stamps.clear()
            self._first.clear()
            for b in self.brokers.values():
                b.reset()
            self.frames = self.lost = 0


def ring_bound(n: int, size_bytes: float, uplink_bps: float) -> float:
    """The ring allreduce's bandwidth bound: 2 (n - 1) / n x M / B seconds."""
    return 2.0 * (n - 1) / n * size_bytes / uplink_bps if n > 1 else 0.0


def broadcast_bound(n: int, size_bytes: float, uplink_bps: float) -> float:
    """A pipelined chain broadcast's bound: every member but the last forwards M once, M / B."""
    return size_bytes / uplink_bps if n > 1 else 0.0
