"""The boot supervisor: what a board runs at start (``fractal boot``, deploy/systemd/fractal-boot.service).

One boot attempt:

0. stop a node that a killed supervisor left running (``firmware.nodeproc``), and refuse a port
   another process listens on, before anything changes;
1. under the device lock, pick the active slot; a slot on trial spends one trial *before* the
   node starts (so a crash or power cut during the check still counts); a trial slot with no
   trials left, a bad slot, one whose files no longer verify, or one below the anti-rollback
   floor is marked bad and the previous good slot becomes active. With none left, nothing is
   started: the boot state records why (``halt``), the fleet is told when the node settings
   name a broker (``firmware.halt``: retained status ``halted``) and :class:`NoBootableSlot` is raised;
2. write the node config from the slot's template (artifact in the slot, data dir in the data
   area that survives updates, a fresh ``boot_id``), start ``fractal node`` from the slot;
3. health check (``firmware.health``, one deadline): ``/v2/health/ready`` answered by *this*
   node (its boot id), then one inference on the image's reference input that must match its
   expected output within ``atol``;
4. pass: a trial slot is marked good, the rollback floor rises to its index and the keys its
   image adds become trusted. Fail: the node is stopped, a trial slot is marked bad (its keys
   dropped) and the previous good slot is booted instead.

A node that has staged an update (or switched back to its previous slot) for the fleet exits
with :data:`REBOOT_EXIT_CODE`; ``fractal boot`` then boots again (steps 1-4) instead of exiting,
which is what a board's reboot would do. The node finds its device through ``device`` in the
config written here.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from firmware.bootstate import BootState, SlotState
from firmware.device import Device, promote_keys, verify_slot
from firmware.errors import BootError, FirmwareError, NoBootableSlot
from firmware.halt import announce_halt
from firmware.health import health_check
from firmware.manifest import NODE_TEMPLATE_MEMBER, ImageManifest
from firmware.nodeproc import port_free, record, stop_leftover

__all__ = ["Launcher", "BootResult", "boot", "node_config", "health_check", "REBOOT_EXIT_CODE",
           "NO_SLOT_EXIT_CODE"]

# The node's way of asking its supervisor to boot again (into the slot the boot state now names):
# EX_TEMPFAIL of sysexits.h, "try again". Any other exit code ends `fractal boot` with that code.
REBOOT_EXIT_CODE = 75
# `fractal boot` found no slot it may start (none verifies, none passes, or all are below the
# anti-rollback floor): nothing runs, the boot state's ``halt`` says why. EX_CONFIG of sysexits.h;
# fractal-boot.service does not restart on it (a restart cannot change the outcome).
NO_SLOT_EXIT_CODE = 78

_MAX_ATTEMPTS = 4  # slots to try in one boot (active, then its fallback), with margin
_LOCK_WAIT_S = 60.0  # the running node may be flashing an over-the-air update right now


@dataclass(frozen=True)
class Launcher:
    """argv prefix running the `fractal` CLI (native Python, or qemu-user + a sysroot) and its env."""

    argv: list[str]
    env: dict[str, str] | None = None


@dataclass
class BootResult:
    slot: str
    version: str
    fell_back: bool
    process: subprocess.Popen[bytes]
    url: str


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def node_config(dev: Device, slot: str, *, node_id: str, host: str, port: int, board: str,
                boot_id: str = "") -> Path:
    """Fill the slot's node.toml.in; device settings in data/node.extra.toml are appended."""
    template = (dev.slot(slot) / NODE_TEMPLATE_MEMBER).read_text()
    values = {
        "NODE_ID": _toml_str(node_id),
        "ARTIFACT": _toml_str(str((dev.slot(slot) / "artifact").resolve())),
        "DATA_DIR": _toml_str(str((dev.data / "node").resolve())),
        "HOST": _toml_str(host),
        "PORT": str(int(port)),
        "BOARD": _toml_str(board),
    }
    for k, v in values.items():
        template = template.replace(f"@{k}@", v)
    # First line, so it stays a top-level key whatever tables the template or the extras open.
    head = f"device = {_toml_str(str(dev.root.resolve()))}\n"
    if boot_id:  # the node returns it on /v2/health/ready: the check trusts only this process
        head += f"boot_id = {_toml_str(boot_id)}\n"
    template = head + template
    extra = dev.data / "node.extra.toml"
    if extra.is_file():
        template += "\n# from data/node.extra.toml\n" + extra.read_text()
    (dev.data / "node").mkdir(parents=True, exist_ok=True)
    out = dev.data / f"node-{slot}.toml"
    out.write_text(template)
    return out


def _config_token(cfg: Path) -> str | None:
    """The node config's ``auth_token`` (None when absent, or when the node will refuse the file):
    a board configured with an API token must present it in its own health check."""
    try:
        token = tomllib.loads(cfg.read_text()).get("auth_token")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return token if isinstance(token, str) else None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _fall_back(state: BootState, slot: str, why: str, log: Callable[[str], None]) -> None:
    """Mark ``slot`` bad (its pending keys are never trusted) and make the previous good slot active
    (none left: ``active`` is None and the caller halts)."""
    prev = state.fall_back(slot, why)
    if prev is None:
        log(f"slot {slot} is bad ({why}) and there is no good slot to fall back to")
    else:
        log(f"slot {slot} is bad ({why}); falling back to slot {prev}")


def _halt(dev: Device, state: BootState, why: str) -> NoBootableSlot:
    """Record that no slot may boot (``image status`` shows it); the error to raise."""
    state.halted(why)
    dev.save_state(state)
    return NoBootableSlot(
        f"no bootable slot on this device: {why}",
        hint="flash a current image with `fractal image flash IMAGE --device PATH`",
    )


