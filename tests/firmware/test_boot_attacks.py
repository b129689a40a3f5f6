"""Attacks of issue 26 on the boot supervisor with real processes (findings 2 and 11): a node left
running by a SIGKILLed `fractal boot`, a foreign process on the node's port, and health replies
that are malformed or trickled."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from firmware.boot import Launcher, _pick, _settle, boot
from firmware.device import Device, flash
from firmware.image import NODE_TEMPLATE
from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import CLI, REPO, assert_refused, cli
from tests.firmware.crafted import craft

FAKE_NODE = Path(__file__).with_name("fake_node.py")


def pub(key: Path) -> Path:
    return Path(f"{key}.pub")


def state(device: Path) -> dict:
    return json.loads((device / "data" / "boot-state.json").read_text())


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in "ZX"


def _node_pids(device: Path) -> list[int]:
    """Live processes running a node from ``device`` (their command line names its config)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"{device}/data/node-" in cmd and " node " in cmd and _alive(int(d.name)):
                out.append(int(d.name))
    return out


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _start_boot(device: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([*CLI, "boot", "--device", str(device), "--port", str(port)], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.slow
def test_a_node_orphaned_by_a_killed_supervisor_cannot_pass_the_next_boots_check(tmp_path, fw_image, fw_keys):
    """Finding 2: `fractal boot` SIGKILLed, its node keeps serving; then a trial slot whose own node
    exits 1 is booted on the same port. Before: the orphan answered the check, the slot was marked
    good and the floor rose from 1 to 7 (board bricked). Now the orphan is stopped, the slot fails
    its own check, the board falls back, the floor stays 1 and a rollback remains possible."""
    device = tmp_path / "dev"
    port = free_port()
    r = cli("image", "flash", fw_image("1.0.0", rollback_index=1), "--device", device, "--pubkey",
            pub(fw_keys["k1"]))
    assert r.returncode == 0, r.stderr
    sup = _start_boot(device, port)
    orphans: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (state(device).get("health") == "passed" and _ready(port)):
            assert time.monotonic() < deadline and sup.poll() is None, "slot a did not boot"
            time.sleep(0.1)
        orphans = _node_pids(device)
        assert len(orphans) == 1
        os.kill(sup.pid, signal.SIGKILL)  # the supervisor only: its node is orphaned, still serving
        sup.wait()
        assert _alive(orphans[0]) and _ready(port)

        template = NODE_TEMPLATE + "no_such_key = 1\n"  # this slot's own node exits 1 (config error)
        bad = craft(fw_image("2.0.0", rollback_index=7), tmp_path / "exits.img", fw_keys["k1"],
                    members={"node.toml.in": template.encode()})
        r = cli("image", "flash", bad, "--device", device)
        assert r.returncode == 0, r.stderr

        r = cli("boot", "--device", device, "--port", str(port), "--once", "--health-timeout", "120")
        assert r.returncode == 0, r.stderr
        assert "booted slot a version 1.0.0 (after fallback)" in r.stdout, r.stdout + r.stderr
        assert "left running by a supervisor that died" in r.stderr
        s = state(device)
        assert (s["slots"]["b"]["state"], s["slots"]["a"]["state"], s["rollback_floor"]) == ("bad", "good", 1)
        assert "exited with code 1" in s["slots"]["b"]["problem"]
        assert not _alive(orphans[0])

        # the floor never rose: a deliberate rollback to version 1.0.0 is still possible
        r = cli("image", "flash", fw_image("1.1.0", rollback_index=1), "--device", device)
        assert r.returncode == 0, r.stderr
        r = cli("boot", "--device", device, "--port", str(port), "--once", "--health-timeout", "120")
        assert r.returncode == 0 and "booted slot b version 1.1.0" in r.stdout, r.stderr
        r = cli("image", "rollback", "--device", device)
        assert r.returncode == 0 and "slot a" in r.stdout, r.stderr
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        for pid in orphans + _node_pids(device):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _provisioned(tmp_path: Path, fw_image, fw_keys) -> Path:
    """A device whose slot a booted good and whose slot b (2.0.0) is on trial."""
    device = tmp_path / "dev"
    flash(fw_image("1.0.0"), device, [pub(fw_keys["k1"])])
    dev = Device(device)
    slot, _, _ = _pick(dev, log=lambda m: None)
    _settle(dev, slot, None, log=lambda m: None)
    flash(fw_image("2.0.0"), device, [])
    return device


def test_a_foreign_process_on_the_port_is_refused_before_a_trial_is_spent(tmp_path, fw_image, fw_keys):
    device = _provisioned(tmp_path, fw_image, fw_keys)
    before = state(device)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("boot", "--device", device, "--port", str(port), "--once")
        assert_refused(r, f"port {port}", "in use")
    assert state(device) == before  # no trial spent, nothing marked


def test_a_ready_answer_without_this_boots_id_is_not_trusted(tmp_path):
    """The check trusts only the node it started: another server's 200 on the port never counts."""
    import http.server

    from firmware.health import health_check
    from firmware.manifest import HealthSpec

    class Ready(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.send_header("Fractal-Boot-Id", "someone-else")
            self.end_headers()

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    child = subprocess.Popen(["sleep", "30"])
    try:
        why = health_check(f"http://127.0.0.1:{srv.server_address[1]}", tmp_path,
                           HealthSpec("m", None, None, 1e-4), child, 2.0, "this-boot")
        assert why is not None and "another process answers on its port" in why
    finally:
        child.kill()
        child.wait()
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("mode,word", [
    ("list", "malformed reply"),
    ("shape", "malformed reply"),
    ("nooutput", "malformed reply"),
    ("trickle", "did not complete within the 8 s"),
])
def test_a_bad_health_reply_fails_the_slot_cleanly_within_the_deadline(tmp_path, fw_image, fw_keys,
                                                                      mode, word):
    """Finding 11: a JSON list, an output whose data does not fit its shape, or a reply trickled one
    byte every 2 s (8 s timeout). Before: a traceback with the node left running and the trial
    spent, or 64 s held. Now: the slot fails its check (its node stopped) within the deadline and
    the board falls back."""
    device = _provisioned(tmp_path, fw_image, fw_keys)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_MODE": mode, "FAKE_BAD_SLOT": "b",
           "FAKE_TRICKLE_S": "2"}
    logs: list[str] = []
    started: dict[str, float] = {}  # slot -> when the supervisor started its node

    def log(m: str) -> None:
        logs.append(m)
        if m.startswith("starting slot "):
            started.setdefault(m.split()[2], time.monotonic())

    t0 = time.monotonic()
    r = boot(device, Launcher([sys.executable, str(FAKE_NODE)], env), port=free_port(), health_timeout_s=8,
             log=log)
    elapsed = time.monotonic() - t0
    try:
        assert (r.slot, r.fell_back) == ("a", True), logs
        s = state(device)
        assert s["slots"]["b"]["state"] == "bad" and word in s["slots"]["b"]["problem"], s["slots"]["b"]
        pid_b = int((device / "data" / "node" / "fake-node-b.pid").read_text())
        assert not _alive(pid_b)  # the failing slot's node was stopped
        # one deadline for the whole check of slot b: its node stopped and slot a started by then
        # (timed to slot a's start: slot a's own node, a fresh Python, can be slow to start on a
        # loaded machine; its check has a deadline of its own)
        assert started["a"] - started["b"] < 8 + 4, (started, logs)
        assert elapsed < 2 * (8 + 4), elapsed
    finally:
        r.process.terminate()
        r.process.wait(timeout=10)
