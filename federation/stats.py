"""Traffic counters of one member's allreduce engine (read by tests and the benchmark)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

__all__ = ["Stats"]


@dataclass
class Stats:
    """Cumulative counters; ``bytes_sent`` counts every frame byte put on the transport
    (DATA, retransmissions, ACKs and ABORTs), i.e. framing overhead included."""

    bytes_sent: int = 0
    frames_sent: int = 0
    data_frames_sent: int = 0
    acks_sent: int = 0
    aborts_sent: int = 0
    retransmits: int = 0
    retries_exhausted: int = 0  # frames given up on after max_retransmits (the call raised RetriesExhausted)
    linger_expired: int = 0  # frames of finished calls (Call.linger) given up on unacknowledged
    acks_implied: int = 0  # frames of ours taken as acknowledged: their receiver moved on to a later call
    acks_skipped: int = 0  # ACK frames not sent: our DATA of a later call told the peer as much
    bytes_received: int = 0
    frames_received: int = 0
    duplicates: int = 0  # DATA frames received again (counted once, re-acknowledged)
    rejected: int = 0  # malformed / bad checksum / wrong swarm / unexpected frames, dropped
    stale: int = 0  # frames of tags already finished or aborted
    early: int = 0  # frames of a tag not started yet, buffered
    early_dropped: int = 0  # frames beyond the early buffer's bound (sender will retransmit)
    send_errors: int = 0  # transport refused a frame (e.g. broker down); treated as lost
    last_reject: str = ""
    last_send_error: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected += 1
            self.last_reject = reason

    def snapshot(self) -> dict:
        """A plain dict copy of the counters."""
        with self._lock:
            d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
        return d

    def reset(self) -> None:
        with self._lock:
            for f in fields(self):
                if f.name != "_lock":
                    setattr(self, f.name, "" if f.name.startswith("last_") else 0)
