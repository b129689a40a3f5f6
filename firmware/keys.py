"""ed25519 signing keys for device images (``cryptography``).

Private keys are the project's one key file format (``fractal/keyfile.py``: JSON with the key's
id, mode 0600; a release key in the old PKCS#8 PEM form is still read), public keys
SubjectPublicKeyInfo PEM (``KEY.pub``). A key's id is the first 16 hex digits of the sha256 of its
raw 32 public bytes (shown by ``image info``).
"""

from __future__ import annotations

from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from firmware.errors import FirmwareError, ImageError
from fractal.files import atomic_write
from fractal.keyfile import KeyFile, KeyFileError, derived_key_id, read_key_file, write_key_file

__all__ = [
    "keygen",
    "load_private",
    "load_public",
    "public_from_pem",
    "public_pem",
    "key_id",
    "sign",
    "verify_with",
    "SIG_CONTEXT",
]

# Domain separation: a signature over an image manifest can never be replayed as anything else.
SIG_CONTEXT = b"fractal-image-manifest-v1\0"
_MAX_KEY_FILE = 16 * 1024


def keygen(out: str | Path) -> tuple[Path, Path]:
    """Write a new key pair to ``out`` (private, 0600) and ``out.pub``; refuses to overwrite."""
    priv_path, pub_path = Path(out), Path(f"{out}.pub")
    for p in (priv_path, pub_path):
        if p.exists():
            raise FirmwareError(
                f"{p} already exists", hint="choose another --out or delete the old key first"
            )
    key = Ed25519PrivateKey.generate()
    write_key_file(priv_path, KeyFile(key_id(key.public_key()), "release", "image", key))
    atomic_write(pub_path, public_pem(key.public_key()))
    return priv_path, pub_path


def _read_small(path: str | Path, what: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise FirmwareError(
            f"{what} {str(p)!r} does not exist", hint="create one with `fractal image keygen`"
        )
    if p.stat().st_size > _MAX_KEY_FILE:
        raise FirmwareError(
            f"{what} {str(p)!r} is too large to be a key", hint="pass an ed25519 PEM key file"
        )
    return p.read_bytes()


def load_private(path: str | Path) -> Ed25519PrivateKey:
    """A release key (the key file format of fractal/keyfile.py, or the old PEM form)."""
    try:
        return read_key_file(path).private_key
    except KeyFileError as exc:
        raise FirmwareError(str(exc), hint=exc.hint) from None


def public_from_pem(data: bytes, source: str = "key") -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        raise FirmwareError(
            f"{source} is not a PEM public key", hint="pass the KEY.pub written by `fractal image keygen`"
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise FirmwareError(
            f"{source} is not an ed25519 public key", hint="create one with `fractal image keygen`"
        )
    return key


def load_public(path: str | Path) -> Ed25519PublicKey:
    return public_from_pem(_read_small(path, "public key"), str(path))


def public_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(key: Ed25519PublicKey) -> str:
    return derived_key_id(key)


def sign(key: Ed25519PrivateKey, manifest_bytes: bytes) -> bytes:
    return key.sign(SIG_CONTEXT + manifest_bytes)


def verify_with(keys: list[Ed25519PublicKey], manifest_bytes: bytes, signature: bytes) -> Ed25519PublicKey:
    """The key among ``keys`` whose signature ``signature`` is; ImageError when none."""
    for k in keys:
        try:
            k.verify(signature, SIG_CONTEXT + manifest_bytes)
            return k
        except InvalidSignature:
            continue
    raise ImageError(
        "the image signature does not verify with any trusted key (tampered manifest or signature, "
        "or signed by an unknown key)",
        hint="sign the image with a key the device trusts (`fractal image build --key`)",
    )
