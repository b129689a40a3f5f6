"""NODE.toml validation: every mistake is one line naming the key, and `fractal node` exits non-zero."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgenode.config import NodeConfig, Retention, load_config
from edgenode.errors import ConfigError
from federation.messages import SyncMode

GOOD = """
node_id = "node-1"
artifact = "art"
port = 8099
data_dir = "data"
broker = "mqtt://127.0.0.1:1883"
auth_token = "t0k"
max_body_bytes = 65536

[training]
lr = 0.05
sync = "local-sgd"
local_steps = 4

[store]
max_samples = 500
retention = "reject"
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "art").mkdir(exist_ok=True)
    p = tmp_path / "NODE.toml"
    p.write_text(text)
    return p


def test_good_config_resolves_paths_and_types(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.node_id == "node-1" and cfg.port == 8099 and cfg.swarm == "default"
    assert cfg.artifact == tmp_path / "art" and cfg.data_dir == tmp_path / "data"
    assert cfg.training.sync is SyncMode.LOCAL_SGD and cfg.training.local_steps == 4
    assert cfg.training.lr == 0.05 and cfg.store.retention is Retention.REJECT
    assert cfg.advertised_url == "http://127.0.0.1:8099"
    assert cfg.training.aggregation == "mean" and cfg.training.outlier_factor == 10.0  # defaults


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda t: t.replace('node_id = "node-1"\n', ""), "missing required key `node_id`"),
    (lambda t: t.replace("port = 8099", 'port = "eighty"'), "`port`"),
    (lambda t: t.replace('sync = "local-sgd"', 'sync = "gossip"'), "`training.sync` = 'gossip' is not"),
    (lambda t: t.replace("max_body_bytes", "max_body_byte"), "unknown key `max_body_byte`"),
    (lambda t: t.replace("mqtt://127.0.0.1:1883", "http://x"), "`broker`"),
    (lambda t: t.replace('artifact = "art"', 'artifact = "nope"'), "artifact"),
    (lambda t: t.replace('node_id = "node-1"', 'node_id = "a/b"'), "`node_id`"),
    (lambda t: t.replace('node_id = "node-1"', 'node_id = "node-1"\nsite = "east/1"'), "`site`"),
    (lambda t: t + "\n[[broken", "not valid TOML"),
    (lambda t: t.replace("local_steps = 4", 'local_steps = 4\naggregation = "max"'),
     "`training.aggregation` = 'max' is not"),
    (lambda t: t.replace("local_steps = 4", "local_steps = 4\noutlier_factor = 0.5"),
     "`training.outlier_factor` = 0.5: must be 0 (off) or between 1"),
])
def test_bad_config_names_the_key(tmp_path, edit, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, edit(GOOD)))
    assert needle in str(ei.value)
    assert ei.value.hint


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")


def test_from_dict_defaults(tmp_path):
    (tmp_path / "a").mkdir()
    cfg = NodeConfig.from_dict({"node_id": "n", "artifact": str(tmp_path / "a"), "data_dir": str(tmp_path)})
    assert cfg.training.sync is SyncMode.GRADIENT and cfg.store.retention is Retention.DROP_OLDEST
    assert cfg.broker is None and cfg.auth_token is None


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda t: t.replace('node_id = "node-1"\n', ""), "missing required key `node_id`"),
    (lambda t: t.replace("port = 8099", 'port = "eighty"'), "`port`"),
    (lambda t: t.replace('sync = "local-sgd"', 'sync = "gossip"'), "training.sync"),
])
def test_cli_bad_config_one_line_nonzero_exit(tmp_path, edit, needle):
    cfg = write(tmp_path, edit(GOOD))
    cmd = [sys.executable, "-c", "from api.cli import main; main()", "node", "--config", str(cfg)]
    proc = subprocess.run(cmd,
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and needle in lines[0] and "(help: " in lines[0]


def test_cli_busy_port_is_one_line(tmp_path, digits_artifact):
    import socket

    from tests.fixtures_node import write_node_toml

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = write_node_toml(tmp_path / "NODE.toml", {"node_id": "n", "artifact": str(digits_artifact),
                                                       "port": port, "data_dir": "d"})
        cmd = [sys.executable, "-c", "from api.cli import main; main()", "node", "--config", str(cfg)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], proc.stderr


def test_node_process_freezes_its_startup_heap(tmp_path, digits_artifact):
    """`fractal node` moves its start-up objects out of the cyclic GC's reach once started
    (edgenode.common.freeze_startup_heap): /metrics of the real process reports how many."""
    import httpx

    from federation.broker import free_port
    from tests.fixtures_node import write_node_toml

    port = free_port()
    cfg = write_node_toml(tmp_path / "NODE.toml", {"node_id": "n", "artifact": str(digits_artifact),
                                                   "port": port, "data_dir": "d"})
    cmd = [sys.executable, "-c", "from api.cli import main; main()", "node", "--config", str(cfg)]
    log = tmp_path / "node.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while True:
                assert proc.poll() is None, log.read_text()[-2000:]
                try:
                    if client.get("/v2/health/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "node not ready"
                time.sleep(0.1)
            text = client.get("/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    line = next(ln for ln in text.splitlines() if ln.startswith("fractal_node_gc_frozen_objects "))
    assert float(line.split()[1]) > 50_000  # the modules, TVM's runtime and the artifact
