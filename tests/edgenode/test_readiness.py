"""/v2/health/ready is real: 503 naming the reason while the node cannot serve (not started,
parameters being swapped, sample store unable to write), 200 otherwise."""

from __future__ import annotations

import threading

import numpy as np
from fastapi.testclient import TestClient

from api.node_app import create_node_app
from edgenode.config import NodeConfig
from edgenode.node import EdgeNode
from tests.edgenode.fakes import NumpyArtifact


def _node(tmp_path) -> tuple[EdgeNode, NumpyArtifact]:
    (tmp_path / "art").mkdir(exist_ok=True)
    cfg = NodeConfig.from_dict({"node_id": "ready-1", "artifact": str(tmp_path / "art"),
                                "data_dir": str(tmp_path / "data")})
    art = NumpyArtifact()
    return EdgeNode(cfg, artifact=art), art


def _ready(client: TestClient) -> tuple[int, str]:
    r = client.get("/v2/health/ready")
    return r.status_code, r.text


def test_not_started_then_ready_then_stopped(tmp_path):
    node, _ = _node(tmp_path)
    client = TestClient(create_node_app(node))
    code, body = _ready(client)
    assert code == 503 and "not started" in body
    assert client.get("/v2/health/live").status_code == 200
    node.start()
    assert _ready(client)[0] == 200
    assert client.get(f"/v2/models/{node.model_name}/ready").status_code == 200
    node.stop()
    code, body = _ready(client)
    assert code == 503 and "not started" in body


def test_not_ready_while_parameters_are_swapped(tmp_path):
    node, art = _node(tmp_path)
    node.start()
    client = TestClient(create_node_app(node))
    gate = art.prepare_gate = threading.Event()
    params = [p + 1 for p in art.params]
    swap = threading.Thread(target=node.model.commit, args=(params, 1))
    swap.start()
    try:
        deadline = threading.Event()
        while not node.model.swapping and not deadline.wait(0.01):
            pass
        code, body = _ready(client)
        assert code == 503 and "parameters are being swapped" in body
        r = client.get(f"/v2/models/{node.model_name}/ready")
        assert r.status_code == 400 and "swapped" in r.json()["error"]
    finally:
        gate.set()
        swap.join(10)
    assert node.model.version == 1 and _ready(client)[0] == 200
    node.stop()


def test_store_that_cannot_write_answers_507_and_is_not_ready(tmp_path):
    node, _ = _node(tmp_path)
    node.start()
    client = TestClient(create_node_app(node))
    sample = {"inputs": {"x": np.zeros((1, 64)).tolist()}, "labels": [3]}
    assert client.post("/v1/samples", json=sample).status_code in (200, 201)
    node.store._db.execute("PRAGMA query_only = ON")  # SQLite now refuses every write, as a RO disk
    r = client.post("/v1/samples", json=sample)
    assert r.status_code == 507 and "cannot write" in r.json()["error"]
    code, body = _ready(client)
    assert code == 503 and "sample store cannot write" in body
    assert node.store.count == 1  # nothing half-written
    node.store._db.execute("PRAGMA query_only = OFF")  # the disk is back: the next write heals it
    assert client.post("/v1/samples", json=sample).status_code in (200, 201)
    assert _ready(client)[0] == 200 and node.store.count == 2
    node.stop()
