"""Signing and verification at the publish/subscribe seam (wraps any pub/sub link).

:class:`SignedLink` takes a link with ``publish(topic, payload, retain=, qos=)`` and
``subscribe(filter, callback)`` (``federation.mqtt.MqttLink``, or a test fake) and

* signs every payload it publishes with the owner's key (``federation.auth.Signer``),
* verifies every payload it delivers against the swarm keyring (``federation.auth.Verifier``)
  and hands the callback only the verified payload; anything else is dropped and counted per
  :class:`~federation.auth.Reject` reason (``rejected``), never delivered.

Empty payloads (an MQTT "clear the retained message") cannot be signed: they are dropped as
UNSIGNED. A node is decommissioned by revoking its key, not by clearing its status.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from federation.auth import (
    AuthRejected,
    Keyring,
    Reject,
    Signer,
    Verified,
    Verifier,
    load_private_key,
)

__all__ = ["PubSub", "SignedLink", "Identity", "load_identity"]

log = logging.getLogger(__name__)

Callback = Callable[[str, bytes], None]


class PubSub(Protocol):
    def publish(self, topic: str, payload: Any, *, retain: bool = False, qos: int = 1) -> Any: ...
    def subscribe(self, filter: str, callback: Callback) -> Any: ...
    def close(self) -> None: ...


class Identity:
    """Who we are (signer) and whom we trust (keyring): what a member or the fleet loads at start."""

    def __init__(self, signer: Signer, keyring: Keyring) -> None:
        self.signer = signer
        self.keyring = keyring

    def verifier(self, **kw: Any) -> Verifier:
        return Verifier(self.keyring, **kw)


def load_identity(key_file: str | Path, keyring_file: str | Path) -> Identity:
    """Load ``deploy/keys.py``'s key file (ours) and keyring (everyone's public keys)."""
    import json

    doc = json.loads(Path(key_file).read_text())
    signer = Signer(doc["sender"], doc["key_id"], load_private_key(key_file))
    ring = Keyring.load(keyring_file)
    entry = ring.get(signer.key_id)
    if entry is None or entry.sender != signer.sender:
        from federation.errors import FederationError

        raise FederationError(f"key {signer.key_id!r} of {signer.sender!r} is not (or no longer) in "
                              f"the keyring {keyring_file}", hint="re-provision with deploy/keys.py")
    return Identity(signer, ring)


def _bytes(payload: Any) -> bytes:
    if isinstance(payload, BaseModel):
        return payload.model_dump_json().encode()
    if isinstance(payload, str):
        return payload.encode()
    return bytes(payload)


class SignedLink:
    """A link whose every published payload is signed and every delivered payload verified."""

    def __init__(self, link: PubSub, signer: Signer, verifier: Verifier,
                 on_reject: Callable[[str, Reject], None] | None = None) -> None:
        self.link = link
        self.signer = signer
        self.verifier = verifier
        self._on_reject = on_reject

    @property
    def rejected(self) -> Counter[Reject]:
        return self.verifier.counts

    @property
    def connected(self) -> bool:
        return bool(getattr(self.link, "connected", True))

    def sign(self, topic: str, payload: Any, *, will: bool = False) -> bytes:
        return self.signer.sign(topic, _bytes(payload), will=will)

    def publish(self, topic: str, payload: Any, *, retain: bool = False, qos: int = 1) -> Any:
        return self.link.publish(topic, self.sign(topic, payload), retain=retain, qos=qos)

    def subscribe(self, filter: str, callback: Callback) -> Any:
        def verified(topic: str, data: bytes) -> None:
            msg = self.verify(topic, data)
            if msg is not None:
                callback(topic, bytes(msg.payload))

        return self.link.subscribe(filter, verified)

    def verify(self, topic: str, data: bytes | bytearray | memoryview) -> Verified | None:
        """The verified message, or ``None`` (dropped, counted, logged at debug level)."""
        try:
            return self.verifier.verify(topic, data)
        except AuthRejected as exc:
            log.debug("dropped message on %s: %s", topic, exc)
            if self._on_reject is not None:
                self._on_reject(topic, exc.reason)
            return None

    def close(self) -> None:
        self.link.close()
