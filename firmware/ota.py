"""Over-the-air, board side: a resumable image download (HTTP range requests) and staging.

``download`` keeps what it has received in ``DEST.part``; after a dropped connection it asks
for ``Range: bytes=<have>-`` and appends, so no byte already on the board is fetched again.
A server that ignores the range (200 instead of 206) restarts the file from zero. The
downloaded file is never trusted: ``stage`` hands it to :func:`firmware.device.flash`, which
verifies everything before writing the inactive slot.
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from firmware.device import flash
from firmware.errors import FirmwareError

__all__ = ["DownloadStats", "download", "stage", "MAX_DOWNLOAD"]

MAX_DOWNLOAD = 4 << 30
_CHUNK = 1 << 16
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


@dataclass
class DownloadStats:
    size: int = 0
    requests: int = 0
    bytes_received: int = 0  # payload bytes over the wire, all requests together
    resumed: int = 0  # requests that continued a partial file with a range


def _open(url: str, start: int, token: str | None, timeout: float) -> Any:
    headers = {"Range": f"bytes={start}-"} if start else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)


def download(
    url: str,
    dest: str | Path,
    *,
    token: str | None = None,
    retries: int = 5,
    timeout: float = 30.0,
    max_bytes: int = MAX_DOWNLOAD,
) -> DownloadStats:
    """Fetch ``url`` into ``dest`` (atomically renamed when complete), resuming after cuts."""
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    stats = DownloadStats()
    last_error = ""
    for attempt in range(retries + 1):
        have = part.stat().st_size if part.exists() else 0
        try:
            resp = _open(url, have, token, timeout)
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and have:  # our partial file is stale or complete: start over
                part.unlink()
                continue
            raise FirmwareError(
                f"download of {url} failed: HTTP {exc.code}", hint="check the image id and the fleet token"
            ) from None
        except OSError as exc:
            last_error = str(exc)
            time.sleep(min(0.2 * 2**attempt, 5))
            continue
        stats.requests += 1
        with resp:
            if resp.status == 206:
                m = _RANGE.fullmatch(resp.headers.get("Content-Range", ""))
                if m is None or int(m[1]) != have:
                    raise FirmwareError(
                        f"{url} answered a range request with a wrong Content-Range",
                        hint="the server or a proxy mangles range requests",
                    )
                total = int(m[3])
                stats.resumed += 1
                mode = "ab"
            else:
                total = int(resp.headers.get("Content-Length", "-1"))
                have, mode = 0, "wb"
            if total < 0 or total > max_bytes:
                raise FirmwareError(f"{url} has no usable size ({total})", hint="images are limited to 4 GiB")
            stats.size = total
            try:
                with open(part, mode) as fh:
                    while chunk := resp.read(_CHUNK):
                        if have + len(chunk) > total:
                            raise FirmwareError(f"{url} sent more than its {total} bytes", hint="retry later")
                        fh.write(chunk)
                        have += len(chunk)
                        stats.bytes_received += len(chunk)
                    fh.flush()
                    os.fsync(fh.fileno())
            except OSError as exc:  # connection cut mid-body: keep what arrived, resume
                last_error = str(exc)
                continue
        if have == total:
            os.replace(part, dest)
            return stats
        last_error = f"connection closed after {have} of {total} bytes"
    raise FirmwareError(
        f"download of {url} did not complete after {retries + 1} attempts ({last_error})",
        hint="check the network; a new attempt resumes where this one stopped",
    )


def stage(
    url: str, device: str | Path, *, token: str | None = None, allow_downgrade: bool = False
) -> tuple[DownloadStats, dict[str, Any]]:
    """Download an image into the device's data area and flash it into the inactive slot."""
    dl_dir = Path(device) / "data" / "downloads"
    dl_dir.mkdir(parents=True, exist_ok=True)
    dest = dl_dir / "staged.img"
    stats = download(url, dest, token=token)
    try:
        result = flash(dest, device, [], allow_downgrade=allow_downgrade)
    finally:
        dest.unlink(missing_ok=True)
    return stats, result
