"""`fractal compile --shape`: fixing dynamic input dims of a real exported model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler.artifact import load_artifact
from tests.compiler.test_prepare import _reshape_model


def test_compile_with_shape_prints_steps_and_records_shapes(run_cli: Callable, tmp_path: Path) -> None:
    path = tmp_path / "dyn.onnx"
    onnx.save(_reshape_model(), path)
    refused = run_cli("compile", path, "--target", "x86_64", "--out", tmp_path / "a0")
    assert refused.code != 0 and "--shape x=" in refused.error_line
    res = run_cli("compile", path, "--target", "x86_64", "--out", tmp_path / "a", "--shape", "x=?,2,3,4")
    assert res.code == 0, res.err
    assert "prepared the graph: apply_shapes, fold_constants" in res.err
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["compiled_shapes"] == {"x": [1, 2, 3, 4]}
    assert manifest["prepared_steps"] == ["apply_shapes", "fold_constants"]
    art = load_artifact(tmp_path / "a")
    x = np.random.default_rng(0).standard_normal((3, 2, 3, 4)).astype(np.float32)
    out = art.infer({"x": x})["y"]
    np.testing.assert_allclose(out, x.reshape(3, 24) @ np.ones((24, 5), np.float32), rtol=1e-5)


@pytest.mark.parametrize(("shape", "needle"), [("x=1,2", "gives 2 dimensions"),
                                               ("nope=1,2,3,4", "not an input"),
                                               ("x=1,2,a,4", "bad dimension"), ("x", "bad --shape")])
def test_bad_shape_is_one_line(run_cli: Callable, tmp_path: Path, shape: str, needle: str) -> None:
    path = tmp_path / "dyn.onnx"
    onnx.save(_reshape_model(), path)
    res = run_cli("compile", path, "--target", "x86_64", "--out", tmp_path / "a", "--shape", shape)
    assert res.code != 0
    assert needle in res.error_line


def test_bench_compile_user_model(run_cli: Callable, tmp_path: Path) -> None:
    path = tmp_path / "dyn.onnx"
    onnx.save(_reshape_model(), path)
    res = run_cli("bench", "compile", "--model", path, "--shape", "x=?,2,3,4", "--trials", "0",
                  "--seconds", "0.05", "--json")
    assert res.code == 0, res.err
    row = json.loads(res.out)
    assert row["inputs"] == {"x": [1, 2, 3, 4]}
    assert row["onnxruntime"]["median_us"] > 0 and row["tvm_untuned"]["median_us"] > 0
    assert row["tvm_untuned_max_abs_err"] < 1e-4
    assert "tvm_tuned" not in row


def test_node_metadata_reports_the_compiled_shapes(run_cli: Callable, tmp_path: Path) -> None:
    """`--shape` fixed the dims: a node serving the artifact says so in its OIP model metadata
    (batch as -1) and answers a request of that shape."""
    from fastapi.testclient import TestClient

    from api.node_app import create_node_app
    from edgenode.config import load_config
    from edgenode.node import EdgeNode
    from tests.fixtures_node import write_node_toml

    path = tmp_path / "dyn.onnx"
    onnx.save(_reshape_model(), path)
    res = run_cli("compile", path, "--target", "x86_64", "--out", tmp_path / "a", "--shape", "x=?,2,3,4")
    assert res.code == 0, res.err
    cfg = write_node_toml(tmp_path / "NODE.toml", {"node_id": "shape-node", "artifact": str(tmp_path / "a"),
                                                   "port": 0, "data_dir": str(tmp_path / "data")})
    node = EdgeNode(load_config(cfg))
    node.start()
    try:
        with TestClient(create_node_app(node)) as client:
            meta = client.get(f"/v2/models/{node.model_name}").json()
            assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 2, 3, 4]}]
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2, 3, 4], "data": [1.0] * 48}]}
            r = client.post(f"/v2/models/{node.model_name}/infer", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["data"] == [24.0] * 10
            wrong = dict(body, inputs=[dict(body["inputs"][0], shape=[2, 4, 3, 2])])
            r = client.post(f"/v2/models/{node.model_name}/infer", json=wrong)
            assert r.status_code == 400 and "has shape [2, 4, 3, 2]" in r.json()["error"], r.text
    finally:
        node.stop()
