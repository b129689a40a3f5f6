"""The boot supervisor with real node processes: trial boot, mark good, fallback on a failed health
check, trial counting across crashes, anti-rollback floor, deliberate rollback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import CLI, REPO, assert_refused, cli

pytestmark = pytest.mark.slow


def pub(key: Path) -> Path:
    return Path(f"{key}.pub")


def state(device: Path) -> dict:
    return json.loads((device / "data" / "boot-state.json").read_text())


def boot_once(device: Path) -> subprocess.CompletedProcess[str]:
    return cli("boot", "--device", device, "--port", str(free_port()), "--once", "--health-timeout", "120")


def flash(img: Path, device: Path, *extra: str | Path) -> None:
    r = cli("image", "flash", img, "--device", device, *extra)
    assert r.returncode == 0, r.stderr


def test_trial_boot_marks_good_and_a_failing_slot_falls_back(tmp_path, fw_image, fw_keys):
    device = tmp_path / "dev"
    flash(fw_image("1.0.0"), device, "--pubkey", pub(fw_keys["k1"]))
    assert state(device)["slots"]["a"]["state"] == "trial"
    r = boot_once(device)
    assert r.returncode == 0, r.stderr
    assert "booted slot a version 1.0.0" in r.stdout
    s = state(device)
    assert s["slots"]["a"]["state"] == "good" and s["booted"] == "a" and s["trials_left"] == 0
    samples = device / "data" / "node"
    assert samples.is_dir()  # the node's data dir lives in the data area

    flash(fw_image("2.0.0", broken=True), device)  # signed and intact, but its health check fails
    s = state(device)
    # while b is unconfirmed, a is the only good fallback: another flash may not overwrite it
    assert_refused(cli("image", "flash", fw_image("2.1.0"), "--device", device), "only good fallback")
    assert state(device) == s
    assert (s["active"], s["previous"], s["slots"]["b"]["state"]) == ("b", "a", "trial")
    r = boot_once(device)
    assert r.returncode == 0, r.stderr
    assert "booted slot a version 1.0.0 (after fallback)" in r.stdout, r.stdout + r.stderr
    assert "differs from the image's expected output" in r.stderr
    s = state(device)
    assert (s["active"], s["slots"]["b"]["state"], s["slots"]["a"]["state"]) == ("a", "bad", "good")
    st = cli("image", "status", "--device", device)
    assert "slot a: good version 1.0.0" in st.stdout and "slot b: bad version 2.0.0" in st.stdout


def _start_boot(device: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [*CLI, "boot", "--device", str(device), "--port", str(port)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def test_trials_are_counted_across_crashes_then_the_previous_slot_boots(tmp_path, fw_image, fw_keys):
    device = tmp_path / "dev"
    flash(fw_image("1.0.0"), device, "--pubkey", pub(fw_keys["k1"]))
    assert boot_once(device).returncode == 0
    flash(fw_image("2.0.0"), device, "--trials", "2")
    for left in (1, 0):  # the supervisor (and its node) die mid-check, like a power cut
        proc = _start_boot(device, free_port())
        try:
            deadline = time.monotonic() + 60
            while not (state(device)["booted"] == "b" and state(device)["trials_left"] == left):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert state(device)["slots"]["b"]["state"] == "trial"
    r = boot_once(device)
    assert r.returncode == 0, r.stderr
    assert "booted slot a version 1.0.0 (after fallback)" in r.stdout, r.stderr
    assert "trial boots used up" in r.stderr
    assert state(device)["slots"]["b"]["state"] == "bad"


def test_rollback_floor_and_deliberate_rollback(tmp_path, fw_image, fw_keys):
    device = tmp_path / "dev"
    flash(fw_image("1.0.0"), device, "--pubkey", pub(fw_keys["k1"]))
    assert boot_once(device).returncode == 0
    flash(fw_image("1.1.0"), device)
    assert boot_once(device).returncode == 0
    r = cli("image", "rollback", "--device", device)
    assert r.returncode == 0 and "slot a" in r.stdout, r.stderr
    r = boot_once(device)
    assert r.returncode == 0 and "booted slot a version 1.0.0" in r.stdout, r.stderr

    flash(fw_image("3.0.0", rollback_index=2), device)  # a security fix: raises the floor once booted good
    assert boot_once(device).returncode == 0
    assert state(device)["rollback_floor"] == 2
    # an old image, freshly (re-)signed with the trusted key, cannot roll the board back
    old = fw_image("1.5.0", rollback_index=1)
    assert_refused(cli("image", "flash", old, "--device", device, "--allow-downgrade"), "rollback index")
    # and neither can a deliberate rollback to a slot below the floor
    assert_refused(cli("image", "rollback", "--device", device), "rollback")
    assert state(device)["active"] == "b"
