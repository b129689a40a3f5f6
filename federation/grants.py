"""Image-download grants bound to the node that uses them (federation/PROTOCOL.md, section 9).

An ImageUpdateCommand travels on the broker, where anyone who may subscribe can read it; its URL
carries the fleet's grant (``exp``, ``grant``: an HMAC only the fleet can make, for one image,
until ``exp``). In a signed swarm a grant alone opens nothing: the node adds its proof,

    node=NODE&proof=KEY_ID:SIG      SIG = ed25519(node key, CONTEXT + image \\0 exp \\0 grant \\0 NODE)

(base64url, no padding), and the fleet checks it against the keyring, so a grant read off the
broker is useless to anyone without that node's key. Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import base64
import binascii
import re
from urllib.parse import parse_qs, urlsplit

from cryptography.exceptions import InvalidSignature

from federation.auth import Keyring, Role, Signer

__all__ = ["CONTEXT", "proof_message", "prove", "prove_url", "verify_proof"]

CONTEXT = b"fractal-edge/image-grant/v1\0"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SIG = re.compile(r"[A-Za-z0-9_-]{86}")  # 64 bytes, base64url without padding


def proof_message(image_id: str, exp: int, grant: str, node_id: str) -> bytes:
    """The bytes a node signs to use the grant ``(image_id, exp, grant)``."""
    return CONTEXT + "\0".join((image_id, str(int(exp)), grant, node_id)).encode()


def prove(signer: Signer, image_id: str, exp: int, grant: str) -> str:
    """``KEY_ID:SIG``: the signer's proof that it, and nobody else, uses this grant."""
    sig = signer.sign_detached(proof_message(image_id, exp, grant, signer.sender))
    return f"{signer.key_id}:{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"


def prove_url(url: str, image_id: str, signer: Signer) -> str:
    """``url`` with ``node`` and ``proof`` appended; unchanged when it carries no grant."""
    q = parse_qs(urlsplit(url).query)
    exp, grant = q.get("exp", [""])[0], q.get("grant", [""])[0]
    if not exp.isascii() or not exp.isdigit() or not grant:
        return url
    return f"{url}&node={signer.sender}&proof={prove(signer, image_id, int(exp), grant)}"


def verify_proof(keyring: Keyring, node_id: str, proof: str, image_id: str, exp: int, grant: str) -> bool:
    """Did ``node_id`` (an unrevoked node key of the keyring) sign this grant?"""
    key_id, _, sig = proof.partition(":")
    if not _ID.fullmatch(node_id) or not _ID.fullmatch(key_id) or not _SIG.fullmatch(sig):
        return False
    entry = keyring.get(key_id)
    if entry is None or entry.sender != node_id or entry.role != Role.NODE:
        return False
    try:
        raw = base64.urlsafe_b64decode(sig + "==")
        entry.public_key.verify(raw, proof_message(image_id, exp, grant, node_id))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True
