"""Attacks of issue 26 on images and the boot state that need no running node (findings 6, 7, 14):
crafted manifests signed by a trusted key, keys added by an image that never booted good, and a
fallback below the anti-rollback floor."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from firmware.boot import _pick, _settle
from firmware.device import Device, flash
from firmware.errors import ImageError
from firmware.image import open_image
from firmware.keys import load_public
from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import assert_refused, cli, cli_main, flash_killed_at, tree
from tests.firmware.crafted import EMPTY_SHA256, craft
from tests.fleet.conftest import broker, make_fleet  # noqa: F401 - fixtures


def pub(key: Path) -> Path:
    return Path(f"{key}.pub")


def _boot(dev: Device, why: str | None = None) -> str:
    """What `fractal boot` does around the node: pick (spend a trial), then settle the check."""
    slot, _, _ = _pick(dev, log=lambda m: None)
    _settle(dev, slot, why, log=lambda m: None)
    return slot


def _status(device: Path) -> dict:
    r = cli("image", "status", "--device", device, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _key_id(key: Path) -> str:
    from firmware import keys as keymod

    return keymod.key_id(keymod.load_public(pub(key)))


def _member(m: dict, name: str) -> dict:
    return {"name": name, "size": 0, "sha256": EMPTY_SHA256}


CRAFTED = [
    ("index -1", lambda m: m.update(rollback_index=-1), "rollback_index"),
    ("index 10**30", lambda m: m.update(rollback_index=10**30), "rollback_index"),
    ("index 1e30", lambda m: m.update(rollback_index=1e30), "rollback_index"),
    ("index 2**31", lambda m: m.update(rollback_index=2**31), "rollback_index"),
    ("file and folder", lambda m: m["members"].extend([_member(m, "zz"), _member(m, "zz/inner")]),
     "both a file and the folder"),
    ("folder then file", lambda m: m["members"].extend([_member(m, "zz/inner"), _member(m, "ZZ")]),
     "both a file and the folder"),
    ("slot's own file", lambda m: m["members"].append(_member(m, "image.sig")), "slot's own file"),
    ("add_keys 5", lambda m: m["trust"].update(add_keys=5), "add_keys"),
    ("add_keys [7]", lambda m: m["trust"].update(add_keys=[7]), "add_keys"),
    ("add_keys junk", lambda m: m["trust"].update(add_keys=["not a key"]), "add_keys"),
    ("health /etc/hostname", lambda m: m["health"].update(input="/etc/hostname"), "health.input"),
    ("health ../data", lambda m: m["health"].update(input="../data/boot-state.json"), "health.input"),
    ("health expected", lambda m: m["health"].update(expected="node.toml.in"), "health.expected"),
    ("health atol", lambda m: m["health"].update(atol="1"), "health.atol"),
    ("no node template", lambda m: m.update(members=[e for e in m["members"] if e["name"] != "node.toml.in"]),
     "node.toml.in"),
    ("arch", lambda m: m.update(arch="riscv64"), "arch"),
]


@pytest.mark.slow
def test_crafted_manifests_are_refused_whole_before_anything_is_written(tmp_path, fw_image, fw_keys):
    """Finding 14: every field a board acts on is validated at verify and at flash; one line, nothing
    written (before: -1 / 10**30 accepted, `zz` + `zz/inner` and add_keys 5 or [7] crashed the flash
    with a traceback leaving slot b "writing", a health input /etc/hostname crashed `boot`)."""
    device = tmp_path / "dev"
    r = cli("image", "flash", fw_image("1.0.0"), "--device", device, "--pubkey", pub(fw_keys["k1"]))
    assert r.returncode == 0, r.stderr
    _boot(Device(device))
    before = tree(device)
    for k, (name, mutate, word) in enumerate(CRAFTED):
        bad = craft(fw_image("2.0.0"), tmp_path / f"crafted-{k}.img", fw_keys["k1"], mutate)
        with pytest.raises(ImageError, match=re.escape(word)):  # `image verify`, the fleet's upload
            open_image(bad, [load_public(pub(fw_keys["k1"]))])
        r = (cli if k == 0 else cli_main)("image", "flash", bad, "--device", device)  # one real process
        assert_refused(r, word)
        assert "(help: " in r.stderr, (name, r.stderr)
        assert tree(device) == before, name
        fresh = tmp_path / f"fresh-{k}"
        with pytest.raises(ImageError, match=re.escape(word)):
            flash(bad, fresh, [pub(fw_keys["k1"])])
        assert set(tree(fresh)) <= {".lock"}, name  # the lock file only: no slot, no data area


@pytest.mark.slow
def test_a_key_added_by_an_image_is_trusted_only_once_that_image_booted_good(tmp_path, fw_image, fw_keys):
    """Finding 6: the key of `--add-key` is pending with the slot; a failed check, or a flash killed
    before the switch, never makes the device trust it (before: trusted at flash time)."""
    device = tmp_path / "dev"
    dev = Device(device)
    k1, k2 = _key_id(fw_keys["k1"]), _key_id(fw_keys["k2"])
    assert cli("image", "flash", fw_image("1.0.0"), "--device", device, "--pubkey",
               pub(fw_keys["k1"])).returncode == 0
    _boot(dev)

    # flashed, on trial: not trusted yet (an image signed by k2 does not verify on this device)
    r = cli("image", "flash", fw_image("1.1.0", add_keys=("k2",), broken=True), "--device", device)
    assert r.returncode == 0, r.stderr
    st = _status(device)
    assert st["trusted_keys"] == [k1] and st["slots"]["b"]["pending_key_ids"] == [k2]
    assert "will trust key(s) " + k2 in cli("image", "status", "--device", device).stdout
    # the trial fails its health check: the board falls back, the key is never trusted
    assert _boot(dev, "output 'y' differs from the image's expected output") == "b"
    assert _boot(dev) == "a"
    st = _status(device)
    assert st["trusted_keys"] == [k1] and "pending_key_ids" not in st["slots"]["b"], st

    # a flash killed right before the switch: the key is not trusted either
    r = flash_killed_at("switch", fw_image("1.2.0", add_keys=("k2",)), device)
    assert r.returncode == -9, r.stderr
    assert _status(device)["trusted_keys"] == [k1]
    assert_refused(cli("image", "flash", fw_image("1.3.0", key="k2"), "--device", device), "trusted key")

    # the image that adds it boots good: from then on the key is trusted
    r = cli("image", "flash", fw_image("1.2.0", add_keys=("k2",)), "--device", device)
    assert r.returncode == 0, r.stderr
    assert _status(device)["trusted_keys"] == [k1]
    assert _boot(dev) == "b"
    assert _status(device)["trusted_keys"] == sorted([k1, k2])
    r = cli("image", "flash", fw_image("1.3.0", key="k2"), "--device", device)
    assert r.returncode == 0, r.stderr


def _flip_params_byte(slot_dir: Path) -> Path:
    manifest = json.loads((slot_dir / "image.manifest.json").read_text())
    name = next(e["name"] for e in manifest["members"] if "params" in e["name"])
    p = slot_dir / name
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    return p


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_no_fallback_below_the_rollback_floor_the_board_halts_and_says_why(tmp_path, fw_image, fw_keys):
    """Finding 7: floor 5, one flipped byte in the active slot's params.npz: `boot` must not fall
    back to the slot of index 1. It starts nothing, exits 78, and `image status` says why (before:
    it booted version 1.0.0, index 1)."""
    device = tmp_path / "dev"
    dev = Device(device)
    assert cli("image", "flash", fw_image("1.0.0", rollback_index=1), "--device", device, "--pubkey",
               pub(fw_keys["k1"])).returncode == 0
    _boot(dev)
    assert cli("image", "flash", fw_image("2.0.0", rollback_index=5), "--device", device).returncode == 0
    assert _boot(dev) == "b"
    assert _status(device)["rollback_floor"] == 5
    _flip_params_byte(device / "b")

    port = free_port()
    for _ in range(2):  # and it stays in the safe state at the next start
        r = cli("boot", "--device", device, "--port", str(port), "--once", "--health-timeout", "30")
        assert r.returncode == 78, (r.returncode, r.stdout, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: no bootable slot") and "below the device's floor 5" in last, r.stderr
        assert "Traceback" not in r.stderr and "booted slot" not in r.stdout
        assert not _listening(port)  # no node was started
    st = _status(device)
    assert st["active"] is None and st["booted"] is None and st["rollback_floor"] == 5
    assert "below the device's floor 5" in st["halt"] and "do not verify" in st["halt"]
    text = cli("image", "status", "--device", device).stdout
    assert "NO BOOTABLE SLOT" in text and "floor 5" in text
    assert_refused(cli("image", "rollback", "--device", device), "no previous good slot")

    # a current image brings the board back
    r = cli("image", "flash", fw_image("2.1.0", rollback_index=5), "--device", device)
    assert r.returncode == 0, r.stderr
    assert "halt" not in _status(device)
    assert _boot(dev) == "a"


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_halted_board_tells_the_fleet_why_signed(tmp_path, fw_image, fw_keys, make_fleet):  # noqa: F811
    """Finding 7, on the fleet: the board of the floor case above, in a signed swarm whose broker
    is named in data/node.extra.toml. `fractal boot` exits 78 and publishes the node's retained
    status once as ``halted`` with the reason, signed with the node's key; GET /api/nodes shows
    it (never online), and a round names it as halted (before: the fleet only saw
    the node go offline)."""
    from deploy.keys import provision

    swarm = f"halt-{tmp_path.name[-12:].strip('_-') or 'x'}"
    keys = tmp_path / "swarm-keys"
    provision(keys, swarm, ["node-1", "node-2"])
    fleet = make_fleet(swarm=swarm, key_file=str(keys / "keys/fleet.key"),
                       keyring_file=str(keys / "keyring.json"))
    device = tmp_path / "node-1"  # the node id is the device directory's name
    dev = Device(device)
    assert cli("image", "flash", fw_image("1.0.0", rollback_index=1), "--device", device, "--pubkey",
               pub(fw_keys["k1"])).returncode == 0
    _boot(dev)
    assert cli("image", "flash", fw_image("2.0.0", rollback_index=5), "--device", device).returncode == 0
    assert _boot(dev) == "b"
    _flip_params_byte(device / "b")
    (device / "data" / "node.extra.toml").write_text(
        f'broker = "{fleet.broker_url}"\nswarm = "{swarm}"\nkeepalive_s = 1\n'
        f'key_file = "{keys}/keys/node-1.key"\nkeyring_file = "{keys}/keyring.json"\n')

    port = free_port()
    r = cli("boot", "--device", device, "--port", str(port), "--once", "--health-timeout", "30")
    assert r.returncode == 78, (r.returncode, r.stdout, r.stderr)
    assert "told the fleet: halted" in r.stderr, r.stderr
    assert not _listening(port)
    node = fleet.wait_for(lambda: fleet.node("node-1"), 10, "the halted status")
    assert node["state"] == "halted" and node["online"] is False, node
    assert "below the device's floor 5" in node["halt"] and "do not verify" in node["halt"], node
    assert node["offline_reason"].startswith("halted: no bootable slot"), node
    # the fleet is signed: it lists only statuses signed by their node's key
    body = fleet.get("/api/nodes").json()
    assert [n["node_id"] for n in body["nodes"]] == ["node-1"] and not any(body["rejected"].values()), body
    r2 = fleet.post("/api/rounds", json={"steps": 1, "nodes": ["node-1"]})
    assert r2.status_code == 409 and "node-1 is halted, no bootable slot: " in r2.json()["error"], r2.text


@pytest.mark.parametrize("floor_in_record", [True, False])
def test_pick_refuses_a_good_slot_below_the_floor(tmp_path, fw_image, fw_keys, floor_in_record):
    """The floor is checked against the signed manifest as well as the boot state's record."""
    device = tmp_path / "dev"
    dev = Device(device)
    assert cli("image", "flash", fw_image("1.0.0", rollback_index=1), "--device", device, "--pubkey",
               pub(fw_keys["k1"])).returncode == 0
    _boot(dev)
    path = device / "data" / "boot-state.json"
    state = json.loads(path.read_text())
    state["rollback_floor"] = 3
    if not floor_in_record:  # a tampered record cannot lift a slot over the floor
        state["slots"]["a"]["rollback_index"] = 9
    path.write_text(json.dumps(state))
    from firmware.errors import NoBootableSlot

    with pytest.raises(NoBootableSlot, match="below the device's floor 3"):
        _pick(dev, log=lambda m: None)
