"""Inference takes IEEE values (NaN, +-inf), as onnxruntime does; they cannot reach anyone else.

The node serves a model that MIXES THE BATCH AXIS (``x - mean(x, axis=0)``): if a request holding
NaN ever shared a library call with another request's samples, that request's answer would turn
NaN. Attackers send NaN and infinities (tritonclient binary and JSON, raw JSON tokens) while honest
clients send finite batches at the same time; every honest answer must be bit-identical to the one
it got alone, and every attacker gets onnxruntime's IEEE answer. Before the change the node
refused NaN with a 400, so this test failed; samples (which train) still get a 400 for NaN.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from onnx import TensorProto
from onnx import helper as oh

from api.node_app import create_node_app
from api.serving import ServerThread
from compiler.build import compile_model
from tests.api.conftest import _make_node

BATCH, WIDTH = 4, 8
OUTS = ("centered", "nan", "inf")


def _model(path: Path) -> Path:
    nodes = [oh.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),  # across the batch
             oh.make_node("Sub", ["x", "mean"], ["centered"]),
             oh.make_node("IsNaN", ["x"], ["nan"]),
             oh.make_node("IsInf", ["x"], ["inf"])]
    graph = oh.make_graph(nodes, "mix_batch",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
                          [oh.make_tensor_value_info("centered", TensorProto.FLOAT, [BATCH, WIDTH]),
                           oh.make_tensor_value_info("nan", TensorProto.BOOL, [BATCH, WIDTH]),
                           oh.make_tensor_value_info("inf", TensorProto.BOOL, [BATCH, WIDTH])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def mixing(tmp_path_factory):
    """(node, server url, onnxruntime session) for the batch-mixing model."""
    base = tmp_path_factory.mktemp("nonfinite")
    onnx_path = _model(base / "mix.onnx")
    art = compile_model(onnx_path, target="x86_64", out_dir=base / "art", progress=False)
    node = _make_node(base / "node", "nonfinite-node", art)
    try:
        with ServerThread(create_node_app(node)) as srv:
            yield node, srv.url, ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    finally:
        node.stop()


def _hostile() -> np.ndarray:
    x = np.random.default_rng(1).standard_normal((BATCH, WIDTH)).astype(np.float32)
    x[2, 5] = np.nan
    x[0, 1] = np.inf
    x[3, 3] = -np.inf
    return x


def _infer(client: triton.InferenceServerClient, model: str, x: np.ndarray, binary: bool) -> dict:
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    wanted = [triton.InferRequestedOutput(o, binary_data=binary) for o in OUTS]
    res = client.infer(model, [inp], outputs=wanted)
    return {o: res.as_numpy(o) for o in OUTS}


def _assert_ieee(got: dict, sess: ort.InferenceSession, x: np.ndarray) -> None:
    want = dict(zip(OUTS, sess.run(list(OUTS), {"x": x}), strict=True))
    for o in OUTS:
        assert got[o].dtype == want[o].dtype and got[o].shape == want[o].shape, o
        np.testing.assert_array_equal(got[o], want[o], err_msg=o)  # NaN == NaN, inf == inf here


def test_nan_requests_cannot_change_concurrent_answers(mixing):
    node, url, sess = mixing
    host = url.removeprefix("http://")
    honest = [np.random.default_rng(10 + i).standard_normal((BATCH, WIDTH)).astype(np.float32)
              for i in range(3)]
    with triton.InferenceServerClient(host) as c:
        alone = [_infer(c, node.model_name, x, True) for x in honest]
    for x, a in zip(honest, alone, strict=True):
        assert np.isfinite(a["centered"]).all()
        _assert_ieee(a, sess, x)  # the honest answer is right to begin with (to float32 rounding)

    hostile = _hostile()
    rounds = 15
    start = threading.Barrier(len(honest) + 3)
    failures: list[str] = []

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - a client that died is a failure, not a silent pass
                failures.append(f"{fn.__name__}{args}: {type(exc).__name__}: {str(exc)[:300]}")
        return run

    @guarded
    def honest_client(i: int) -> None:
        with triton.InferenceServerClient(host) as c:
            start.wait()
            for k in range(rounds):
                got = _infer(c, node.model_name, honest[i], binary=k % 2 == 0)
                for o in OUTS:
                    if not np.array_equal(got[o], alone[i][o]):
                        failures.append(f"honest client {i}, request {k}: {o} changed")

    @guarded
    def attacker(how: str) -> None:
        with triton.InferenceServerClient(host) as c, httpx.Client(base_url=url, timeout=60) as http:
            start.wait()
            for _ in range(rounds):
                if how == "raw-json":  # the JSON tokens Python's json writes, without a client library
                    body = {"inputs": [{"name": "x", "shape": [BATCH, WIDTH], "datatype": "FP32",
                                        "data": hostile.tolist()}]}
                    r = http.post(f"/v2/models/{node.model_name}/infer", content=json.dumps(body))
                    if r.status_code != 200:
                        failures.append(f"raw JSON attacker got {r.status_code}: {r.text[:200]}")
                        return
                    out = {t["name"]: np.array(t["data"], np.float32 if t["datatype"] == "FP32" else bool)
                           .reshape(t["shape"]) for t in r.json()["outputs"]}
                else:
                    out = _infer(c, node.model_name, hostile, binary=how == "binary")
                try:
                    _assert_ieee(out, sess, hostile)
                except AssertionError as exc:
                    failures.append(f"{how} attacker: {str(exc)[:300]}")

    threads = [threading.Thread(target=honest_client, args=(i,)) for i in range(len(honest))]
    threads += [threading.Thread(target=attacker, args=(how,)) for how in ("binary", "json", "raw-json")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


def test_non_finite_samples_are_still_refused(mixing):
    """Samples train: NaN and infinity stay a 400 whatever inference takes, and nothing is stored."""
    node, url, _ = mixing
    before = node.store.count
    hostile = _hostile()
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {"inputs": {"x": hostile[:1].tolist()}, "labels": [0]}
        r = http.post("/v1/samples", content=json.dumps(body))
        assert r.status_code == 400 and "non-finite" in r.json()["error"], r.text
        r = http.post("/v1/samples", json={"inputs": {"x": [[1e39] * WIDTH]}, "labels": [0]})
        assert r.status_code == 400 and "NaN or Inf" in r.json()["error"], r.text
        r = http.post("/v1/samples", json={"inputs": {"x": [[0.5] * WIDTH]}, "labels": [0]})
        assert r.status_code == 200, r.text  # the route itself works for this model
    assert node.store.count == before + 1
