"""compiler.dynshape: operators whose shape operand is a model input (output shapes decided at run
time, issue 29) compile, run and match onnxruntime on several operand values, including values that
change which dims survive; values onnxruntime rejects stop inference with an InputError (never a
silently different answer); what stays unsupported is refused at compile time in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh

from compiler.artifact import load_artifact
from compiler.build import compile_model
from compiler.errors import CompilerError, InputError, TargetError

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(op: str, data_shape: list[int], operand: str, operand_len: int, out_rank: int, opset: int = 18,
           **attrs: Any) -> onnx.ModelProto:
    node = oh.make_node(op, ["x", operand], ["y"], **attrs)
    graph = oh.make_graph([node], f"dyn_{op}", [oh.make_tensor_value_info("x", F, data_shape),
                                                oh.make_tensor_value_info(operand, I64, [operand_len])],
                          [oh.make_tensor_value_info("y", F, [None] * out_rank)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _compile(model: onnx.ModelProto, tmp: Path, target: str = "x86_64") -> Any:
    path = tmp / "m.onnx"
    onnx.save(model, path)
    return load_artifact(compile_model(path, target=target, out_dir=tmp / "art", progress=False))


def _check(model: onnx.ModelProto, art: Any, x: np.ndarray, operand: str,
           values: list[list[int]]) -> set[tuple[int, ...]]:
    """Each operand value: the artifact's answer equals onnxruntime's, or it is refused at run time
    where onnxruntime refuses it or answers in another rank than the declared one. Returns the
    output shapes seen."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    shapes = set()
    for v in values:
        feeds = {"x": x, operand: np.array(v, np.int64)}
        try:
            want = sess.run(None, feeds)[0]
        except Exception:
            want = None
        # onnxruntime reduces a duplicate axis once, into a rank other than the declared one
        if want is None or want.ndim != len(art.outputs[0].shape):
            with pytest.raises(InputError, match="refused these inputs at run time"):
                art.infer(feeds)
            continue
        got = art.infer(feeds)["y"]
        assert got.shape == want.shape, (v, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(v))
        shapes.add(got.shape)
    return shapes


@pytest.mark.parametrize("op,keepdims", [("ReduceSum", 0), ("ReduceLogSumExp", 1), ("ReduceL2", 0)])
def test_reduce_with_run_time_axes_matches_onnxruntime(tmp_path: Path, op: str, keepdims: int) -> None:
    """One compile, several axes values: which dims survive changes from call to call (and the
    output's dims are -1 in the manifest); a duplicate or out-of-range axis is refused at run time."""
    out_rank = 4 - 2 * (1 - keepdims)
    model = _model(op, [2, 3, 4, 5], "axes", 2, out_rank, keepdims=keepdims)
    art = _compile(model, tmp_path)
    assert not art.batched and art.outputs[0].shape == (-1,) * out_rank
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["outputs"][0]["shape"] == [-1] * out_rank
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    values = [[0, 2], [3, 1], [-1, 0], [1, -2], [2, 3], [1, 1], [0, 4], [-5, 1]]
    shapes = _check(model, art, x, "axes", values)
    assert len(shapes) == 5, shapes  # five different surviving sets of dims


def test_reduce_empty_axes_and_noop(tmp_path: Path) -> None:
    """An axes input of length 0 is known at compile time: reduce everything, or (noop_with_empty_axes)
    pass the data through."""
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    for noop, rank in ((0, 2), (1, 2)):
        model = _model("ReduceSum", [3, 4], "axes", 0, rank, keepdims=1, noop_with_empty_axes=noop)
        art = _compile(model, tmp_path / str(noop))
        _check(model, art, x, "axes", [[]])


def test_run_time_axes_refused_on_the_c_backend(tmp_path: Path) -> None:
    model = _model("ReduceSum", [2, 3], "axes", 1, 1, keepdims=0)
    with pytest.raises(TargetError, match=r"'x86_64-c' \(C backend\) cannot run a model whose output shapes"):
        _compile(model, tmp_path, target="x86_64-c")


def test_run_time_shape_operand_with_a_batch_is_refused(tmp_path: Path) -> None:
    """A shape operand is not a batch of samples: --batch/--train are refused in one line."""
    model = _model("ReduceSum", [2, 3], "axes", 1, 1, keepdims=0)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    from compiler.importer import import_model, load_onnx

    with pytest.raises(CompilerError, match="compiles for exactly its input shapes, not for batch 4"):
        import_model(load_onnx(path), batch=4)
