"""The boot supervisor: what a board runs at start (``fractal boot``, deploy/systemd/fractal-boot.service).

One boot attempt:

1. under the device lock, pick the active slot; a slot on trial spends one trial *before* the
   node starts (so a crash or power cut during the check still counts); a trial slot with no
   trials left, a bad slot, or one whose files no longer verify is marked bad and the previous
   good slot becomes active;
2. write the node config from the slot's template (artifact in the slot, data dir in the data
   area that survives updates), start ``fractal node`` from the slot;
3. health check: ``/v2/health/ready``, then one inference on the image's reference input that
   must match its expected output within ``atol``;
4. pass: a trial slot is marked good and the rollback floor rises to its index. Fail: the
   node is stopped, a trial slot is marked bad and the previous good slot is booted instead.

A node that has staged an update (or switched back to its previous slot) for the fleet exits
with :data:`REBOOT_EXIT_CODE`; ``fractal boot`` then boots again (steps 1-4) instead of exiting,
which is what a board's reboot would do. The node finds its device through ``device`` in the
config written here.
"""

from __future__ import annotations

import json
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from firmware.device import Device, SlotState, verify_slot
from firmware.errors import BootError, FirmwareError

__all__ = ["Launcher", "BootResult", "boot", "node_config", "health_check", "REBOOT_EXIT_CODE"]

# The node's way of asking its supervisor to boot again (into the slot the boot state now names):
# EX_TEMPFAIL of sysexits.h, "try again". Any other exit code ends `fractal boot` with that code.
REBOOT_EXIT_CODE = 75

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


def node_config(dev: Device, slot: str, *, node_id: str, host: str, port: int, board: str) -> Path:
    """Fill the slot's node.toml.in; device settings in data/node.extra.toml are appended."""
    template = (dev.slot(slot) / "node.toml.in").read_text()
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
    template = f"device = {_toml_str(str(dev.root.resolve()))}\n" + template
    extra = dev.data / "node.extra.toml"
    if extra.is_file():
        template += "\n# from data/node.extra.toml\n" + extra.read_text()
    (dev.data / "node").mkdir(parents=True, exist_ok=True)
    out = dev.data / f"node-{slot}.toml"
    out.write_text(template)
    return out


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def health_check(
    url: str, slot_dir: Path, manifest: dict[str, Any], proc: subprocess.Popen[bytes], timeout_s: float,
    token: str | None = None,
) -> str | None:
    """None when healthy, else why not: readiness, then one reference inference within atol
    (presenting ``token``, the node's ``auth_token``, when it has one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            return f"the node exited with code {proc.returncode} before it was ready"
        try:
            if _get(f"{url}/v2/health/ready", 5) == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            return f"the node was not ready within {timeout_s:.0f} s"
        time.sleep(0.2)
    health = manifest["health"]
    if not health.get("input"):
        return None  # no reference runtime for this arch at build time: readiness only
    inputs = _npz(slot_dir / health["input"])
    expected = _npz(slot_dir / health["expected"])
    body = {
        "inputs": [
            {"name": k, "shape": list(v.shape), "datatype": _datatype(v), "data": v.ravel().tolist()}
            for k, v in inputs.items()
        ]
    }
    req = urllib.request.Request(
        f"{url}/v2/models/{health['model']}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **_auth(token)},
    )
    try:
        with urllib.request.urlopen(req, timeout=max(5.0, deadline - time.monotonic())) as r:
            reply = json.loads(r.read())
    except (OSError, ValueError) as exc:
        return f"the reference inference failed ({exc})"
    got = {
        o["name"]: np.asarray(o["data"], dtype=np.float64).reshape(o["shape"])
        for o in reply.get("outputs", [])
    }
    atol = float(health.get("atol", 1e-4))
    for name, want in expected.items():
        if name not in got or got[name].shape != want.shape:
            return f"the reference inference lacks output {name!r} of shape {list(want.shape)}"
        err = float(np.max(np.abs(got[name] - want.astype(np.float64)))) if want.size else 0.0
        if not err <= atol:
            return f"output {name!r} differs from the image's expected output by {err:.3g} (> {atol})"
    return None


def _config_token(cfg: Path) -> str | None:
    """The node config's ``auth_token`` (None when absent, or when the node will refuse the file)."""
    try:
        token = tomllib.loads(cfg.read_text()).get("auth_token")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return token if isinstance(token, str) else None


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _datatype(a: np.ndarray) -> str:
    return {
        "float32": "FP32",
        "float64": "FP64",
        "int64": "INT64",
        "int32": "INT32",
        "uint8": "UINT8",
        "float16": "FP16",
        "int8": "INT8",
    }[str(a.dtype)]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _fall_back(state: dict[str, Any], slot: str, why: str, log: Callable[[str], None]) -> None:
    """Mark ``slot`` bad and make the previous good slot active (BootError when there is none)."""
    state["slots"][slot]["state"] = SlotState.BAD
    state["slots"][slot]["problem"] = why
    prev = state["previous"]
    state["trials_left"] = 0
    if prev is None or state["slots"][prev]["state"] != SlotState.GOOD:
        state["active"] = None
        log(f"slot {slot} is bad ({why}) and there is no good slot to fall back to")
        return
    state["active"], state["previous"] = prev, None
    log(f"slot {slot} is bad ({why}); falling back to slot {prev}")


