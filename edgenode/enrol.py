"""A device's first boot: make its own keys, announce itself to the fleet, wait for the operator.

Input: ``DATA/enrollment.toml`` (``fleet`` URL and ``enroll_token``, written from the boot
partition by ``firmware/osimage/settings.py``). Output, once the operator accepted the device:

* ``DATA/keys/device.key``: the device's ed25519 signing key and X25519 ring key (the
  ``federation/auth.py`` key-file format, mode 0600). Made here; the private keys never leave it.
* ``DATA/keys/keyring.json``: the swarm keyring the fleet signed (with this device's key in it).
* ``DATA/enrolled.toml``: ``key_file``, ``keyring_file``, ``broker`` (with the device's broker
  credentials) and ``swarm``: the settings a node needs to join the signed swarm.

Why HTTP to the fleet and not MQTT: before acceptance the device has no broker credentials (a
pending device can publish nothing, not even on a "request" topic an attacker could flood), and
the fleet URL is already in the device's settings. The request carries a proof of the key (an
ed25519 signature over its fields); each poll is signed with it too, so only this device can fetch
its broker password. Use an ``https://`` fleet URL in production: the first keyring is trusted
on first use, as an SSH host key is.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit, urlunsplit

from edgenode.errors import ConfigError
from fractal.files import atomic_write

# The signing stack (cryptography) is imported by the functions that enrol: a node that has no
# enrollment.toml never loads it (issue 25: a board's memory).
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from edgenode.config import NodeConfig

__all__ = ["Enrolled", "enrol", "needs_enrolment", "ENROLLED_FILE"]

log = logging.getLogger("fractal.enrol")
ENROLLED_FILE = "enrolled.toml"


@dataclass(frozen=True)
class Enrolled:
    key_file: Path
    keyring_file: Path
    broker: str
    swarm: str


def needs_enrolment(data_dir: Path) -> bool:
    return (data_dir / "enrollment.toml").exists() and not (data_dir / ENROLLED_FILE).exists()


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, text, mode=0o600)


def _keys(path: Path, device_id: str) -> tuple[Any, X25519PrivateKey]:
    """The device's keys: loaded when made before (a reboot while pending), else made now."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from federation import enrolment as wire
    from federation.auth import Role, generate_key, load_key_file
    from fractal.keyfile import KeyFile, write_key_file

    if path.exists():
        kf = load_key_file(path)
        if kf.sender != device_id or kf.dh_private is None:
            raise ConfigError(f"{path} belongs to {kf.sender!r}, not {device_id!r}" if kf.sender != device_id
                              else f"{path} holds no X25519 key (a device key file needs one)")
        return kf.private_key, kf.dh_private
    key, dh = generate_key(), X25519PrivateKey.generate()
    pub = wire.public_b64(key.public_key())
    write_key_file(path, KeyFile(wire.device_key_id(device_id, pub), device_id, Role.NODE.value, key, dh))
    return key, dh


