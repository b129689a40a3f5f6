"""Node-API fixtures: a REAL edge node (TVM-compiled digits-mlp with its training module, from
``tests/fixtures_node.py``) served by uvicorn on a free loopback port.

Session-scoped so the artifact is compiled once and each server starts once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from api.node_app import create_node_app
from api.serving import ServerThread
from tests.fixtures_node import write_node_toml

TOKEN = "api-test-token"
MAX_BODY = 256 * 1024


def _make_node(base: Path, node_id: str, artifact_dir: Path, artifact=None, **keys):
    from edgenode.config import load_config
    from edgenode.node import EdgeNode

    cfg = write_node_toml(base / "NODE.toml", {"node_id": node_id, "artifact": str(artifact_dir), "port": 0,
                                               "data_dir": str(base / "data"), **keys})
    node = EdgeNode(load_config(cfg), artifact=artifact)
    node.start()
    return node


@pytest.fixture(scope="session")
def api_node(tmp_path_factory, digits_artifact):
    """A started EdgeNode without a broker; max_body_bytes comes from its NODE.toml."""
    node = _make_node(tmp_path_factory.mktemp("api-node"), "api-node", digits_artifact,
                      max_body_bytes=MAX_BODY)
    yield node
    node.stop()


@pytest.fixture(scope="session")
def reference_infer(api_node):
    """Direct in-process ``Artifact.infer`` with the node's current parameters (no HTTP)."""
    art = api_node.artifact
    return lambda x: art.infer({api_node.inputs[0].name: np.asarray(x, np.float32)},
                               params=list(api_node.model.snapshot.params))


@pytest.fixture(scope="session")
def server(api_node):
    with ServerThread(create_node_app(api_node)) as srv:
        yield srv


@pytest.fixture(scope="session")
def auth_node(tmp_path_factory, digits_artifact, api_node):
    """A second node whose NODE.toml sets ``auth_token`` (shares the loaded artifact)."""
    node = _make_node(tmp_path_factory.mktemp("auth-node"), "auth-node", digits_artifact,
                      artifact=api_node.artifact, auth_token=TOKEN, max_body_bytes=MAX_BODY)
    yield node
    node.stop()


@pytest.fixture(scope="session")
def auth_server(auth_node):
    with ServerThread(create_node_app(auth_node)) as srv:
        yield srv
