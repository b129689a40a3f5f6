"""The leaders' level of a hierarchical round over MQTT (:mod:`federation.hierarchy`).

A site leader talks to the other sites' leaders through its own site broker: the level-2 ring's
frames are published on ``fractal/v1/{swarm}/x/ar/{dst}`` (:func:`federation.topics.backbone_allreduce`),
the one subtree (:data:`federation.topics.BACKBONE_BRIDGE`) each site broker bridges to the
backbone broker (``deploy/mosquitto/``). Everything else of a site stays on its broker.

:class:`BackboneLink` is a view of the member's link (plain or :class:`~federation.signed.SignedLink`)
that moves a transport's ``ar/{dst}`` topics into that subtree, so the one
:class:`~federation.mqtt_transport.MqttTransport` and the one session layer serve both levels.
On a signed link every backbone frame is ed25519-signed by its sender (the ring MAC covers only
a site's own ``ar/`` topics), so signatures hold across sites and brokers.
"""

from __future__ import annotations

from collections.abc import Callable

from federation import topics
from federation.mqtt_transport import MqttTransport
from federation.transport import (
    DEFAULT_MAX_PAYLOAD,
    Callback,
    Framing,
    Payload,
    Publication,
    PubSubLink,
    Subscription,
)

__all__ = ["BackboneLink", "backbone_transport"]


class BackboneLink:
    """``link`` with its allreduce topics moved under ``fractal/v1/{swarm}/x/`` (see module docstring).

    A :class:`~federation.transport.PubSubLink` itself. Frames go out whole through ``publish``
    (no ring-MAC seal room: the MAC keys cover a site's own ``ar/`` topics only), so on a signed
    link each backbone frame is ed25519-signed and arrives authenticated; the CRC stays on.
    """

    def __init__(self, link: PubSubLink) -> None:
        self.link = link
        self._swarm = link.swarm
        self._framing = Framing(authenticated=link.framing.authenticated, crc=True, room=0)
        self._site_prefix = topics.allreduce(self._swarm, "")

    @property
    def swarm(self) -> str:
        return self._swarm

    @property
    def connected(self) -> bool:
        return self.link.connected

    @property
    def framing(self) -> Framing:
        return self._framing

    def _move(self, topic: str) -> str:
        if not topic.startswith(self._site_prefix):
            raise ValueError(f"not an allreduce topic of swarm {self._swarm!r}: {topic!r}")
        return topics.backbone_allreduce(self._swarm, topic[len(self._site_prefix):])

    def publish(self, topic: str, payload: Payload, *, retain: bool = False, qos: int = 1) -> Publication:
        return self.link.publish(self._move(topic), payload, retain=retain, qos=qos)

    def publish_frame(self, topic: str, frame: bytearray, room: int) -> Publication:
        return self.publish(topic, bytes(memoryview(frame)[:len(frame) - room]))

    def subscribe(self, filter: str, callback: Callback, *, inline: bool = False,
                  copy: bool = True) -> Subscription:
        return self.link.subscribe(self._move(filter), callback, inline=inline, copy=copy)

    def on_connect(self, hook: Callable[[bool], None]) -> None:
        self.link.on_connect(hook)

    def transport(self, member_id: str, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> MqttTransport:
        return MqttTransport(self, member_id, max_payload=max_payload)

    def close(self) -> None:
        """The underlying link belongs to the node; closing the view leaves it open."""


def backbone_transport(link: PubSubLink, member_id: str, *, max_payload: int = 256 * 1024) -> MqttTransport:
    """A transport for ``member_id``'s level-2 ring on its site broker's bridged subtree."""
    return MqttTransport(BackboneLink(link), member_id, max_payload=max_payload)
