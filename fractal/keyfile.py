"""The one ed25519 private key file format, for every key the project makes: the swarm's message
keys (``deploy/keys.py``, a device's enrolment key) and the release keys that sign device images
(``fractal image keygen``).

One JSON object on one line, mode 0600, written atomically::

    {"v": 1, "key_id": "...", "sender": "...", "role": "...",
     "private_key": "<base64 of the 32-byte ed25519 seed>",
     "dh_private": "<base64 X25519 key>"}          # nodes only: the ring's pairwise frame MACs

Why this one and not PEM: a key file must say whose key it is and under which id others know it
(the swarm's keyring is keyed by ``key_id`` and checks ``sender``), and a node's file carries its
X25519 key too; PKCS#8 PEM holds one bare key. Public keys stay where they are read: the keyring
(JSON) for the swarm, ``KEY.pub`` (SubjectPublicKeyInfo PEM) for images.

Read for one release, never written: an image release key in the old PKCS#8 PEM form
(what ``fractal image keygen`` wrote until this format; ``read_key_file`` gives it its derived id
and role ``image``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fractal import FractalError
from fractal.files import atomic_write

__all__ = ["KEY_FILE_VERSION", "KeyFile", "KeyFileError", "read_key_file", "write_key_file", "derived_key_id"]

KEY_FILE_VERSION = 1
_MAX_KEY_FILE = 16 * 1024
_RAW = (serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


class KeyFileError(FractalError):
    """A key file that is missing, unreadable or not an ed25519 key file."""


def derived_key_id(pub: Ed25519PublicKey) -> str:
    """First 16 hex digits of the sha256 of the raw public key (an image key's id)."""
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class KeyFile:
    key_id: str
    sender: str
    role: str
    private_key: Ed25519PrivateKey
    dh_private: X25519PrivateKey | None = None

    def to_json(self) -> str:
        doc = {"v": KEY_FILE_VERSION, "key_id": self.key_id, "sender": self.sender, "role": self.role,
               "private_key": base64.b64encode(self.private_key.private_bytes(*_RAW)).decode()}
        if self.dh_private is not None:
            doc["dh_private"] = base64.b64encode(self.dh_private.private_bytes(*_RAW)).decode()
        return json.dumps(doc) + "\n"


def write_key_file(path: str | Path, kf: KeyFile) -> Path:
    """Write ``kf`` to ``path`` (mode 0600 from its first byte; atomic; parent made 0700)."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(path, kf.to_json(), mode=0o600)
    return path


def _bad(path: Path, why: str) -> KeyFileError:
    return KeyFileError(f"{path} is not an ed25519 key file ({why})",
                        hint="pass a key written by `fractal image keygen` or deploy/keys.py (not KEY.pub)")


def read_key_file(path: str | Path) -> KeyFile:
    """Read a key file (or, for one release, an image key in the old PKCS#8 PEM form)."""
    p = Path(path)
    if not p.is_file():
        raise KeyFileError(f"key file {str(p)!r} does not exist",
                           hint="create one with `fractal image keygen` or deploy/keys.py")
    if p.stat().st_size > _MAX_KEY_FILE:
        raise _bad(p, "too large to be a key")
    data = p.read_bytes()
    if data.lstrip().startswith(b"-----BEGIN"):
        return _read_old_pem(p, data)
    try:
        doc = json.loads(data)
    except ValueError:
        raise _bad(p, "neither JSON nor PEM") from None
    if not isinstance(doc, dict):
        raise _bad(p, "not a JSON object")
    if doc.get("v") != KEY_FILE_VERSION:
        raise _bad(p, f"unsupported key file version {doc.get('v')!r}")
    try:
        key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(doc["private_key"], validate=True))
        dh_raw = doc.get("dh_private")
        dh = X25519PrivateKey.from_private_bytes(base64.b64decode(dh_raw, validate=True)) if dh_raw else None
        ids = (doc["key_id"], doc["sender"], doc.get("role", ""))
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise _bad(p, f"bad field: {exc}") from None
    if not all(isinstance(s, str) for s in ids):
        raise _bad(p, "key_id, sender and role must be strings")
    return KeyFile(ids[0], ids[1], ids[2], key, dh)


def _read_old_pem(p: Path, data: bytes) -> KeyFile:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise _bad(p, "not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise _bad(p, "a PEM key of another algorithm")
    return KeyFile(derived_key_id(key.public_key()), "", "image", key)
