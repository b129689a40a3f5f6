"""Over-the-air, board side: a resumable image download (HTTP range requests) and staging.

``download`` keeps what it has received in ``DEST.part``; after a dropped connection it asks
for ``Range: bytes=<have>-`` and appends, so no byte already on the board is fetched again.
A server that ignores the range (200 instead of 206) restarts the file from zero. The
downloaded file is never trusted: ``stage`` hands it to :func:`firmware.device.flash`, which
verifies everything before writing the inactive slot.

``DeviceUpdates`` is the node's side of a fleet roll-out (edgenode/updates.py drives it): update
or roll back for the next boot, keep a record in the data area, and report the outcome after the
restart from that record and the boot state (``done``, ``trial``, ``rolled_back``, ``failed``).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiler.manifest import file_sha256
from firmware.bootstate import SLOTS, Health, SlotState
from firmware.device import flash
from firmware.errors import FirmwareError
from fractal.files import atomic_write, replace_durably

__all__ = ["DownloadStats", "download", "stage", "MAX_DOWNLOAD", "DeviceUpdates", "Phase", "UPDATE_RECORD"]

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
            if total < 0:
                raise FirmwareError(f"{url} has no usable size", hint="the server sent no Content-Length")
            if total > max_bytes:
                raise FirmwareError(
                    f"{url} is {total} bytes, more than the {max_bytes} expected",
                    hint="images are limited to 4 GiB; a roll-out names the image's size",
                )
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
            replace_durably(part, dest)
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


# -- the node's side of a fleet roll-out ---------------------------------------------------------

UPDATE_RECORD = "ota-update.json"  # in the data area: survives the restart into the new slot


class Phase:
    """Phases of an update as the device reports them (``federation.messages.UpdatePhase`` values)."""

    DOWNLOADING = "downloading"
    REBOOTING = "rebooting"
    TRIAL = "trial"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


class DeviceUpdates:
    """A running node's handle on the device it was booted from (``device`` in NODE.toml).

    ``update`` / ``rollback`` change the boot state for the next start and leave a record in the
    data area; the node then exits with :data:`firmware.boot.REBOOT_EXIT_CODE` and its boot
    supervisor starts the new slot. :meth:`report` reads the record together with the boot state,
    so after the restart the node can say whether the new slot passed (``done``), is still on
    trial, or failed and the board fell back (``rolled_back``).
    """

    def __init__(self, device: str | Path) -> None:
        from firmware.device import Device

        self.dev = Device(Path(device))
        self.record_path = self.dev.data / UPDATE_RECORD

    def _record(self) -> dict[str, Any] | None:
        try:
            rec = json.loads(self.record_path.read_bytes())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) and "update_id" in rec else None

    def _write(self, rec: dict[str, Any]) -> None:
        atomic_write(self.record_path, json.dumps(rec, sort_keys=True).encode())

    def last_update_id(self) -> str | None:
        rec = self._record()
        return None if rec is None else str(rec["update_id"])

    def begin(self, update_id: str, kind: str, version: str) -> None:
        self._write({"update_id": update_id, "kind": kind, "version": version, "phase": Phase.DOWNLOADING})

    def fail(self, update_id: str, kind: str, version: str, error: str | BaseException) -> None:
        """Record a refusal; a FirmwareError is written as its one line plus ``(help: ...)``."""
        if isinstance(error, FirmwareError) and error.hint:
            error = f"{error} (help: {error.hint})"
        self._write({"update_id": update_id, "kind": kind, "version": version, "phase": Phase.FAILED,
                     "error": str(error)[:500]})

    def update(
        self, update_id: str, url: str, image_id: str, *, max_bytes: int = MAX_DOWNLOAD
    ) -> DownloadStats:
        """Download (resumable), check the file's sha256 against ``image_id``, flash the inactive slot."""
        dl_dir = self.dev.data / "downloads"
        dl_dir.mkdir(parents=True, exist_ok=True)
        dest = dl_dir / f"{image_id}.img"
        for old in dl_dir.iterdir():  # one partial download at a time: commands cannot fill the disk
            if old.name != f"{dest.name}.part" and old.is_file():
                old.unlink()
        stats = download(url, dest, max_bytes=max_bytes)
        try:
            digest = file_sha256(dest)
            if not digest.startswith(image_id):
                raise FirmwareError(
                    f"the downloaded image's sha256 {digest[:32]} is not image {image_id}",
                    hint="the fleet or a proxy served another file",
                )
            result = flash(dest, self.dev.root, [], lock_wait_s=60.0)
        finally:
            dest.unlink(missing_ok=True)
        self._write({"update_id": update_id, "kind": "update", "version": result["version"],
                     "phase": Phase.REBOOTING, "slot": result["slot"]})
        return stats

    def rollback(self, rollback_id: str) -> dict[str, Any]:
        """Make the previous good slot active (firmware.device.rollback) and record it."""
        from firmware.device import rollback

        result = rollback(self.dev.root, lock_wait_s=60.0)
        self._write({"update_id": rollback_id, "kind": "rollback", "version": result["version"],
                     "phase": Phase.REBOOTING, "slot": result["slot"]})
        return result

    def recover(self) -> str | None:
        """At node start: settle a record a power cut or crash left in ``downloading`` (no update
        runs in a process that just started). When the flash had switched to the new slot (a slot
        holds the update's version, on trial, good or failed), the record becomes ``rebooting`` to
        that slot and :meth:`report` derives the outcome as after any restart; otherwise the
        install never completed and the record says ``failed`` (nothing was switched), so the
        fleet's roll-out ends now instead of at its stage deadline. Returns the new phase, if any."""
        rec = self._record()
        if rec is None or rec.get("phase") != Phase.DOWNLOADING:
            return None
        try:
            state = self.dev.load_state()
        except FirmwareError:
            return None
        done = [s for s in SLOTS if state.slot(s).version == rec.get("version")
                and state.slot(s).state in (SlotState.TRIAL, SlotState.GOOD, SlotState.BAD)]
        if rec.get("kind") == "update" and done:
            self._write({**rec, "phase": Phase.REBOOTING, "slot": done[0]})
            return Phase.REBOOTING
        self._write({**rec, "phase": Phase.FAILED,
                     "error": f"interrupted: the board restarted before the {rec.get('kind')} completed "
                              "(power cut or crash); the slots were not switched"})
        return Phase.FAILED

    def report(self) -> dict[str, Any] | None:
        """{version, slot, state, health, previous, update} of the slot this node runs from (None if
        unknown); ``health`` is this boot's health check: pending or passed."""
        try:
            state = self.dev.load_state()
        except FirmwareError:
            return None
        booted = state.booted
        if booted is None:
            return None
        prev = state.previous
        out: dict[str, Any] = {
            "version": state.slot(booted).version or "",
            "slot": booted,
            "state": state.slot(booted).state.value,
            "health": state.health.value,
            "previous": (state.slot(prev).version or "") if prev is not None else None,
            "update": None,
        }
        rec = self._record()
        if rec is not None:
            upd = {k: rec.get(k) for k in ("update_id", "kind", "phase", "version", "error")}
            if rec.get("phase") == Phase.REBOOTING and rec.get("slot") in SLOTS:
                target = state.slot(rec["slot"])
                if target.state is SlotState.BAD and target.version == rec.get("version"):
                    upd["phase"] = Phase.ROLLED_BACK
                    upd["error"] = str(target.problem or "the new slot failed")[:500]
                elif booted == rec["slot"]:
                    passed = target.state is SlotState.GOOD and state.health is Health.PASSED
                    upd["phase"] = Phase.DONE if passed else Phase.TRIAL
            out["update"] = upd
        return out

