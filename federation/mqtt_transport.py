"""The allreduce :class:`~federation.transport.Transport` over MQTT: a thin pipe.

``send(dst, p)`` publishes ``p`` unchanged at QoS 1 on ``fractal/v1/{swarm}/ar/{dst}`` and every
message on this member's topic lands in its inbox (or goes straight to a push receiver). There
is deliberately no reliability here: the one reliability layer is :mod:`federation.session`
(framing, ACKs, per-peer windows, retransmission with a bound, de-duplication), which heals
what MQTT loses: Mosquitto silently drops QoS 1 messages once a subscriber's queue passes
``max_queued_messages``, and a broker restart loses whatever it held.

The transport runs on any :class:`~federation.transport.PubSubLink` (``federation.mqtt.MqttLink``,
``federation.signed.SignedLink``), so this module never imports :mod:`federation.mqtt` (the link
builds transports; no import cycle). Its :class:`~federation.transport.Capabilities` are the
link's :class:`~federation.transport.Framing`, and push.
"""

from __future__ import annotations

import queue

from federation import topics
from federation.errors import TransportError
from federation.transport import DEFAULT_MAX_PAYLOAD, Capabilities, PubSubLink, Receiver, Subscription

__all__ = ["MqttTransport"]


class MqttTransport:
    """See module docstring. Created by :meth:`federation.mqtt.MqttLink.transport`."""

    def __init__(self, link: PubSubLink, member_id: str, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        if max_payload < 64:
            raise TransportError("max_payload must be >= 64 bytes")
        self.link = link
        self.member_id = topics.validate_id(member_id, "member id")
        self.max_payload = int(max_payload)
        self.closed = False
        # Frames are built and checked the way the link wants them (a SignedLink authenticates
        # every frame: no CRC check; MACs them: no CRC, seal room after each frame).
        self.capabilities = Capabilities(framing=link.framing, push=True)
        self._room = link.framing.room
        self.stats = {"sent": 0, "sent_bytes": 0, "payload_bytes": 0, "received": 0}
        self._inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._receiver: Receiver | None = None
        # Inline: the handler only hands the payload on; it never waits.
        self._subs: list[Subscription] = [
            link.subscribe(topics.allreduce(link.swarm, member_id), self._on_raw, inline=True, copy=False)]

    # --- Transport API ------------------------------------------------------------------------
    def send(self, dst: str, payload: bytes) -> None:
        """Publish ``payload`` to ``dst`` (never blocks on the receiver)."""
        if self.closed:
            raise TransportError(f"transport of {self.member_id} is closed")
        room = self._room
        if room and not isinstance(payload, bytearray):
            raise TransportError("frames for this transport need their seal room (framing.encode(room=))")
        if len(payload) - room > self.max_payload:
            raise TransportError(f"payload of {len(payload)} bytes exceeds max_payload={self.max_payload}",
                                 hint="split it with the framing layer")
        if dst == self.member_id:  # a ring of one, or a root broadcasting to itself
            self._deliver(bytes(payload[:len(payload) - room]))
            return
        self.stats["payload_bytes"] += len(payload)
        if room:
            self.link.publish_frame(topics.allreduce(self.link.swarm, dst), payload, room)
        else:
            self.link.publish(topics.allreduce(self.link.swarm, dst), bytes(payload), qos=1)
        self.stats["sent"] += 1
        self.stats["sent_bytes"] += len(payload)

    def set_receiver(self, receiver: Receiver | None) -> None:
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
        for s in self._subs:
            s.cancel()

    def _on_raw(self, topic: str, buf: bytes) -> None:
        # ``buf`` is paho's own copy of the message (not copied again: ``copy=False``).
        self.stats["received"] += 1
        self._deliver(buf)
