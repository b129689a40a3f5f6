"""The board's storage, a directory: two slots, a data area, and the boot state.

Layout::

    DEVICE/a/, DEVICE/b/        slots: the image's members plus image.manifest.json + image.sig
    DEVICE/data/                survives updates: node/ (samples, parameters), keys/ (trusted *.pub),
                                node.extra.toml (device settings appended to the node config)
    DEVICE/data/boot-state.json active/previous slot, per-slot state, trials, version floor
    DEVICE/.lock                flock held while the boot state is read-modified-written

Only the inactive slot is ever written. A flash first marks that slot ``writing`` (so nothing
boots half-written files), writes and fsyncs every file and directory, re-verifies the slot
from disk, then switches the boot state with write-temp, fsync, rename, fsync-dir. A SIGKILL at
any point leaves either the old state (previous slot still active and intact) or the new one.

Anti-rollback: every image carries an integer ``rollback_index``; the device keeps the highest
index of any slot that passed its health check (``rollback_floor``) and refuses images below
it even with ``--allow-downgrade`` (which only permits a lower semantic version). So a
re-signed old image cannot roll the board back past a fixed vulnerability.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from firmware import keys as keymod
from firmware.bootstate import DEFAULT_TRIALS, SLOTS, BootState, SlotRecord, SlotState, other
from firmware.errors import DeviceError, FirmwareError, ImageError
from firmware.faults import NO_FLASH_FAULTS, FlashFaults, die
from firmware.image import Image, open_image
from firmware.manifest import ImageManifest, member_name_ok, parse_manifest, parse_version
from fractal.files import atomic_write, fsync_dir

__all__ = ["Device", "SLOTS", "SlotState", "flash", "rollback", "status", "verify_slot", "promote_keys"]

SLOT_MANIFEST = "image.manifest.json"
SLOT_SIG = "image.sig"


@dataclass
class Device:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def state_path(self) -> Path:
        return self.data / "boot-state.json"

    @property
    def keys_dir(self) -> Path:
        return self.data / "keys"

    def slot(self, name: str) -> Path:
        return self.root / name

    def provisioned(self) -> bool:
        return self.state_path.is_file()

    @contextlib.contextmanager
    def locked(self, wait_s: float = 0.0) -> Iterator[None]:
        """Hold the device lock; wait up to ``wait_s`` for another holder (a CLI flash does not wait,
        the boot supervisor and a node's over-the-air flash do: they run next to each other)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise DeviceError(
                            f"device {self.root} is busy (another flash or boot holds its lock)",
                            hint="wait for it to finish, then retry",
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    def load_state(self) -> BootState:
        if not self.provisioned():
            raise DeviceError(
                f"{self.root} is not a provisioned device (no {self.state_path.name})",
                hint="flash a first image with `fractal image flash IMAGE --device PATH --pubkey KEY.pub`",
            )
        try:
            raw = json.loads(self.state_path.read_bytes())
        except ValueError:
            raise DeviceError(
                f"the boot state of {self.root} is corrupt", hint="re-provision the device"
            ) from None
        try:
            return BootState.from_json(raw)
        except (ValueError, KeyError, TypeError):
            raise DeviceError(
                f"the boot state of {self.root} has an unknown format", hint="re-provision the device"
            ) from None

    def save_state(self, state: BootState, *, before_rename: Callable[[], None] | None = None) -> None:
        atomic_write(
            self.state_path, json.dumps(state.to_json(), indent=1, sort_keys=True).encode(),
            before_rename=before_rename,
        )

    def trusted(self) -> list[Ed25519PublicKey]:
        return [keymod.load_public(p) for p in sorted(self.keys_dir.glob("*.pub"))]

    def add_key(self, key: Ed25519PublicKey) -> None:
        self.keys_dir.mkdir(parents=True, exist_ok=True)
        path = self.keys_dir / f"{keymod.key_id(key)}.pub"
        if not path.exists():
            atomic_write(path, keymod.public_pem(key))


def promote_keys(dev: Device, pems: list[str]) -> list[str]:
    """Trust the keys a slot's image asked for (once it booted good); their ids."""
    ids = []
    for pem in pems:
        key = keymod.public_from_pem(pem.encode(), "a key in the image")
        dev.add_key(key)
        ids.append(keymod.key_id(key))
    return ids


def _write_slot(img: Image, slot_dir: Path, faults: FlashFaults) -> None:
    """Replace ``slot_dir``'s contents with the image's members, every file and directory fsynced."""
    if slot_dir.is_symlink():
        raise DeviceError(f"slot {slot_dir} is a symlink", hint="the device directory was tampered with")
    shutil.rmtree(slot_dir, ignore_errors=True)
    slot_dir.mkdir(parents=True)
    written = 0
    dirs = {slot_dir}
    with open(img.path, "rb") as src:
        for m in img.members:
            dest = slot_dir / m.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dirs.add(dest.parent)
            mode = 0o755 if m.executable else 0o644
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out:
                for chunk in img.iter_member(src, m):
                    if (head := faults.cut(written, chunk)) is not None:
                        out.write(head)
                        out.flush()
                        die()
                    out.write(chunk)
                    written += len(chunk)
                out.flush()
                os.fsync(out.fileno())
    for name, data in ((SLOT_MANIFEST, img.manifest_bytes), (SLOT_SIG, img.signature)):
        atomic_write(slot_dir / name, data)
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        fsync_dir(d)
    fsync_dir(slot_dir.parent)


def verify_slot(dev: Device, slot: str) -> ImageManifest:
    """Re-verify a slot from disk (signature by a trusted key, the manifest, every member's sha256)."""
    d = dev.slot(slot)
    try:
        mbytes = (d / SLOT_MANIFEST).read_bytes()
        sig = (d / SLOT_SIG).read_bytes()
    except OSError:
        raise DeviceError(f"slot {slot} holds no complete image", hint="flash an image into it") from None
    keymod.verify_with(dev.trusted(), mbytes, sig)
    try:
        raw = json.loads(mbytes)
    except ValueError:
        raise DeviceError(f"slot {slot} has a corrupt manifest", hint="flash the slot again") from None
    manifest = parse_manifest(raw, f"slot {slot}")
    for m in manifest.members:
        name = m.name
        if not member_name_ok(name):
            raise DeviceError(f"slot {slot} lists an unsafe member {name!r}", hint="flash the slot again")
        path = d / name
        if path.is_symlink() or not path.is_file():
            raise DeviceError(f"slot {slot} misses file {name!r}", hint="flash the slot again")
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        if h.hexdigest() != m.sha256:
            raise DeviceError(
                f"slot {slot} file {name!r} fails its sha256 check", hint="flash the slot again"
            )
    return manifest


def _slot_record(img: Image) -> SlotRecord:
    # The keys this image asks the device to trust stay pending until it booted good (firmware.boot).
    return SlotRecord(SlotState.TRIAL, img.version, img.rollback_index, img.signer, img.spec.artifact_name,
                      img.board, list(img.spec.add_keys))


def flash(
    image: str | Path,
    device: str | Path,
    pubkeys: list[str | Path],
    *,
    allow_downgrade: bool = False,
    trials: int = DEFAULT_TRIALS,
    lock_wait_s: float = 0.0,
    faults: FlashFaults = NO_FLASH_FAULTS,
) -> dict[str, Any]:
    """Verify ``image`` completely, write it into the inactive slot, switch to it for a trial boot.

    ``faults``: where a test kills this process (firmware/faults.py); none in production."""
    dev = Device(Path(device))
    given = [keymod.load_public(p) for p in pubkeys]
    with dev.locked(lock_wait_s):
        if dev.provisioned():
            state = dev.load_state()
            trusted = dev.trusted()
            ids = {keymod.key_id(k) for k in trusted}
            for k in given:
                if keymod.key_id(k) not in ids:
                    raise DeviceError(
                        f"public key {keymod.key_id(k)} is not trusted by this device",
                        hint="a new key is added by an image signed with a key the device trusts",
                    )
        else:
            if not given:
                raise DeviceError(
                    f"{dev.root} is not provisioned and no --pubkey was given",
                    hint="pass --pubkey KEY.pub to provision the device with a trusted key",
                )
            state, trusted = None, given
        img = open_image(image, trusted)  # everything verified before anything is written
        if state is None:
            state = BootState(board=img.board, arch=img.spec.arch)
        if img.board != state.board:
            raise ImageError(
                f"the image is for board {img.board}, this device is a {state.board}",
                hint=f"build the image with --board {state.board}",
            )
        if img.rollback_index < state.rollback_floor:
            raise DeviceError(
                f"the image's rollback index {img.rollback_index} is below the device's floor "
                f"{state.rollback_floor} (anti-rollback)",
                hint="flash an image built with a current --rollback-index",
            )
        active = state.active
        if active is not None and not allow_downgrade:
            cur = state.slot(active).version
            if cur and parse_version(img.version) < parse_version(cur):
                raise DeviceError(
                    f"image version {img.version} is older than the running {cur}",
                    hint="pass --allow-downgrade to install an older version on purpose",
                )
        target = "a" if active is None else other(active)
        on_trial = active is not None and state.slot(active).state is SlotState.TRIAL
        if on_trial and state.good_fallback() == target:
            # The inactive slot is the only known-good fallback while the active one is unconfirmed.
            raise DeviceError(
                f"slot {active} is still on trial and slot {target} is the only good fallback",
                hint="boot the trial slot first (`fractal boot`) or `fractal image rollback`",
            )
        if not dev.provisioned():
            dev.data.mkdir(parents=True, exist_ok=True)
            for k in given:
                dev.add_key(k)
            for s in SLOTS:
                dev.slot(s).mkdir(exist_ok=True)
        state.begin_write(target)
        dev.save_state(state)
        _write_slot(img, dev.slot(target), faults)
        verify_slot(dev, target)  # what is on disk, not what we meant to write
        state.switch_to_trial(target, _slot_record(img), trials)
        dev.save_state(state, before_rename=die if faults.kill_at_switch else None)
        return {"slot": target, "version": img.version, "board": img.board, "signer": img.signer}


def rollback(device: str | Path, *, lock_wait_s: float = 0.0) -> dict[str, Any]:
    """Switch the active slot back to the previous good slot (verified first)."""
    dev = Device(Path(device))
    with dev.locked(lock_wait_s):
        state = dev.load_state()
        prev = state.good_fallback()
        if prev is None:
            raise DeviceError(
                "there is no previous good slot to roll back to",
                hint="see `fractal image status`; flash an image instead",
            )
        manifest = verify_slot(dev, prev)
        if min(state.slot(prev).rollback_index, manifest.rollback_index) < state.rollback_floor:
            raise DeviceError(
                f"slot {prev} is below the device's rollback floor {state.rollback_floor}",
                hint="flash a current image instead",
            )
        state.roll_back()
        dev.save_state(state)
        return {"slot": prev, "version": state.slot(prev).version}


def status(device: str | Path) -> dict[str, Any]:
    """The boot state plus, per slot, whether its files verify right now."""
    dev = Device(Path(device))
    state = dev.load_state()
    out = state.to_json()
    for s in SLOTS:
        rec = out["slots"][s]
        pems = rec.pop("pending_keys", None)
        if pems:
            rec["pending_key_ids"] = [keymod.key_id(keymod.public_from_pem(p.encode())) for p in pems]
        if state.slot(s).state in (SlotState.TRIAL, SlotState.GOOD):
            try:
                verify_slot(dev, s)
                rec["verified"] = True
            except FirmwareError as exc:
                rec["verified"] = False
                rec["problem"] = str(exc)
    out["trusted_keys"] = sorted(keymod.key_id(k) for k in dev.trusted())
    return out
