"""A node serving a model whose output shape is decided at run time (Reduce* with its axes a model
input, compiler.dynshape): the Open Inference Protocol metadata gives -1 for those dims, inference
answers in the shape the axes ask for, and axes ONNX forbids get a 400 naming the problem."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh

from api.node_app import create_node_app
from api.serving import ServerThread
from compiler.build import compile_model
from tests.api.conftest import _make_node


def test_node_serves_run_time_output_shapes(tmp_path: Path) -> None:
    graph = oh.make_graph([oh.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "dyn_reduce",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
                           oh.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "dyn.onnx")
    art = compile_model(tmp_path / "dyn.onnx", target="x86_64", out_dir=tmp_path / "art", progress=False)
    node = _make_node(tmp_path / "node", "dyn-node", art)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    try:
        with ServerThread(create_node_app(node)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            meta = http.get(f"/v2/models/{node.model_name}").json()
            assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, -1]}]
            assert [i["shape"] for i in meta["inputs"]] == [[2, 3, 4], [1]]
            data = {"name": "x", "shape": [2, 3, 4], "datatype": "FP32", "data": x.ravel().tolist()}
            for axis in (0, 2, -2):
                body = {"inputs": [data, {"name": "axes", "shape": [1], "datatype": "INT64", "data": [axis]}]}
                r = http.post(f"/v2/models/{node.model_name}/infer", json=body)
                assert r.status_code == 200, r.text
                out = r.json()["outputs"][0]
                want = x.sum(axis=axis)
                assert out["shape"] == list(want.shape)
                np.testing.assert_allclose(np.array(out["data"]).reshape(want.shape), want)
            body["inputs"][1]["data"] = [3]  # out of range for a rank-3 input
            r = http.post(f"/v2/models/{node.model_name}/infer", json=body)
            assert r.status_code == 400 and "refused these inputs at run time" in r.json()["error"], r.text
    finally:
        node.stop()


def test_node_serves_data_dependent_output_lengths(tmp_path: Path) -> None:
    """NonMaxSuppression (compiler.dataops): the metadata gives [-1, 3], each response carries the
    row count its inputs select (through tritonclient's binary tensors and plain JSON), the model
    has no batch dimension (its rows are not samples: another leading dim is a 400), and an
    iou_threshold outside [0, 1] is a 400."""
    import onnxruntime as ort
    import tritonclient.http as triton

    F = TensorProto.FLOAT
    nms = oh.make_node("NonMaxSuppression", ["boxes", "scores", "k", "iou", "thr"], ["sel"])
    graph = oh.make_graph([nms], "nms", [oh.make_tensor_value_info("boxes", F, [1, 8, 4]),
                                  oh.make_tensor_value_info("scores", F, [1, 2, 8]),
                                  oh.make_tensor_value_info("k", TensorProto.INT64, [1]),
                                         oh.make_tensor_value_info("iou", F, [1]),
                                         oh.make_tensor_value_info("thr", F, [1])],
                          [oh.make_tensor_value_info("sel", TensorProto.INT64, [None, 3])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 11)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "nms.onnx")
    art = compile_model(tmp_path / "nms.onnx", target="x86_64", out_dir=tmp_path / "art", progress=False)
    node = _make_node(tmp_path / "node", "nms-node", art)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    corner = rng.random((1, 8, 2)).astype(np.float32)
    boxes = np.concatenate([corner, corner + 0.4], axis=2)
    scores = rng.random((1, 2, 8)).astype(np.float32)
    try:
        with ServerThread(create_node_app(node)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            meta = http.get(f"/v2/models/{node.model_name}").json()
            assert meta["outputs"] == [{"name": "sel", "datatype": "INT64", "shape": [-1, 3]}]
            assert [i["shape"] for i in meta["inputs"]] == [[1, 8, 4], [1, 2, 8], [1], [1], [1]]
            client = triton.InferenceServerClient(srv.url.split("://", 1)[1])
            rows = set()
            for k, iou in ((1, 0.5), (3, 0.2), (8, 0.9), (0, 0.5)):
                feeds = {"boxes": boxes, "scores": scores, "k": np.array([k], np.int64),
                         "iou": np.array([iou], np.float32), "thr": np.array([0.1], np.float32)}
                want = sess.run(None, feeds)[0]
                ins = []
                for name, v in feeds.items():
                    t = triton.InferInput(name, list(v.shape), "INT64" if v.dtype == np.int64 else "FP32")
                    t.set_data_from_numpy(v, binary_data=True)
                    ins.append(t)
                binary = [triton.InferRequestedOutput("sel", binary_data=True)]
                got = client.infer(node.model_name, ins, outputs=binary).as_numpy("sel")
                np.testing.assert_array_equal(got, want)
                body = {"inputs": [{"name": n, "shape": list(v.shape), "data": v.ravel().tolist(),
                                    "datatype": "INT64" if v.dtype == np.int64 else "FP32"}
                                   for n, v in feeds.items()]}
                r = http.post(f"/v2/models/{node.model_name}/infer", json=body)
                assert r.status_code == 200, r.text
                out = r.json()["outputs"][0]
                assert out["shape"] == list(want.shape)
                np.testing.assert_array_equal(np.array(out["data"], np.int64).reshape(want.shape), want)
                rows.add(want.shape[0])
            assert len(rows) == 4 and 0 in rows
            two = dict(body["inputs"][0], shape=[2, 8, 4], data=body["inputs"][0]["data"] * 2)
            r = http.post(f"/v2/models/{node.model_name}/infer", json={"inputs": [two, *body["inputs"][1:]]})
            assert r.status_code == 400 and "expected [1, 8, 4]" in r.json()["error"], r.text
            body["inputs"][3]["data"] = [1.5]
            r = http.post(f"/v2/models/{node.model_name}/infer", json=body)
            assert r.status_code == 400 and "refused these inputs at run time" in r.json()["error"], r.text
    finally:
        node.stop()


def test_node_survives_shape_operands_over_the_size_bound(tmp_path: Path) -> None:
    """An attacker's shape operand: dims whose product wraps int64 (2**32 x 2**32 was a small buffer
    written as a huge one, heap corruption that killed the node) and a fill over the run-time size
    bound get a 400 naming it; the node answers the next honest request."""
    from compiler.dynshape_ops import MAX_RUNTIME_ELEMENTS

    value = oh.make_tensor("v", TensorProto.FLOAT, [1], [1.5])
    fill = oh.make_node("ConstantOfShape", ["c"], ["y"], value=value)
    graph = oh.make_graph([fill], "dyn_fill", [oh.make_tensor_value_info("c", TensorProto.INT64, [2])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "fill.onnx")
    art = compile_model(tmp_path / "fill.onnx", target="x86_64", out_dir=tmp_path / "art", progress=False)
    node = _make_node(tmp_path / "node", "fill-node", art)
    side = int(MAX_RUNTIME_ELEMENTS**0.5) + 1
    try:
        with ServerThread(create_node_app(node)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            url = f"/v2/models/{node.model_name}/infer"
            def post(dims: list[int]) -> httpx.Response:
                return http.post(url, json={"inputs": [{"name": "c", "shape": [2], "datatype": "INT64",
                                                        "data": dims}]})

            for dims in ([2**32, 2**32], [side, side], [-1, 4]):
                r = post(dims)
                assert r.status_code == 400, r.text
                assert "refused these inputs at run time" in r.json()["error"]
            r = post([2, 3])
            assert r.status_code == 200, r.text
            out = r.json()["outputs"][0]
            assert (out["name"], out["shape"], out["data"]) == ("y", [2, 3], [1.5] * 6)
    finally:
        node.stop()


def test_node_serves_empty_inputs(tmp_path: Path) -> None:
    """A model compiled with an empty data input (compiler.empty: ReduceSum over a [2, 0, 4] input,
    its axes a model input): the metadata gives the zero dim, an empty tensor of that shape is
    answered (0 where the empty axis is reduced, an empty output where it is kept), and data of
    another shape is a 400."""
    graph = oh.make_graph([oh.make_node("ReduceSum", ["x", "axes"], ["y"])], "empty_reduce",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 0, 4]),
                           oh.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, None])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "empty.onnx")
    art = compile_model(tmp_path / "empty.onnx", target="x86_64", out_dir=tmp_path / "art", progress=False,
                        input_shapes={"x": [2, 0, 4], "axes": [1]})
    node = _make_node(tmp_path / "node", "empty-node", art)
    try:
        with ServerThread(create_node_app(node)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            meta = http.get(f"/v2/models/{node.model_name}").json()
            assert [i["shape"] for i in meta["inputs"]] == [[2, 0, 4], [1]]
            for axis, shape, data in ((1, [2, 1, 4], [0.0] * 8), (2, [2, 0, 1], [])):
                body = {"inputs": [{"name": "x", "shape": [2, 0, 4], "datatype": "FP32", "data": []},
                                   {"name": "axes", "shape": [1], "datatype": "INT64", "data": [axis]}]}
                r = http.post(f"/v2/models/{node.model_name}/infer", json=body)
                assert r.status_code == 200, r.text
                out = r.json()["outputs"][0]
                assert (out["shape"], out["data"]) == (shape, data)
            body["inputs"][0].update(shape=[2, 1, 4], data=[1.0] * 8)
            r = http.post(f"/v2/models/{node.model_name}/infer", json=body)
            assert r.status_code == 400 and "expected [2, 0, 4]" in r.json()["error"], r.text
    finally:
        node.stop()