def _pick(dev: Device, log: Callable[[str], None]) -> tuple[str, dict[str, Any], bool]:
    """Under the lock: the slot to start now and its verified manifest; spends one trial."""
    fell_back = False
    with dev.locked(_LOCK_WAIT_S):
        state = dev.load_state()
        for _ in range(_MAX_ATTEMPTS):
            slot = state["active"]
            if slot is None:
                dev.save_state(state)
                raise BootError(
                    "no bootable slot on this device",
                    hint="flash an image with `fractal image flash IMAGE --device PATH`",
                )
            rec = state["slots"][slot]
            if rec["state"] == SlotState.TRIAL and state["trials_left"] <= 0:
                _fall_back(state, slot, "trial boots used up without passing the health check", log)
                fell_back = True
                continue
            if rec["state"] not in (SlotState.TRIAL, SlotState.GOOD):
                _fall_back(state, slot, f"slot is {rec['state']}", log)
                fell_back = True
                continue
            try:
                manifest = verify_slot(dev, slot)
            except FirmwareError as exc:
                _fall_back(state, slot, f"its files do not verify: {exc}", log)
                fell_back = True
                continue
            if rec["state"] == SlotState.TRIAL:
                state["trials_left"] -= 1
            state["booted"] = slot
            state["health"] = "pending"  # this boot's health check (a running node reports it)
            dev.save_state(state)
            return slot, manifest, fell_back
    raise BootError("no slot passed verification", hint="flash an image again")


def _settle(dev: Device, slot: str, why: str | None, log: Callable[[str], None]) -> bool:
    """Record the health-check outcome of ``slot``; True when another slot should be tried."""
    with dev.locked(_LOCK_WAIT_S):
        state = dev.load_state()
        rec = state["slots"][slot]
        if why is None:
            state["health"] = "passed"
            if rec["state"] == SlotState.TRIAL:
                rec["state"] = SlotState.GOOD
                state["trials_left"] = 0
                state["rollback_floor"] = max(int(state["rollback_floor"]), int(rec.get("rollback_index", 0)))
                log(f"slot {slot} (version {rec.get('version')}) passed its health check: marked good")
            dev.save_state(state)
            return False
        if rec["state"] == SlotState.TRIAL:
            _fall_back(state, slot, why, log)
            dev.save_state(state)
            return state["active"] is not None
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
    """Boot the device: pick, start, check, mark good or fall back. The node keeps running."""
    dev = Device(Path(device))
    fell_back = False
    for _ in range(_MAX_ATTEMPTS):
        slot, manifest, fb = _pick(dev, log)
        fell_back |= fb
        state = dev.load_state()
        cfg = node_config(
            dev, slot, node_id=node_id or dev.root.name, host=host, port=port, board=state["board"]
        )
        logf = open(dev.data / f"node-{slot}.log", "ab")  # noqa: SIM115 - handed to the child
        log(f"starting slot {slot} (version {manifest['version']}, trials left {state['trials_left']})")
        proc = subprocess.Popen(
            [*launcher.argv, "node", "--config", str(cfg)],
            env=launcher.env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        logf.close()
        url = f"http://{host}:{port}"
        why = health_check(url, dev.slot(slot), manifest, proc, health_timeout_s, _config_token(cfg))
        if why is None:
            _settle(dev, slot, None, log)
            return BootResult(slot, str(manifest["version"]), fell_back, proc, url)
        log(f"slot {slot} failed its health check: {why}")
        _stop(proc)
        if not _settle(dev, slot, why, log):
            raise BootError(
                f"slot {slot} failed its health check and no good slot is left: {why}",
                hint="flash a working image",
            )
        fell_back = True
    raise BootError("no slot passed its health check", hint="flash a working image")
