"""`fractal node --config NODE.toml` end to end: serves the node API, answers inference, stops on SIGTERM
with the parameters it restored from data_dir."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from edgenode.config import load_config
from edgenode.model import ModelHolder
from tests.fixtures_node import write_node_toml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str | None = None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read() or b"{}")


def start_cli_node(cfg_path: Path, port: int, timeout: float = 60.0) -> subprocess.Popen:
    """``fractal node --config CFG`` as a real process, returned once it answers ready (its
    output on stdout; the caller stops it)."""
    proc = subprocess.Popen([sys.executable, "-c", "from api.cli import main; main()", "node", "--config",
                             str(cfg_path)], cwd=Path(__file__).parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            get(f"http://127.0.0.1:{port}/v2/health/ready")
            return proc
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read() if proc.stdout else "node exited") from None
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"node on port {port} not ready within {timeout:g}s") from None
            time.sleep(0.2)


def test_fractal_node_serves_and_restores_params(tmp_path, digits_artifact, digits_data):
    port = free_port()
    cfg_path = write_node_toml(tmp_path / "NODE.toml", {
        "node_id": "cli-node", "artifact": str(digits_artifact), "port": port, "data_dir": "data",
        "auth_token": "tok"})
    # a previous life of this node committed version 3: the restart must serve it
    from compiler import load_artifact

    art = load_artifact(digits_artifact)
    holder = ModelHolder(art, load_config(cfg_path).data_dir)
    trained = holder.commit([p * np.float32(0.5) for p in art.params], 3)
    proc = start_cli_node(cfg_path, port)
    try:
        info = get(f"http://127.0.0.1:{port}/v1/node", "tok")
        assert info["node_id"] == "cli-node" and info["model_version"] == 3
        assert info["params_sha256"] == trained.sha256 and info["model"] == "digits-mlp"
        x = digits_data[0][:2]
        body = json.dumps({"inputs": [{"name": "x", "shape": [2, 64], "datatype": "FP32",
                                       "data": x.ravel().tolist()}]}).encode()
        headers = {"Authorization": "Bearer tok", "Content-Type": "application/json"}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/digits-mlp/infer", data=body,
                                     headers=headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            out = json.loads(r.read())["outputs"][0]
        want = art.infer({"x": x}, params=list(trained.params))["logits"]
        got = np.asarray(out["data"], np.float32).reshape(2, 10)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode in (0, -signal.SIGTERM)
