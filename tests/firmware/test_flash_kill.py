"""A flash SIGKILLed while writing the slot (at several byte offsets) or at the boot-state switch:
the previous slot stays active, its files verify, and it boots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import cli, cli_main, flash_killed_at

pytestmark = pytest.mark.slow


def state(device: Path) -> dict:
    return json.loads((device / "data" / "boot-state.json").read_text())


def test_flash_killed_anywhere_leaves_the_previous_slot_bootable(tmp_path, fw_image, fw_keys):
    device = tmp_path / "dev"
    r = cli("image", "flash", fw_image("1.0.0"), "--device", device, "--pubkey", f"{fw_keys['k1']}.pub")
    assert r.returncode == 0, r.stderr
    assert cli("boot", "--device", device, "--port", str(free_port()), "--once").returncode == 0
    new = fw_image("2.0.0")
    m = json.loads(cli("image", "info", new, "--json").stdout)
    payload = sum(e["size"] for e in m["members"])
    points = ["bytes:0", "bytes:1", "bytes:4096", f"bytes:{payload // 2}", f"bytes:{payload - 1}", "switch"]
    for k, point in enumerate(points):
        r = flash_killed_at(point, new, device)
        assert r.returncode == -9, (point, r.returncode, r.stderr)
        s = state(device)
        assert s["active"] == "a" and s["slots"]["a"]["state"] == "good", point
        assert s["slots"]["b"]["state"] == "writing", point  # never bootable half-written
        # the status read needs no process of its own (the killed flash above is the real one)
        st = json.loads((cli if k == 0 else cli_main)("image", "status", "--device", device, "--json").stdout)
        assert st["slots"]["a"]["verified"] is True, (point, st["slots"]["a"])
        if k in (0, 3, len(points) - 1):  # boot a few of them for real (a node start costs seconds)
            r = cli("boot", "--device", device, "--port", str(free_port()), "--once")
            assert r.returncode == 0 and "booted slot a version 1.0.0" in r.stdout, (point, r.stderr)
    # the interrupted update is simply repeated
    r = cli("image", "flash", new, "--device", device)
    assert r.returncode == 0, r.stderr
    assert state(device)["active"] == "b"
    r = cli("boot", "--device", device, "--port", str(free_port()), "--once")
    assert r.returncode == 0 and "booted slot b version 2.0.0" in r.stdout, r.stderr