def _post(url: str, body: dict, timeout: float = 15.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {"error": exc.reason}


def enrol(data_dir: str | Path, *, device_id: str, arch: str, board: str, poll_s: float = 2.0,
          timeout_s: float | None = None, clock: Any = time.time, sleep: Any = time.sleep) -> Enrolled:
    """Run the enrolment (idempotent across reboots); ConfigError when refused, rejected or timed out."""
    from federation import enrolment as wire
    from federation.auth import Keyring, Role, raw_b64

    data = Path(data_dir)
    try:
        conf = tomllib.loads((data / "enrollment.toml").read_text())
        fleet, token = str(conf["fleet"]).rstrip("/"), str(conf["enroll_token"])
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{data / 'enrollment.toml'}: {exc}",
                          hint="fleet and enroll_token are required") from None
    key_file, ring_file = data / "keys" / "device.key", data / "keys" / "keyring.json"
    key, dh = _keys(key_file, device_id)
    pub, dh_pub = wire.public_b64(key.public_key()), raw_b64(dh.public_key())
    proof = key.sign(wire.request_message(device_id, arch, board, pub, dh_pub, token))
    status, ans = _post(f"{fleet}/api/enroll", {
        "token": token, "device_id": device_id, "arch": arch, "board": board, "public_key": pub,
        "dh_public": dh_pub, "proof": base64.b64encode(proof).decode()})
    if status != 200:
        raise ConfigError(f"the fleet refused the enrolment ({status}): {ans.get('error', ans)}")
    log.info("enrolment of %s: %s (key %s)", device_id, ans["state"], wire.fingerprint(pub))
    deadline = None if timeout_s is None else clock() + timeout_s
    while True:
        ts = int(clock())
        sig = key.sign(wire.poll_message(device_id, ts))
        status, ans = _post(f"{fleet}/api/enroll/{quote(device_id)}/status",
                            {"ts": ts, "sig": base64.b64encode(sig).decode()})
        if status != 200:
            raise ConfigError(f"enrolment status refused ({status}): {ans.get('error', ans)}")
        if ans["state"] == "accepted":
            break
        if ans["state"] != "pending":
            raise ConfigError(f"the operator {ans['state']} device {device_id}")
        if deadline is not None and clock() > deadline:
            raise ConfigError(f"device {device_id} still pending after {timeout_s:.0f} s")
        sleep(poll_s)
    ring = Keyring.from_json(ans["keyring"])
    fleet_key = ring.get(ans["fleet_key_id"])
    if fleet_key is None or fleet_key.role != Role.FLEET or not wire.verify_sig(
            wire.public_b64(fleet_key.public_key), ans["keyring_sig"], wire.keyring_message(ans["keyring"])):
        raise ConfigError("the keyring the fleet sent is not signed by a fleet key in it")
    mine = ring.get(ans["key_id"])
    if mine is None or mine.sender != device_id or wire.public_b64(mine.public_key) != pub:
        raise ConfigError("the keyring the fleet sent does not hold this device's key")
    _write_private(ring_file, ans["keyring"])
    b = ans["broker"]
    u = urlsplit(b["url"])
    netloc = f"{quote(b['username'], safe='')}:{quote(b['password'], safe='')}@{u.netloc}"
    broker = urlunsplit((u.scheme, netloc, u.path, "", ""))
    _write_private(data / ENROLLED_FILE, f"key_file = {json.dumps(str(key_file))}\n"
                   f"keyring_file = {json.dumps(str(ring_file))}\nbroker = {json.dumps(broker)}\n"
                   f"swarm = {json.dumps(ans['swarm'])}\n")
    return Enrolled(key_file, ring_file, broker, ans["swarm"])


def load_enrolled(data_dir: str | Path) -> Enrolled:
    d = tomllib.loads((Path(data_dir) / ENROLLED_FILE).read_text())
    return Enrolled(Path(d["key_file"]), Path(d["keyring_file"]), d["broker"], d["swarm"])


def enrolment_dir(cfg: NodeConfig) -> Path | None:
    """Where this node's ``enrollment.toml`` is (its data_dir, or the device directory's data/), if any."""
    dirs = [Path(cfg.data_dir)] + ([Path(cfg.device) / "data"] if cfg.device is not None else [])
    for d in dirs:
        if (d / "enrollment.toml").exists():
            return d
    return None


def enrolled_config(cfg: NodeConfig, *, poll_s: float = 2.0) -> NodeConfig:
    """``cfg`` with the enrolled settings (keys, keyring, broker credentials, swarm); runs the
    enrolment first when the device has an ``enrollment.toml`` and is not enrolled yet (blocks until
    the operator decides). A config without ``enrollment.toml`` comes back unchanged."""
    import platform

    d = enrolment_dir(cfg)
    if d is None:
        return cfg
    arch = platform.machine() or "unknown"
    if needs_enrolment(d):
        try:
            e = enrol(d, device_id=cfg.node_id, arch=arch, board=cfg.board or arch, poll_s=poll_s)
        except urllib.error.URLError as exc:
            if isinstance(exc, urllib.error.HTTPError):
                raise
            # The fleet cannot be reached (yet): serve locally, unenrolled (no keys, no credentials:
            # it cannot join the swarm); the enrolment runs again at the next start.
            log.warning("enrolment: the fleet is unreachable (%s); starting unenrolled", exc.reason)
            return cfg
    else:
        e = load_enrolled(d)
    return cfg.model_copy(update={"key_file": e.key_file, "keyring_file": e.keyring_file, "broker": e.broker,
                                  "swarm": e.swarm})
