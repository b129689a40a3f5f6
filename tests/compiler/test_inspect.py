"""`fractal inspect`: a model's interface, opsets, operator histogram and unsupported operators."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from tests.compiler.conformance import data_root


def _model(path: Path) -> Path:
    x = oh.make_tensor_value_info("audio", TensorProto.FLOAT, ["T", "batch", 3])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, None)
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((1, 16, 3)).astype(np.float32), "W"),
             nh.from_array(rng.standard_normal((1, 16, 4)).astype(np.float32), "R")]
    nodes = [oh.make_node("LSTM", ["audio", "W", "R"], ["seq", "h"], hidden_size=4),
             oh.make_node("Relu", ["h"], ["r"]),
             oh.make_node("ImageDecoder", ["r"], ["y"])]
    m = oh.make_model(oh.make_graph(nodes, "g", [x], [y], inits), opset_imports=[oh.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def test_inspect_names_dynamic_dims_and_unsupported_ops(run_cli: Callable, tmp_path: Path) -> None:
    res = run_cli("inspect", _model(tmp_path / "m.onnx"))
    assert res.code == 0, res.err
    out = res.out
    assert "audio: float32 [T, batch, 3]" in out
    assert "opsets ai.onnx 14" in out
    assert "LSTM" in out and "decomposed before import: LSTM x1" in out
    assert "UNSUPPORTED by this compiler: ImageDecoder x1" in out
    assert "--shape audio=D,D,3" in out


def test_inspect_json(run_cli: Callable, tmp_path: Path) -> None:
    res = run_cli("inspect", _model(tmp_path / "m.onnx"), "--json")
    doc = json.loads(res.out)
    assert doc["ops"] == {"LSTM": 1, "Relu": 1, "ImageDecoder": 1}
    assert doc["unsupported"] == {"ImageDecoder": 1}
    assert doc["needs_shape"] == ["audio"]
    assert doc["params"] == 16 * 3 + 16 * 4


def test_inspect_real_model_zoo_file(run_cli: Callable) -> None:
    res = run_cli("inspect", data_root() / "light" / "light_resnet50.onnx")
    assert res.code == 0, res.err
    assert "gpu_0/data_0: float32 [1, 3, 224, 224]" in res.out
    assert "IR 3" in res.out and "all operators supported" in res.out


def test_inspect_unreadable_file_is_one_line(run_cli: Callable, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage\xff\xff" * 10)
    res = run_cli("inspect", bad)
    assert res.code != 0
    assert "bad.onnx" in res.error_line
    missing = run_cli("inspect", tmp_path / "nope.onnx")
    assert missing.code != 0 and "not found" in missing.error_line
