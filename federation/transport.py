"""The seams every transport and every publish/subscribe link implement.

A :class:`Transport` moves opaque byte payloads between named members of one swarm. It may
duplicate, reorder or lose messages (QoS 1 redelivery, broker restarts): the ring engine
above it frames, checksums, de-duplicates, bounds what is in flight, and times out.

What a transport can do beyond that is declared, not probed: every transport exposes its
:class:`Capabilities` (how the frames it carries must be built and checked, :class:`Framing`,
and whether it pushes received payloads to a receiver on its own thread). Like
``io.IOBase.seekable()`` beside ``seek()``, :meth:`Transport.set_receiver` is part of every
transport and raises :class:`~federation.errors.TransportError` on one whose
``capabilities.push`` is False; callers read the capability first.

A :class:`PubSubLink` is the MQTT connection as every user of it sees it (the fleet, the node,
:class:`~federation.signed.SignedLink` which wraps one, :class:`~federation.mqtt_transport.
MqttTransport` which runs on one): :class:`federation.mqtt.MqttLink`, ``SignedLink`` and the
fleet tests' fake are the implementations (``tests/federation/test_transport_types.py`` checks
each of them, and every transport, against these Protocols).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Union, runtime_checkable

from federation.errors import TransportError

if TYPE_CHECKING:  # a name only: the training worker moves frames without loading pydantic
    from pydantic import BaseModel

    from federation.framing import Frame

__all__ = ["Framing", "Capabilities", "VirtualClock", "Transport", "Polled", "Receiver", "Callback",
           "Payload", "Publication", "Subscription", "PubSubLink", "DEFAULT_MAX_PAYLOAD"]

DEFAULT_MAX_PAYLOAD = 256 * 1024  # bytes per MQTT message of the ring (every member must agree)

Receiver = Callable[[bytes], None]
Callback = Callable[[str, bytes], None]
Payload = Union[bytes, bytearray, memoryview, str, "BaseModel"]  # noqa: UP007 - a forward reference


@dataclass(frozen=True)
class Framing:
    """How the frames a link or transport carries are built and checked (federation/framing.py)."""

    # Every frame delivered was authenticated end to end (federation/signed.py): the frame CRC is
    # redundant and not checked on receipt.
    authenticated: bool = False
    # Frames sent carry the CRC (False: the link MACs every frame, the CRC field is 0).
    crc: bool = True
    # Spare bytes left after each frame (a bytearray) so that the link seals it in place
    # (``PubSubLink.publish_frame``); not part of the frame, not counted against max_payload.
    room: int = 0

    def __post_init__(self) -> None:
        if self.room < 0:
            raise ValueError("Framing.room must be >= 0")
        if not self.crc and not self.authenticated:
            raise ValueError("frames without a CRC must be authenticated")



class VirtualClock(Protocol):
    """The simulated time of a modelled network (:class:`federation.memory.SimHub`)."""

    def consumed(self, member: str, frame: Frame) -> None:
        """``member``'s collective acts on ``frame`` now: its clock moves to the frame's arrival."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do beyond send/recv/close."""

    framing: Framing = field(default_factory=Framing)
    # set_receiver() delivers every payload on the transport's own thread (else: poll recv()).
    push: bool = False
    # A simulated network's clock, told about every frame a call hands to its algorithm (the
    # session's Call.wait), so that the model's time follows the data's dependencies; None on a
    # real network.
    clock: VirtualClock | None = None


@runtime_checkable
class Transport(Protocol):
    member_id: str
    max_payload: int  # bytes per message; larger chunks are split by the framing layer

    @property
    def capabilities(self) -> Capabilities: ...

    def send(self, dst: str, payload: bytes) -> None:
        """Queue ``payload`` for member ``dst``. Must not block on the receiver."""
        ...

    def recv(self, timeout: float) -> bytes | None:
        """Next payload addressed to this member, or None after ``timeout`` seconds."""
        ...

    def set_receiver(self, receiver: Receiver | None) -> None:
        """Push mode (``capabilities.push``): call ``receiver(payload)`` on the transport's thread
        for every payload instead of queueing it for :meth:`recv`; ``None`` goes back to ``recv``.
        A transport without push raises TransportError."""
        ...

    def close(self) -> None: ...


class Polled:
    """Base of the transports that do not push (received payloads wait for :meth:`recv`): their
    capabilities (framing with a CRC unless overridden, no push) and the refusing ``set_receiver``."""

    capabilities = Capabilities()

    def set_receiver(self, receiver: Receiver | None) -> None:
        raise TransportError(f"{type(self).__name__} does not push (capabilities.push is False): poll recv()")


class Publication(Protocol):
    """A queued publish (paho's ``MQTTMessageInfo``)."""

    def wait_for_publish(self, timeout: float | None = None) -> None: ...


class Subscription(Protocol):
    def cancel(self) -> None: ...


class PubSubLink(Protocol):
    """The MQTT connection: one Protocol for every user of it (see the module docstring)."""

    @property
    def swarm(self) -> str: ...

    @property
    def connected(self) -> bool: ...

    @property
    def framing(self) -> Framing:
        """How ring frames published through this link (``publish_frame``) must be built."""
        ...

    def publish(self, topic: str, payload: Payload, *, retain: bool = False, qos: int = 1) -> Publication:
        """Queue a PUBLISH (never blocks on the broker)."""
        ...

    def publish_frame(self, topic: str, frame: bytearray, room: int) -> Publication:
        """Publish a ring frame built with ``room`` spare bytes after it (``framing.room``)."""
        ...

    def subscribe(self, filter: str, callback: Callback, *, inline: bool = False,
                  copy: bool = True) -> Subscription:
        """Deliver every message matching ``filter`` to ``callback(topic, payload)`` (off the network
        thread unless ``inline``; ``copy=False``: a read-only view instead of a bytes copy)."""
        ...

    def on_connect(self, hook: Callable[[bool], None]) -> None:
        """Call ``hook(reconnected)`` after every successful (re)connect."""
        ...

    def transport(self, member_id: str, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Transport:
        """A ring transport for ``member_id`` on this link."""
        ...

    def close(self) -> None: ...