def _refusal(state: BootState, slot: str, dev: Device) -> tuple[str | None, ImageManifest | None]:
    """Why ``slot`` may not start now (None: it may), and its verified manifest."""
    rec = state.slot(slot)
    if rec.state is SlotState.TRIAL and state.trials_left <= 0:
        return "trial boots used up without passing the health check", None
    if rec.state not in (SlotState.TRIAL, SlotState.GOOD):
        return f"slot is {rec.state.value}", None
    try:
        manifest = verify_slot(dev, slot)
    except FirmwareError as exc:
        return f"its files do not verify: {exc}", None
    index = min(manifest.rollback_index, rec.rollback_index)  # the signed index and the record's
    if index < state.rollback_floor:  # anti-rollback holds at boot too, not only at flash
        return f"its rollback index {index} is below the device's floor {state.rollback_floor}", None
    return None, manifest


def _pick(dev: Device, log: Callable[[str], None]) -> tuple[str, ImageManifest, bool]:
    """Under the lock: the slot to start now and its verified manifest; spends one trial."""
    fell_back = False
    reasons: list[str] = []
    with dev.locked(_LOCK_WAIT_S):
        state = dev.load_state()
        for _ in range(_MAX_ATTEMPTS):
            slot = state.active
            if slot is None:
                raise _halt(dev, state, "; ".join(reasons) or state.halt or "no slot is active")
            why, manifest = _refusal(state, slot, dev)
            if why is not None or manifest is None:
                why = why or "no manifest"
                reasons.append(f"slot {slot}: {why}")
                _fall_back(state, slot, why, log)
                fell_back = True
                continue
            state.start(slot)  # a trial slot spends its trial now; health pending (the node reports it)
            dev.save_state(state)
            return slot, manifest, fell_back
        raise _halt(dev, state, "; ".join(reasons) or "no slot passed verification")


def _settle(dev: Device, slot: str, why: str | None, log: Callable[[str], None]) -> bool:
    """Record the health-check outcome of ``slot``; True when another slot should be tried."""
    with dev.locked(_LOCK_WAIT_S):
        state = dev.load_state()
        rec = state.slot(slot)
        if why is None:
            was_trial = rec.state is SlotState.TRIAL
            pending = state.passed(slot)
            dev.save_state(state)
            if pending:  # key rotation: trusted once the image that adds them booted good
                keys = promote_keys(dev, pending)
                state.keys_trusted(slot)
                dev.save_state(state)
                log(f"slot {slot}: now trusting key(s) {', '.join(keys)}")
            if was_trial:
                log(f"slot {slot} (version {rec.version}) passed its health check: marked good")
            return False
        if rec.state is SlotState.TRIAL:
            _fall_back(state, slot, why, log)
            dev.save_state(state)
            return state.active is not None
        dev.save_state(state)
        raise BootError(
            f"the good slot {slot} failed its health check: {why}",
            hint="see the node log in data/; the supervisor retries at the next start",
        )


def boot(
    device: str | Path,
    launcher: Launcher,
    *,
    node_id: str = "",
    host: str = "127.0.0.1",
    port: int = 8080,
    health_timeout_s: float = 120.0,
    log: Callable[[str], None] = print,
) -> BootResult:
    """Boot the device: pick, start, check, mark good or fall back. The node keeps running.

    NoBootableSlot when no slot may boot (nothing started, the boot state says why)."""
    dev = Device(Path(device))
    dev.load_state()  # not provisioned: say so before anything else
    try:
        return _boot(dev, launcher, node_id=node_id or dev.root.name, host=host, port=port,
                     health_timeout_s=health_timeout_s, log=log)
    except NoBootableSlot:
        why = dev.load_state().halt or "no slot may boot"
        nid, board = node_id or dev.root.name, dev.load_state().board
        if announce_halt(dev, why, node_id=nid, log=log, config_for=lambda slot: node_config(
                dev, slot, node_id=nid, host=host, port=port, board=board)):
            log("told the fleet: halted, no bootable slot")
        raise


def _boot(dev: Device, launcher: Launcher, *, node_id: str, host: str, port: int,
          health_timeout_s: float, log: Callable[[str], None]) -> BootResult:
    fell_back = False
    for _ in range(_MAX_ATTEMPTS):
        stop_leftover(dev, log)  # a node a killed supervisor left serving on our port
        port_free(host, port)  # before a trial is spent: a foreign listener is not the slot's fault
        slot, manifest, fb = _pick(dev, log)
        fell_back |= fb
        state = dev.load_state()
        boot_id = secrets.token_hex(16)
        cfg = node_config(
            dev, slot, node_id=node_id, host=host, port=port, board=state.board,
            boot_id=boot_id,
        )
        logf = open(dev.data / f"node-{slot}.log", "ab")  # noqa: SIM115 - handed to the child
        log(f"starting slot {slot} (version {manifest.version}, trials left {state.trials_left})")
        proc = subprocess.Popen(
            [*launcher.argv, "node", "--config", str(cfg)],
            env=launcher.env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        logf.close()
        try:
            record(dev, proc.pid, boot_id)
            url = f"http://{host}:{port}"
            why = health_check(url, dev.slot(slot), manifest.health, proc, health_timeout_s, boot_id,
                               token=_config_token(cfg))
        except BaseException:
            _stop(proc)
            raise
        if why is None:
            _settle(dev, slot, None, log)
            return BootResult(slot, manifest.version, fell_back, proc, url)
        log(f"slot {slot} failed its health check: {why}")
        _stop(proc)
        if not _settle(dev, slot, why, log):
            with dev.locked(_LOCK_WAIT_S):
                raise _halt(dev, dev.load_state(), f"slot {slot} failed its health check ({why}) "
                                                   "and no good slot is left")
        fell_back = True
    raise BootError("no slot passed its health check", hint="flash a working image")
