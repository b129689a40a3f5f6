"""An aarch64 image flashed to a device directory boots under qemu-user (the sysroot of `make sysroot`):
the node runs from the slot, passes its health check, and its inference matches x86 within 1e-4."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.edgenode.test_cli_node import free_port
from tests.firmware.conftest import CLI, REPO, cli

pytestmark = [pytest.mark.slow, pytest.mark.emulate]


@pytest.fixture(scope="module")
def digits_arm(tmp_path_factory) -> Path:
    from compiler import compile_model, zoo

    d = tmp_path_factory.mktemp("fw-arm")
    zoo.save("digits-mlp", d / "digits-mlp.onnx")
    return compile_model(
        d / "digits-mlp.onnx", target="aarch64", out_dir=d / "digits-mlp-aarch64", progress=False
    )


def test_aarch64_image_boots_under_qemu_and_matches_x86(tmp_path, digits_arm, digits_artifact, fw_keys):
    from compiler.artifact import load_artifact

    img = tmp_path / "arm.img"
    r = cli(
        "image",
        "build",
        digits_arm,
        "--board",
        "rpi4",
        "--key",
        fw_keys["k1"],
        "--out",
        img,
        "--version",
        "1.0.0",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    device = tmp_path / "rpi4"
    r = cli("image", "flash", img, "--device", device, "--pubkey", f"{fw_keys['k1']}.pub")
    assert r.returncode == 0, r.stderr
    port = free_port()
    log = open(tmp_path / "boot.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            *CLI,
            "boot",
            "--device",
            str(device),
            "--port",
            str(port),
            "--emulate-arm",
            "--health-timeout",
            "400",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 500
        while "booted slot a" not in (text := (tmp_path / "boot.log").read_text()):
            assert proc.poll() is None, text + (device / "data" / "node-a.log").read_text()[-2000:]
            assert time.monotonic() < deadline, text
            time.sleep(0.5)
        st = json.loads((device / "data" / "boot-state.json").read_text())
        assert st["slots"]["a"]["state"] == "good" and st["board"] == "rpi4"
        cfg = (device / "data" / "node-a.toml").read_text()
        assert str((device / "a" / "artifact").resolve()) in cfg
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=10) as resp:
            assert resp.status == 200
        x = np.random.default_rng(7).random((1, 64)).astype(np.float32)
        body = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": x.ravel().tolist()}]}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v2/models/digits-mlp/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())["outputs"][0]
        arm = np.asarray(out["data"], np.float32).reshape(out["shape"])
        x86 = load_artifact(digits_artifact).infer({"x": x})["logits"]
        np.testing.assert_allclose(arm, x86, atol=1e-4, rtol=0)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
