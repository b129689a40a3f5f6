"""Version "0" of a node's model is its image's own parameters, answered next to the current
version: the boot health check compares it with the image's reference output. Before, the check
ran on the current parameters, so a board that had trained failed its check at the next boot
(both slots: the booted-board OTA test after a training round)."""

from __future__ import annotations

import json

import httpx
import numpy as np

from api.node_app import create_node_app
from api.serving import ServerThread
from tests.api.conftest import _make_node


def test_version_0_answers_the_shipped_parameters_after_the_node_trained(tmp_path, digits_artifact) -> None:
    node = _make_node(tmp_path, "shipped-node", digits_artifact)
    try:
        art = node.artifact
        shipped = [np.asarray(p, np.float32) for p in art.params]
        node.model.commit([p + np.float32(0.05) for p in shipped], 1)  # what a round would leave
        x = np.random.default_rng(3).standard_normal((2, *node.inputs[0].shape[1:])).astype(np.float32)
        body = {"inputs": [{"name": node.inputs[0].name, "shape": list(x.shape), "datatype": "FP32",
                            "data": x.ravel().tolist()}]}
        want_shipped = art.infer({node.inputs[0].name: x}, params=shipped)
        want_now = art.infer({node.inputs[0].name: x}, params=list(node.model.snapshot.params))
        with ServerThread(create_node_app(node)) as srv:
            base = f"http://127.0.0.1:{srv.port}/v2/models/{node.model_name}"
            now = httpx.post(f"{base}/infer", json=body, timeout=30)
            v0 = httpx.post(f"{base}/versions/0/infer", json=body, timeout=30)
            v1 = httpx.post(f"{base}/versions/1/infer", json=body, timeout=30)
            v7 = httpx.post(f"{base}/versions/7/infer", json=body, timeout=30)
        assert now.status_code == v0.status_code == v1.status_code == 200, (now.text, v0.text)
        assert v7.status_code == 404 and "version '7'" in v7.json()["error"]

        def out(r: httpx.Response) -> np.ndarray:
            o = json.loads(r.content)["outputs"][0]
            return np.asarray(o["data"], np.float32).reshape(o["shape"])

        name = next(iter(want_shipped))
        assert v0.json()["model_version"] == "0" and now.json()["model_version"] == "1"
        np.testing.assert_allclose(out(v0), want_shipped[name], atol=1e-5)
        np.testing.assert_allclose(out(now), want_now[name], atol=1e-5)
        np.testing.assert_allclose(out(v1), want_now[name], atol=1e-5)
        assert not np.allclose(out(v0), out(now), atol=1e-3)  # the round really changed the answer
    finally:
        node.stop()
