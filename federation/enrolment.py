"""Enrolment wire rules shared by the fleet and a device (pure: no I/O).

* A device proves it holds the private key it announces: its request carries an ed25519
  signature (``proof``) over :data:`REQUEST_CTX` + the request's fields; its polls carry one over
  :data:`POLL_CTX` + device id + a timestamp (fresh within :data:`POLL_MAX_AGE_S`), so only the
  key's holder learns its broker password.
* The key id of a device's key is derived from its id and key (:func:`device_key_id`), so both
  sides agree on it without another round trip.
* The fleet signs the keyring it hands out (:data:`KEYRING_CTX`, detached signature) and publishes
  updates as a retained, signed message on ``fractal/v1/{swarm}/keyring``; a member accepts an
  update only when :func:`check_update` finds it adds keys or revokes key ids and changes nothing
  else (so an old keyring replayed, which lacks newer keys, is refused).
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from federation.auth import Keyring, Role, public_key_b64, raw_b64
from federation.errors import FederationError

__all__ = [
    "REQUEST_CTX",
    "POLL_CTX",
    "KEYRING_CTX",
    "POLL_MAX_AGE_S",
    "fingerprint",
    "device_key_id",
    "request_message",
    "poll_message",
    "keyring_message",
    "verify_sig",
    "check_update",
    "keyring_topic",
]

REQUEST_CTX = b"fractal-edge/enrol-request/v1\x00"
POLL_CTX = b"fractal-edge/enrol-poll/v1\x00"
KEYRING_CTX = b"fractal-edge/keyring/v1\x00"
POLL_MAX_AGE_S = 120.0


def keyring_topic(swarm: str) -> str:
    return f"fractal/v1/{swarm}/keyring"


def fingerprint(public_key_b64_text: str) -> str:
    """``SHA256:`` + hex of the raw 32-byte public key's SHA-256 (what the dashboard shows)."""
    return "SHA256:" + hashlib.sha256(base64.b64decode(public_key_b64_text, validate=True)).hexdigest()


def device_key_id(device_id: str, public_key_b64_text: str) -> str:
    """The key id of a device's enrolled key (<= 64 characters, keyring id pattern)."""
    return f"{device_id[:50]}-e{fingerprint(public_key_b64_text)[7:19]}"


def request_message(
    device_id: str, arch: str, board: str, public_key: str, dh_public: str, token: str
) -> bytes:
    return REQUEST_CTX + "\x00".join((device_id, arch, board, public_key, dh_public, token)).encode()


def poll_message(device_id: str, ts: int) -> bytes:
    return POLL_CTX + f"{device_id}\x00{ts}".encode()


def keyring_message(keyring_json: str) -> bytes:
    return KEYRING_CTX + keyring_json.encode()


def verify_sig(public_key_b64_text: str, sig_b64: str, message: bytes) -> bool:
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key_b64_text, validate=True))
        key.verify(base64.b64decode(sig_b64, validate=True), message)
    except (ValueError, InvalidSignature):
        return False
    return True


def _entries(ring: Keyring) -> dict[str, tuple[str, str, str, str | None]]:
    out = {}
    for e in ring.entries():
        out[e.key_id] = (
            e.sender,
            e.role.value,
            public_key_b64(e.public_key),
            raw_b64(e.dh_public) if e.dh_public else None,
        )
    return out


def check_update(current: Keyring, new: Keyring) -> tuple[list[str], list[str]]:
    """(added key ids, newly revoked key ids) of ``new`` over ``current``; FederationError when
    ``new`` changes anything else: another swarm, a key removed or altered, a revocation lifted,
    a fleet key added (the fleet's key is set at provisioning, never over the air)."""
    if new.swarm != current.swarm:
        raise FederationError(f"keyring update for swarm {new.swarm!r}, this is {current.swarm!r}")
    old, now = _entries(current), _entries(new)
    for key_id, entry in old.items():
        if now.get(key_id) != entry:
            raise FederationError(f"keyring update removes or changes key {key_id!r}")
    if not current.revoked <= new.revoked:
        raise FederationError("keyring update lifts a revocation")
    added = [k for k in now if k not in old]
    for k in added:
        if now[k][1] != Role.NODE.value:
            raise FederationError(f"keyring update adds a {now[k][1]} key {k!r}: only node keys may be added")
    return added, sorted(new.revoked - current.revoked)


def public_b64(key: Ed25519PublicKey) -> str:
    return base64.b64encode(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def apply_update(current: Keyring, topic: str, payload: bytes,
                 verifier_factory) -> tuple[list[str], list[str]]:
    """Check a signed keyring update (an envelope from the fleet on :func:`keyring_topic`) and apply
    it to ``current`` in place; (added, revoked). ``verifier_factory(keyring)`` makes the envelope
    verifier (the receiver's policy and clock; retained updates may be old, so its max age is long:
    a replayed older keyring lacks newer keys and :func:`check_update` refuses it)."""
    from federation.auth import AuthRejected

    verifier = verifier_factory(current)
    try:
        msg = verifier.verify(topic, payload)
    except AuthRejected as exc:
        raise FederationError(f"keyring update refused: {exc}") from None
    if msg.role != Role.FLEET:
        raise FederationError("keyring update not signed by the fleet")
    new = Keyring.from_json(bytes(msg.payload))
    added, revoked = check_update(current, new)
    for e in new.entries():
        if e.key_id in added:
            current.add(e)
    for k in revoked:
        current.revoke(k)
    return added, revoked
