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
from typing import Any

from federation import topics
from federation.mqtt_transport import MqttTransport, PubSubLink

__all__ = ["BackboneLink", "backbone_transport"]


class BackboneLink:
    """``link`` with its allreduce topics moved under ``fractal/v1/{swarm}/x/`` (see module docstring)."""

    # Frames are authenticated end to end iff the underlying link does it (signed swarms).
    macs_frames = False
    frame_room = 0

    def __init__(self, link: PubSubLink) -> None:
        self.link = link
        self.swarm = link.swarm
        self.authenticates_frames = bool(getattr(link, "authenticates_frames", False))
        self._site_prefix = topics.allreduce(self.swarm, "")

    def _move(self, topic: str) -> str:
        if not topic.startswith(self._site_prefix):
            raise ValueError(f"not an allreduce topic of swarm {self.swarm!r}: {topic!r}")
        return topics.backbone_allreduce(self.swarm, topic[len(self._site_prefix):])

    def publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1) -> object:
        return self.link.publish(self._move(topic), payload, retain=retain, qos=qos)

    def subscribe(self, filter: str, callback: Callable[[str, bytes], None], **kw: Any) -> Any:
        return self.link.subscribe(self._move(filter), callback, **kw)


def backbone_transport(link: PubSubLink, member_id: str, *, max_payload: int = 256 * 1024) -> MqttTransport:
    """A transport for ``member_id``'s level-2 ring on its site broker's bridged subtree."""
    return MqttTransport(BackboneLink(link), member_id, max_payload=max_payload)
