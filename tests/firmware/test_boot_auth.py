"""`fractal boot` on a device whose settings give the node an API token (`fractal image configure
--api-token`, applied into data/node.extra.toml): the supervisor's health check presents the
token, so the slot passes instead of failing on 401 and being marked bad."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import cli


def test_boot_health_check_presents_the_nodes_api_token(
    fw_image: Callable[..., Path], fw_keys: dict[str, Path], tmp_path: Path
) -> None:
    device = tmp_path / "board"
    r = cli("image", "flash", fw_image("1.0.0"), "--device", device, "--pubkey", f"{fw_keys['k1']}.pub")
    assert r.returncode == 0, r.stderr
    (device / "data" / "node.extra.toml").write_text('auth_token = "s3cret-token"\n')
    r = cli("boot", "--device", device, "--port", str(free_port()), "--once", "--health-timeout", "120")
    assert r.returncode == 0, r.stderr
    assert "booted slot a version 1.0.0" in r.stdout, r.stdout + r.stderr
    st = json.loads((device / "data" / "boot-state.json").read_text())
    assert st["slots"]["a"]["state"] == "good", st
