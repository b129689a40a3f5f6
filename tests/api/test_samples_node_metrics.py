"""POST /v1/samples is durable and counted; GET /v1/node and /metrics report it."""

from __future__ import annotations

import httpx
import numpy as np
import pytest


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def test_samples_are_stored_and_counted(http, api_node):
    spec = api_node.inputs[0]
    before = http.get("/v1/node").json()["samples"]
    rng = np.random.default_rng(3)
    xs = rng.random((6, *spec.shape[1:]), dtype=np.float32)
    labels = [0, 1, 2, 3, 4, 5]
    r = http.post("/v1/samples", json={"inputs": {spec.name: xs.tolist()}, "labels": labels})
    assert r.status_code == 200, r.text
    assert r.json()["stored"] == 6
    info = http.get("/v1/node").json()
    assert info["samples"] == before + 6 == api_node.store.count
    assert r.json()["sample_count"] == before + 6
    stored_x, stored_y = _stored(api_node)
    np.testing.assert_array_equal(stored_x[-6:], xs)
    np.testing.assert_array_equal(stored_y[-6:], labels)


def _stored(api_node):
    snap = api_node.store.snapshot()  # read back from SQLite, not from a cache
    return snap.inputs[api_node.inputs[0].name], snap.labels


def test_metrics_exposition(http, api_node):
    spec = api_node.inputs[0]
    body = {"inputs": [{"name": spec.name, "shape": [1, spec.shape[1]], "datatype": "FP32",
                        "data": [0.0] * spec.shape[1]}]}
    for _ in range(3):
        assert http.post(f"/v2/models/{api_node.model_name}/infer", json=body).status_code == 200
    text = http.get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith(
        'fractal_http_requests_total{method="POST",route="/v2/models/{name}/infer",status="200"}'))
    assert float(line.rsplit(" ", 1)[1]) >= 3
    bucket = 'fractal_http_request_duration_seconds_bucket{le="0.001",method="POST",'
    assert bucket + 'route="/v2/models/{name}/infer"}' in text
    values = {ln.split(" ")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
              if ln and not ln.startswith("#")}
    # the node's own series follow the HTTP ones: inferences, samples, rounds, last loss
    assert values["fractal_node_inferences_total"] >= 3
    assert values["fractal_node_samples"] == api_node.store.count
    assert "fractal_node_last_loss" in values and "fractal_node_model_version" in values
    assert any(k.startswith("fractal_node_rounds") for k in text.split())


def test_node_side_label_checks_are_400(http, api_node):
    spec = api_node.inputs[0]
    n_classes = api_node.outputs[0].shape[-1]
    before = api_node.store.count
    r = http.post("/v1/samples", json={"inputs": {spec.name: [[0.0] * spec.shape[1]]}, "labels": [n_classes]})
    assert r.status_code == 400 and "class ids" in r.json()["error"], r.text
    assert api_node.store.count == before  # nothing stored from a rejected batch


def test_node_info(http, api_node):
    info = http.get("/v1/node").json()
    assert info["node_id"] == "api-node"
    assert info["model"] == api_node.model_name
    assert info["params_sha256"] == api_node.params_sha256 and len(info["params_sha256"]) == 64
    assert info["model_version"] == api_node.model_version
    assert "round_id" in info and "arch" in info


def test_a_node_bug_is_a_json_500_not_a_crash(http, api_node, monkeypatch):
    def boom():
        raise RuntimeError("simulated node bug")

    monkeypatch.setattr(api_node, "info", boom)
    r = http.get("/v1/node")
    assert r.status_code == 500 and r.json() == {"error": "internal error: RuntimeError"}
    monkeypatch.undo()
    assert http.get("/v1/node").status_code == 200  # the server kept serving


def test_server_stays_responsive_while_inference_runs(server, api_node, monkeypatch):
    """Inference runs on worker threads: a slow model does not block health or metadata."""
    import threading

    real_infer = api_node.infer
    entered, release = threading.Event(), threading.Event()

    def slow_infer(inputs):
        entered.set()
        release.wait(60)  # held until health and metadata have answered (or the test gave up)
        return real_infer(inputs)

    monkeypatch.setattr(api_node, "infer", slow_infer)
    spec = api_node.inputs[0]
    body = {"inputs": [{"name": spec.name, "shape": [1, spec.shape[1]], "datatype": "FP32",
                        "data": [0.0] * spec.shape[1]}]}
    result = {}

    def call():
        result["r"] = httpx.post(f"{server.url}/v2/models/{api_node.model_name}/infer", json=body, timeout=90)

    t = threading.Thread(target=call)
    t.start()
    try:
        assert entered.wait(30)
        # a server that ran inference on its event loop could not answer these until released
        with httpx.Client(base_url=server.url, timeout=20) as c:
            assert c.get("/v2/health/ready").status_code == 200
            assert c.get(f"/v2/models/{api_node.model_name}").status_code == 200
        assert "r" not in result  # answered while the inference was still held
    finally:
        release.set()
    t.join(60)
    assert result["r"].status_code == 200
