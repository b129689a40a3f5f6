"""Images crafted by someone holding a trusted key: an image's manifest and members changed, then
signed again (the attacks of issue 26 that a signature alone does not stop)."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def craft(src: Path, out: Path, key: Path, mutate: Callable[[dict[str, Any]], Any] | None = None,
          members: dict[str, bytes] | None = None) -> Path:
    """``src`` re-signed with ``key`` after ``mutate(manifest)`` and with ``members`` replaced
    (sizes and sha256 updated, so only what the test means to break is broken)."""
    from firmware import keys as keymod

    data = src.read_bytes()
    _, mlen, slen = struct.unpack(">8sIH", data[:14])
    manifest = json.loads(data[14:14 + mlen])
    payload = data[14 + mlen + slen:]
    parts, off = {}, 0
    for e in manifest["members"]:
        parts[e["name"]] = payload[off:off + e["size"]]
        off += e["size"]
    for name, content in (members or {}).items():
        parts[name] = content
        entry = next(e for e in manifest["members"] if e["name"] == name)
        entry.update(size=len(content), sha256=hashlib.sha256(content).hexdigest())
    if mutate is not None:
        mutate(manifest)
    body = b"".join(parts.get(e.get("name"), b"") for e in manifest["members"] if isinstance(e, dict))
    mb = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    sig = keymod.sign(keymod.load_private(key), mb)
    out.write_bytes(struct.pack(">8sIH", b"FRCTIMG1", len(mb), len(sig)) + mb + sig + body)
    return out
