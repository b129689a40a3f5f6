"""Signing and verification at the publish/subscribe seam (wraps any pub/sub link).

:class:`SignedLink` takes a link with ``publish(topic, payload, retain=, qos=)`` and
``subscribe(filter, callback)`` (``federation.mqtt.MqttLink``, or a test fake) and

* signs every payload it publishes with the owner's key (``federation.auth.Signer``),
* verifies every payload it delivers against the swarm keyring (``federation.auth.Verifier``)
  and hands the callback only the verified payload; anything else is dropped and counted per
  :class:`~federation.auth.Reject` reason (``rejected``), never delivered.

It is itself a link of the kind :class:`federation.mqtt_transport.MqttTransport` runs on, so
:meth:`SignedLink.transport` gives the ring a transport whose every frame (DATA, ACK, ABORT,
broadcast) is signed by its member and verified by the receiver; a ring frame whose header names
another sender than the key that signed it is dropped as WRONG_ROLE (impersonation).

Empty payloads (an MQTT "clear the retained message") cannot be signed: they are dropped as
UNSIGNED. A node is decommissioned by revoking its key, not by clearing its status.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from pydantic import BaseModel

from federation import framing, topics
from federation.auth import MAGIC as ED_MAGIC
from federation.auth import (
    AuthRejected,
    Keyring,
    Reject,
    Role,
    Signer,
    Verified,
    Verifier,
    load_key_file,
)
from federation.mqtt_transport import MqttTransport
from federation.ringmac import RingMac, is_mac_envelope, room_for
from federation.transport import (
    DEFAULT_MAX_PAYLOAD,
    Callback,
    Framing,
    Payload,
    Publication,
    PubSubLink,
    Subscription,
)

__all__ = ["SignedLink", "Identity", "load_identity"]

log = logging.getLogger(__name__)

class Identity:
    """Who we are (signer) and whom we trust (keyring): what a member or the fleet loads at start."""

    def __init__(self, signer: Signer, keyring: Keyring, dh_key: X25519PrivateKey | None = None) -> None:
        self.signer = signer
        self.keyring = keyring
        self.dh_key = dh_key

    def verifier(self, **kw: Any) -> Verifier:
        return Verifier(self.keyring, **kw)

    def link(self, link: PubSubLink, *, on_reject: Callable[[str, Reject], None] | None = None,
             **verifier_kw: Any) -> SignedLink:
        """``link`` wrapped: signed publishing, verified delivery, ring frames MAC'd when we have
        an X25519 key."""
        verifier = self.verifier(**verifier_kw)
        mac = None
        if self.dh_key is not None:
            mac = RingMac(self.signer, self.dh_key, verifier, link.swarm)
        return SignedLink(link, self.signer, verifier, on_reject=on_reject, ring_mac=mac)


def load_identity(key_file: str | Path, keyring_file: str | Path) -> Identity:
    """Load ``deploy/keys.py``'s key file (ours) and keyring (everyone's public keys)."""
    kf = load_key_file(key_file)
    signer = Signer(kf.sender, kf.key_id, kf.private_key)
    ring = Keyring.load(keyring_file)
    entry = ring.get(signer.key_id)
    if entry is None or entry.sender != signer.sender:
        from federation.errors import FederationError

        raise FederationError(f"key {signer.key_id!r} of {signer.sender!r} is not (or no longer) in "
                              f"the keyring {keyring_file}", hint="re-provision with deploy/keys.py")
    return Identity(signer, ring, kf.dh_private)


def _is_ring_topic(topic: str) -> bool:
    parts = topic.split("/")
    return len(parts) == 5 and parts[3] in ("ar", "ack")


def _bytes(payload: Payload) -> bytes:
    if isinstance(payload, BaseModel):
        return payload.model_dump_json().encode()
    if isinstance(payload, str):
        return payload.encode()
    return bytes(payload)


class SignedLink:
    """A link whose every published payload is signed and every delivered payload verified
    (a :class:`~federation.transport.PubSubLink` on top of one)."""

    def __init__(self, link: PubSubLink, signer: Signer, verifier: Verifier,
                 on_reject: Callable[[str, Reject], None] | None = None,
                 ring_mac: RingMac | None = None) -> None:
        self.link = link
        self.signer = signer
        self.verifier = verifier
        self.ring_mac = ring_mac
        self._on_reject = on_reject
        self.swarm: str = link.swarm
        self._ring_topics: dict[str, bool] = {}
        # Every frame this link delivers was authenticated end to end (ed25519 or a ring MAC), so
        # the frame layer's CRC is redundant; MAC'd frames (ringmac v3) are sent without one and
        # with the spare bytes after them that the MAC is sealed into.
        self.framing = Framing(authenticated=True, crc=ring_mac is None,
                               room=0 if ring_mac is None else room_for(signer.sender,
                                                                         topics.allreduce(self.swarm, "")))

    def publish_frame(self, topic: str, frame: bytearray, room: int) -> Publication:
        """Publish a ring frame built with ``room`` spare bytes after it, sealed in place."""
        if self.ring_mac is None or not self._is_ring(topic):
            return self.publish(topic, memoryview(frame)[:len(frame) - room])
        return self.link.publish(topic, self.ring_mac.seal_into(topic, frame, room), qos=1)

    @property
    def rejected(self) -> Counter[Reject]:
        return self.verifier.counts

    @property
    def connected(self) -> bool:
        return self.link.connected

    def on_connect(self, hook: Callable[[bool], None]) -> None:
        self.link.on_connect(hook)

    def transport(self, member_id: str, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> MqttTransport:
        """A ring transport for ``member_id`` whose frames are signed and verified."""
        if member_id != self.signer.sender:
            from federation.errors import FederationError

            raise FederationError(f"this link signs as {self.signer.sender!r}, not {member_id!r}")
        return MqttTransport(self, member_id, max_payload=max_payload)

    def sign(self, topic: str, payload: Payload, *, will: bool = False) -> bytes:
        return self.signer.sign(topic, _bytes(payload), will=will)

    def _is_ring(self, topic: str) -> bool:
        ring = self._ring_topics.get(topic)
        if ring is None:
            if len(self._ring_topics) >= 4096:
                self._ring_topics.clear()
            ring = self._ring_topics[topic] = _is_ring_topic(topic)
        return ring

    def publish(self, topic: str, payload: Payload, *, retain: bool = False, qos: int = 1) -> Publication:
        if self.ring_mac is not None and self._is_ring(topic):
            sealed = self.ring_mac.seal(topic, payload if isinstance(payload, (bytes, bytearray, memoryview))  # type: ignore[union-attr]
                                        else _bytes(payload))
            return self.link.publish(topic, sealed, retain=retain, qos=qos)
        return self.link.publish(topic, self.sign(topic, payload), retain=retain, qos=qos)

    def subscribe(self, filter: str, callback: Callback, *, inline: bool = False,
                  copy: bool = True) -> Subscription:
        """Like the link's ``subscribe``; the callback gets only verified payloads
        (``copy=False``: a zero-copy view into the received buffer)."""

        mac = self.ring_mac

        def verified(topic: str, data: bytes) -> None:
            payload: memoryview
            # Not an ed25519 envelope: a MAC'd ring frame (whose named sender open() checks), or
            # dropped by open() as unsigned.
            if mac is not None and data[:2] != ED_MAGIC:
                try:
                    signer, payload = mac.open(topic, data)
                except AuthRejected as exc:
                    log.debug("dropped message on %s: %s", topic, exc)
                    if self._on_reject is not None:
                        self._on_reject(topic, exc.reason)
                    return
                callback(topic, bytes(payload) if copy else payload)  # type: ignore[arg-type]
                return
            msg = self.verify(topic, data)
            if msg is None:
                return
            named = framing.header_sender(msg.payload) if "/ar/" in topic else None
            if named is not None and named != msg.sender.encode():
                self.verifier.count(Reject.WRONG_ROLE)
                if self._on_reject is not None:
                    self._on_reject(topic, Reject.WRONG_ROLE)
                log.debug("dropped frame on %s: header names %r, signed by %r", topic, bytes(named),
                          msg.sender)
                return
            callback(topic, bytes(msg.payload) if copy else msg.payload)  # type: ignore[arg-type]

        return self.link.subscribe(filter, verified, inline=inline, copy=copy)

    def verify(self, topic: str, data: bytes | bytearray | memoryview) -> Verified | None:
        """The verified message, or ``None`` (dropped, counted, logged at debug level)."""
        try:
            if self.ring_mac is not None and is_mac_envelope(data):
                sender, payload = self.ring_mac.open(topic, data)
                return Verified(sender, "", Role.NODE, 0, 0, False, payload)
            return self.verifier.verify(topic, data)
        except AuthRejected as exc:
            log.debug("dropped message on %s: %s", topic, exc)
            if self._on_reject is not None:
                self._on_reject(topic, exc.reason)
            return None

    def close(self) -> None:
        self.link.close()
