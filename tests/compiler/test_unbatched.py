"""Models whose inputs share no batch dimension (``addmm``: A [2, 3], B [3, 4], bias [4], as in
ONNX's pytorch-operator tests) compile for exactly their shapes and serve exactly those shapes:
the compiler, verification against onnxruntime, a real node's OIP metadata and inference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler import compile_model
from compiler.artifact import load_artifact
from compiler.errors import InputError, ModelError
from compiler.manifest import Manifest
from compiler.trainbuild import TrainSettings
from compiler.verify import verify_artifact
from tests.api.conftest import _make_node


def _addmm(path: Path) -> Path:
    # y = A @ B + bias + A @ W (W a trainable-looking initializer, to keep a parameter around)
    w = helper.make_tensor("W", TensorProto.FLOAT, [3, 4], np.linspace(-1, 1, 12).tolist())
    g = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["ab"]), helper.make_node("MatMul", ["A", "W"], ["aw"]),
         helper.make_node("Add", ["ab", "aw"], ["s"]), helper.make_node("Add", ["s", "bias"], ["y"])],
        "addmm",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("B", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("bias", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], initializer=[w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


@pytest.fixture(scope="module")
def addmm(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("addmm")
    onnx_path = _addmm(d / "addmm.onnx")
    return onnx_path, compile_model(onnx_path, target="x86_64", out_dir=d / "art", progress=False)


def _feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"A": rng.standard_normal((2, 3), np.float32), "B": rng.standard_normal((3, 4), np.float32),
            "bias": rng.standard_normal(4, np.float32)}


def test_compiles_for_exact_shapes_and_matches_numpy(addmm):
    onnx_path, art_dir = addmm
    man = Manifest.read(art_dir)
    assert man.batched is False
    assert json.loads((art_dir / "manifest.json").read_text())["batched"] is False
    assert [s.shape for s in man.inputs] == [(2, 3), (3, 4), (4,)]
    art = load_artifact(art_dir)
    x = _feeds()
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    want = x["A"] @ x["B"] + x["A"] @ w + x["bias"]
    np.testing.assert_allclose(art.infer(x)["y"], want, rtol=1e-5, atol=1e-5)
    # parameters still swap (a new W changes the answer)
    got = art.infer(x, params=[np.zeros((3, 4), np.float32)])["y"]
    np.testing.assert_allclose(got, x["A"] @ x["B"] + x["bias"], rtol=1e-5, atol=1e-5)
    assert verify_artifact(art_dir, onnx_path).ok


def test_other_shapes_are_refused_with_the_expected_shape(addmm):
    art = load_artifact(addmm[1])
    x = _feeds()
    # a "batch" of two A's is not a thing for this model
    bad = {**x, "A": np.concatenate([x["A"], x["A"]])}
    with pytest.raises(InputError, match=r"input 'A' has shape \[4, 3\], expected \[2, 3\]") as e:
        art.infer(bad)
    assert "no batch dimension" in (e.value.hint or "")
    with pytest.raises(InputError, match=r"input 'bias' has shape \[1, 4\], expected \[4\]"):
        art.infer({**x, "bias": x["bias"][None]})


def test_training_and_batch_are_refused_at_compile_time(addmm, tmp_path):
    with pytest.raises(ModelError, match=r"no common batch dimension \(A: 2, B: 3, bias: 4\)"):
        compile_model(addmm[0], target="x86_64", out_dir=tmp_path / "t", progress=False,
                      train=TrainSettings(loss="mse", batch=2))
    assert not (tmp_path / "t").exists()


def test_a_dynamic_leading_dim_among_disagreeing_inputs_names_the_input(tmp_path):
    m = onnx.load(_addmm(tmp_path / "m.onnx"))
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    m.graph.input[2].type.tensor_type.shape.dim.add().dim_value = 1  # bias [4, 1]: leading 4 vs B's 3
    onnx.save(m, tmp_path / "dyn.onnx")
    with pytest.raises(ModelError, match="input 'A' has a dynamic leading dimension") as e:
        compile_model(tmp_path / "dyn.onnx", target="x86_64", out_dir=tmp_path / "o", progress=False)
    assert "--shape A=" in (e.value.hint or "")


def test_older_manifests_without_the_field_are_batched(addmm, tmp_path):
    data = json.loads((addmm[1] / "manifest.json").read_text())
    del data["batched"]
    assert Manifest.from_json(data).batched is True


def test_node_reports_exact_shapes_and_serves_them(addmm, tmp_path):
    import httpx
    import tritonclient.http as triton

    from api.node_app import create_node_app
    from api.serving import ServerThread

    node = _make_node(tmp_path / "n", "unbatched-node", addmm[1])
    try:
        with ServerThread(create_node_app(node)) as srv:
            meta = httpx.get(f"{srv.url}/v2/models/{node.model_name}").json()
            assert [i["shape"] for i in meta["inputs"]] == [[2, 3], [3, 4], [4]]
            assert meta["outputs"][0]["shape"] == [2, 4]
            client = triton.InferenceServerClient(srv.url.split("://", 1)[1])
            x = _feeds(1)
            ins = []
            for k, v in x.items():
                t = triton.InferInput(k, list(v.shape), "FP32")
                t.set_data_from_numpy(v, binary_data=True)
                ins.append(t)
            res = client.infer(node.model_name, ins)
            np.testing.assert_allclose(res.as_numpy("y"), node.artifact.infer(x)["y"], rtol=1e-6)
            # the wrong shape is a 400 naming the input
            r = httpx.post(f"{srv.url}/v2/models/{node.model_name}/infer", json={"inputs": [
                {"name": "A", "datatype": "FP32", "shape": [1, 3], "data": [0, 0, 0]},
                {"name": "B", "datatype": "FP32", "shape": [3, 4], "data": [0] * 12},
                {"name": "bias", "datatype": "FP32", "shape": [4], "data": [0] * 4}]})
            assert r.status_code == 400 and "expected [2, 3]" in r.json()["error"]
    finally:
        node.stop()
