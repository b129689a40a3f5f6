"""Storage faults on real file systems (issue 12): a read-only data directory at start is one clear
error (API and CLI); a store whose disk fills up answers 507 on POST /v1/samples and the node
reports not ready until it can write again. The faults are tmpfs mounts the test makes (CI runs
as root, see .ci/run)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.node_app import create_node_app
from edgenode.errors import ConfigError
from tests.fixtures_node import write_node_toml


@contextlib.contextmanager
def tmpfs(path: Path, *options: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("storage-fault tests mount tmpfs file systems: run them as root (CI does)")
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join(("nosuid", "nodev", *options))
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def test_read_only_data_dir_at_start_is_one_clear_error(tmp_path, node_factory, digits_artifact):
    with tmpfs(tmp_path / "ro", "ro", "size=1m") as ro:
        with pytest.raises(ConfigError, match=r"data_dir .* is not writable: Read-only file system"):
            node_factory("ro-node", digits_artifact, data_dir=ro, start=False)
        cfg = write_node_toml(tmp_path / "NODE.toml", {"node_id": "ro-node", "artifact": str(digits_artifact),
                                                       "port": 0, "data_dir": str(ro)})
        r = subprocess.run([sys.executable, "-c", "from api.cli import main; main()", "node", "--config",
                            str(cfg)], cwd=Path(__file__).parents[2], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and "not writable" in lines[0], r.stderr
        assert "help:" in lines[0]


def test_store_that_cannot_write_answers_507_and_node_is_not_ready(tmp_path, node_factory, digits_artifact,
                                                                    digits_data):
    x, y = digits_data
    with tmpfs(tmp_path / "small", "size=4m") as small:
        node = node_factory("full-node", digits_artifact, data_dir=small)
        with TestClient(create_node_app(node)) as client:
            body = {"inputs": {"x": x[:50].tolist()}, "labels": y[:50].tolist()}
            assert client.post("/v1/samples", json=body).status_code in (200, 201)
            assert client.get("/v2/health/ready").status_code == 200
            filler = small / "filler"
            with open(filler, "wb") as f:  # fill the disk to the last byte
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
            big = {"inputs": {"x": x[:400].tolist()}, "labels": y[:400].tolist()}
            r = client.post("/v1/samples", json=big)
            assert r.status_code == 507, r.text
            assert "cannot write" in r.json()["error"]
            ready = client.get("/v2/health/ready")
            assert ready.status_code == 503 and "sample store cannot write" in ready.json()["error"]
            assert node.store.count == 50  # nothing half-stored
            assert client.post("/v2/models/digits-mlp/infer", json={
                "inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32",
                            "data": x[0].tolist()}]}).status_code == 200  # inference still serves
            filler.unlink()  # space is back: the next write succeeds and the node is ready again
            assert client.post("/v1/samples", json=body).status_code in (200, 201)
            assert client.get("/v2/health/ready").status_code == 200
        node.stop()
