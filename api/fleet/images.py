"""The fleet's image catalogue: uploaded device images, verified before they are listed.

Images live in ``images_dir`` as ``<sha256>.img`` next to ``catalogue.json`` (id, version,
board, size, signer). An upload is streamed to a temp file with a size cap, then fully verified
(:func:`firmware.image.open_image` against the fleet's trusted keys); only then is it renamed
into the catalogue. Nodes download them with range requests (resumable, firmware/ota.py).

Nodes do not hold the operator token: the download URL in an ImageUpdateCommand carries a grant,
``?exp=T&grant=HMAC(key, "id:T")``, good for that one image until ``T``: at most :data:`GRANT_S`
after the roll-out stage that sent it started. In a signed swarm the node must also prove it is
a node the roll-out addresses (:mod:`federation.grants`; checked by the fleet service).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from firmware.image import MAX_IMAGE, open_image
from firmware.keys import load_public
from fractal.files import atomic_write, replace_durably

__all__ = ["ImageCatalogue", "UploadTooLarge", "GrantRefused", "GRANT_S"]

# A download grant's lifetime, from the stage's command (shorter when the stage's deadline comes
# first): long enough to download and resume after cuts, short enough that a grant read off the
# broker is soon worth nothing.
GRANT_S = 900

# ASCII only: str.isdigit() also accepts '²' and other Unicode digits, which int() then refuses.
_EXP = re.compile(r"[0-9]{1,12}")
_GRANT = re.compile(r"[0-9a-f]{64}")


class UploadTooLarge(Exception):
    pass


class GrantRefused(Exception):
    """A download grant that does not open the image: ``status`` 400 (malformed) or 401/403."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class ImageCatalogue:
    def __init__(self, directory: str | Path, key_files: list[str], *,
                 grant_key: bytes | None = None) -> None:
        self.dir = Path(directory)
        self._grant_key = grant_key or os.urandom(32)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keys = [load_public(p) for p in key_files]
        self._lock = threading.Lock()
        self._index = self.dir / "catalogue.json"

    def list(self) -> list[dict[str, Any]]:
        if not self._index.is_file():
            return []
        return list(json.loads(self._index.read_text()))

    def entry(self, image_id: str) -> dict[str, Any] | None:
        return next((e for e in self.list() if e["id"] == image_id), None)

    def _grant(self, image_id: str, exp: int) -> str:
        return hmac.new(self._grant_key, f"{image_id}:{exp}".encode(), hashlib.sha256).hexdigest()

    def grant_query(self, image_id: str, exp: int) -> str:
        """``exp=T&grant=G``: lets a node download ``image_id`` without the operator token until ``exp``."""
        return f"exp={int(exp)}&grant={self._grant(image_id, int(exp))}"

    def check_grant(self, image_id: str, exp: str | None, grant: str | None, now: float) -> int:
        """The grant's expiry when ``(exp, grant)`` opens ``image_id`` at ``now``; else GrantRefused."""
        if exp is None and grant is None:
            raise GrantRefused(401, "missing or wrong operator token or download grant")
        if exp is None or not _EXP.fullmatch(exp):
            raise GrantRefused(400, "download grant: exp must be a Unix time of 1 to 12 ASCII digits")
        if grant is None or not _GRANT.fullmatch(grant):
            raise GrantRefused(400, "download grant: grant must be 64 lowercase hex digits")
        if not hmac.compare_digest(grant, self._grant(image_id, int(exp))):
            raise GrantRefused(401, "download grant is not valid for this image")
        if int(exp) < now:
            raise GrantRefused(401, "download grant expired: the fleet sends a new one with the next command")
        return int(exp)

    def path(self, image_id: str) -> Path | None:
        if not any(e["id"] == image_id for e in self.list()):
            return None
        return self.dir / f"{image_id}.img"

    async def add(self, chunks: AsyncIterator[bytes], max_bytes: int = MAX_IMAGE) -> dict[str, Any]:
        """Store, verify and list an uploaded image; FirmwareError (-> 400) when it does not verify."""
        tmp = self.dir / f".upload-{os.getpid()}-{threading.get_ident()}-{id(chunks)}"
        h = hashlib.sha256()
        size = 0
        try:
            with open(tmp, "wb") as fh:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise UploadTooLarge(f"the upload exceeds {max_bytes} bytes")
                    h.update(chunk)
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
            if not self.keys:
                from firmware.errors import ImageError

                raise ImageError(
                    "the fleet trusts no image key",
                    hint="set image_keys (FRACTAL_FLEET_IMAGE_KEYS) to the release KEY.pub files",
                )
            img = open_image(tmp, self.keys)
            entry = {
                "id": h.hexdigest()[:32],
                "version": img.version,
                "board": img.board,
                "arch": img.manifest["arch"],
                "size": size,
                "signer": img.signer,
                "rollback_index": img.rollback_index,
                "artifact": img.manifest["artifact_name"],
            }
            with self._lock:
                replace_durably(tmp, self.dir / f"{entry['id']}.img")
                entries = [e for e in self.list() if e["id"] != entry["id"]] + [entry]
                atomic_write(self._index, json.dumps(entries, indent=1))
            return entry
        finally:
            tmp.unlink(missing_ok=True)
