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
