"""String tensors at a model's edges over HTTP: tritonclient sends BYTES to a node serving a
sklearn-onnx-like pipeline (LabelEncoder string -> int feeding a small numeric model, and a
LabelEncoder int -> string on its answer), checked against onnxruntime on the same model."""

from __future__ import annotations

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from api.node_app import create_node_app
from api.serving import ServerThread
from compiler.build import compile_model
from tests.api.conftest import _make_node

COLORS = ["red", "green", "blue", "grün"]


def pipeline_model() -> onnx.ModelProto:
    """color [N] string -> LabelEncoder -> int64 -> float [N, 1] -> Gemm -> score [N, 2];
    ArgMax(score) -> LabelEncoder -> label [N] string."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [1, 2], [0.5, -1.0])
    b = helper.make_tensor("b", TensorProto.FLOAT, [2], [0.25, 1.5])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    nodes = [
        helper.make_node("LabelEncoder", ["color"], ["idx"], domain="ai.onnx.ml", name="encode",
                         keys_strings=COLORS, values_int64s=[0, 1, 2, 3], default_int64=-1),
        helper.make_node("Cast", ["idx"], ["idx_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["idx_f", "axes"], ["col"]),
        helper.make_node("Gemm", ["col", "w", "b"], ["score"]),
        helper.make_node("ArgMax", ["score"], ["best"], axis=1, keepdims=0),
        helper.make_node("LabelEncoder", ["best"], ["label"], domain="ai.onnx.ml", name="decode",
                         keys_int64s=[0, 1], values_strings=["low", "hoch"], default_string="?"),
    ]
    graph = helper.make_graph(
        nodes, "pipeline", [helper.make_tensor_value_info("color", TensorProto.STRING, ["N"])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["N", 2]),
         helper.make_tensor_value_info("label", TensorProto.STRING, ["N"])], initializer=[w, b, axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.ml", 3)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def strings_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strings-node")
    onnx.save(pipeline_model(), tmp / "pipeline.onnx")
    art = compile_model(tmp / "pipeline.onnx", target="x86_64", out_dir=tmp / "art", progress=False)
    node = _make_node(tmp / "node", "strings-node", art)
    try:
        with ServerThread(create_node_app(node)) as srv:
            yield srv, tmp / "pipeline.onnx"
    finally:
        node.stop()


@pytest.fixture(scope="module")
def client(strings_server):
    c = triton.InferenceServerClient(strings_server[0].url.removeprefix("http://"), connection_timeout=10,
                                     network_timeout=30)
    yield c
    c.close()


def _colors() -> np.ndarray:
    return np.array(["blue", "red", "purple", "grün", "green", ""], dtype=object)


def test_metadata_says_bytes(client):
    meta = client.get_model_metadata("pipeline")
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [("color", "BYTES", [-1])]
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == [
        ("score", "FP32", [-1, 2]), ("label", "BYTES", [-1])]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bytes_in_and_out_match_onnxruntime(client, strings_server, binary):
    x = _colors()
    sess = ort.InferenceSession(str(strings_server[1]), providers=["CPUExecutionProvider"])
    want_score, want_label = sess.run(None, {"color": x})
    inp = triton.InferInput("color", [len(x)], "BYTES")
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("score", "label")]
    res = client.infer("pipeline", [inp], outputs=outs)
    np.testing.assert_allclose(res.as_numpy("score"), want_score, rtol=1e-6)
    label = res.as_numpy("label")
    got = [v.decode() if isinstance(v, bytes) else v for v in label.tolist()]
    assert got == list(want_label) and len(set(got)) == 2  # both labels, the UTF-8 one included


def test_wrong_types_are_4xx(client, strings_server):
    inp = triton.InferInput("color", [2], "FP32")
    inp.set_data_from_numpy(np.zeros(2, np.float32))
    with pytest.raises(InferenceServerException, match="expected strings"):
        client.infer("pipeline", [inp])
    url = strings_server[0].url + "/v2/models/pipeline/infer"
    bad_json = {"inputs": [{"name": "color", "datatype": "BYTES", "shape": [2], "data": ["red", 3]}]}
    r = httpx.post(url, json=bad_json, timeout=30)
    assert r.status_code == 400 and "only strings" in r.json()["error"]
    raw = (2).to_bytes(4, "little") + b"\xff\xfe"  # one element that is not UTF-8
    head = ('{"inputs":[{"name":"color","datatype":"BYTES","shape":[1],'
            f'"parameters":{{"binary_data_size":{len(raw)}}}}}]}}').encode()
    r = httpx.post(url, content=head + raw, headers={"Inference-Header-Content-Length": str(len(head))},
                   timeout=30)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]
    short = head.replace(str(len(raw)).encode(), b"9")
    r = httpx.post(url, content=short + raw + b"xxx",
                   headers={"Inference-Header-Content-Length": str(len(short))}, timeout=30)
    assert r.status_code == 400 and "BYTES" in r.json()["error"]
