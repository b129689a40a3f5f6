"""Node-API fixtures: ONE real edge node (TVM-compiled digits-mlp) served by uvicorn on loopback.

Session-scoped so the artifact is compiled once and uvicorn starts once per app variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from api.node_app import create_node_app
from api.serving import ServerThread

TOKEN = "api-test-token"
MAX_BODY = 256 * 1024


@dataclass
class _Spec:
    name: str
    shape: tuple
    dtype: str


class _FakeNode:  # TEMPORARY until EdgeNode lands
    model_name = "digits-mlp"
    inputs = [_Spec("x", (1, 64), "float32")]
    outputs = [_Spec("logits", (1, 10), "float32")]
    W = np.random.default_rng(0).standard_normal((64, 10)).astype(np.float32)

    def __init__(self):
        self.samples = []

    def infer(self, inputs):
        return {"logits": inputs["x"] @ self.W}

    def add_samples(self, inputs, labels):
        self.samples.extend(zip(inputs["x"], labels, strict=True))
        return len(labels)

    def info(self):
        return {"node_id": "api-test", "sample_count": len(self.samples)}


@pytest.fixture(scope="session")
def api_node():
    return _FakeNode()


@pytest.fixture(scope="session")
def reference_infer(api_node):
    """Direct in-process inference (no HTTP) on the same node's model."""
    return lambda x: {"logits": x @ api_node.W}


@pytest.fixture(scope="session")
def server(api_node):
    with ServerThread(create_node_app(api_node, max_body_bytes=MAX_BODY)) as srv:
        yield srv


@pytest.fixture(scope="session")
def auth_server(api_node):
    with ServerThread(create_node_app(api_node, auth_token=TOKEN, max_body_bytes=MAX_BODY)) as srv:
        yield srv
