"""The one small interface every transport implements (in-memory, MQTT).

A transport moves opaque byte payloads between named members of one swarm. It may
duplicate, reorder or lose messages (QoS 1 redelivery, broker restarts): the ring engine
above it frames, checksums, de-duplicates, bounds what is in flight, and times out.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Transport"]


@runtime_checkable
class Transport(Protocol):
    member_id: str
    max_payload: int  # bytes per message; larger chunks are split by the framing layer

    def send(self, dst: str, payload: bytes) -> None:
        """Queue ``payload`` for member ``dst``. Must not block on the receiver."""
        ...

    def recv(self, timeout: float) -> bytes | None:
        """Next payload addressed to this member, or None after ``timeout`` seconds."""
        ...

    def close(self) -> None: ...
