"""compiler.empty: a data input given a zero dim. What nodes compute from it is answered at compile
time (the reduction's identity, MatMul's zeros, an empty output), a run-time-axes Reduce answers in
the shape its axes ask for (an empty output where a zero dim is kept) and matches onnxruntime, and a
node whose answer from no elements the project does not know is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from compiler.artifact import load_artifact
from compiler.build import compile_model
from compiler.empty import EMPTY_DIMS_ATTR
from compiler.errors import InputError, ModelError
from compiler.prepare import prepare

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes: list[Any], inputs: list[Any], outputs: dict[str, int], inits: list[Any] | None = None,
           opset: int = 18) -> onnx.ModelProto:
    """``outputs``: name -> rank (dims left unknown)."""
    outs = [oh.make_tensor_value_info(o, F, [None] * r) for o, r in outputs.items()]
    graph = oh.make_graph(nodes, "empty", inputs, outs, inits or [])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))


def test_reads_with_known_operands_become_constants() -> None:
    """Static axes / a constant operand: ONNX's reference over no elements, checked against
    onnxruntime on the original model."""
    x = oh.make_tensor_value_info("x", F, [2, 0, 4])
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [oh.make_node("ReduceMax", ["x", "axes"], ["mx"]),
             oh.make_node("ReduceProd", ["x", "axes"], ["pr"]),
             oh.make_node("ReduceLogSumExp", ["x", "axes"], ["lse"], keepdims=0),
             oh.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             oh.make_node("MatMul", ["t", "z"], ["mm"]), oh.make_node("Relu", ["x"], ["r"])]
    z = numpy_helper.from_array(np.ones((0, 5), np.float32), "z")
    model = _model(nodes, [x], {"mx": 3, "pr": 3, "lse": 2, "mm": 3, "r": 3}, [axes, z])
    prepared, steps = prepare(model, shapes={"x": [2, 0, 4]})
    assert "fold_empty" in steps
    # the empty output's Relu stays (the artifact answers it: compiler.importer); nothing else reads x
    assert [n.op_type for n in prepared.graph.node if "x" in n.input] == ["Relu"]
    feeds = {"x": np.empty((2, 0, 4), np.float32)}
    want = _ort(model, feeds)
    got = _ort(prepared, feeds)
    assert want[0].shape == (2, 1, 4) and np.all(want[0] == -np.inf)
    for g, w_ in zip(got, want, strict=True):
        assert g.shape == w_.shape and g.dtype == w_.dtype
        np.testing.assert_array_equal(g, w_)


@pytest.mark.parametrize(("op", "operand"), [
    ("ReduceMean", 1),  # 0 / 0: no answer taken
    ("Pad", 6),  # elements out of none, their number decided at run time
])
def test_unknown_answers_are_refused_by_name(op: str, operand: int) -> None:
    inputs = [oh.make_tensor_value_info("x", F, [2, 0, 4]), oh.make_tensor_value_info("v", I64, [operand])]
    model = _model([oh.make_node(op, ["x", "v"], ["y"])], inputs, {"y": 3})
    with pytest.raises(ModelError, match=f"{op} at node .* reads the empty tensor 'x'"):
        prepare(model, shapes={"x": [2, 0, 4], "v": [operand]})


def test_run_time_axes_reduce(tmp_path: Path) -> None:
    """ReduceMax / ReduceSum with their axes a model input over a [2, 0, 4] input: the identity in
    the shape the axes ask for (a kept zero dim: empty), as onnxruntime; a bad axis is an InputError."""
    nodes = [oh.make_node("ReduceMax", ["x", "axes"], ["mx"]),
             oh.make_node("ReduceSum", ["x", "axes"], ["sm"], keepdims=0)]
    model = _model(nodes, [oh.make_tensor_value_info("x", F, [2, 0, 4]),
                           oh.make_tensor_value_info("axes", I64, [1])], {"mx": 3, "sm": 2})
    prepared, _ = prepare(model, shapes={"x": [2, 0, 4], "axes": [1]})
    marked = [n for n in prepared.graph.node if any(a.name == EMPTY_DIMS_ATTR for a in n.attribute)]
    assert len(marked) == 2
    onnx.save(model, tmp_path / "m.onnx")
    art = load_artifact(compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "art",
                                      input_shapes={"x": [2, 0, 4], "axes": [1]}, progress=False))
    assert [tuple(s.shape) for s in art.inputs] == [(2, 0, 4), (1,)]
    x = np.empty((2, 0, 4), np.float32)
    shapes = set()
    for axis in (1, -2, 2, 0):
        feeds = {"x": x, "axes": np.array([axis], np.int64)}
        got = art.infer(feeds)
        for name, want in zip(("mx", "sm"), _ort(model, feeds), strict=True):
            assert got[name].shape == want.shape and got[name].dtype == want.dtype, (axis, name)
            np.testing.assert_array_equal(got[name], want)
            shapes.add(want.shape)
    assert {(2, 1, 4), (2, 4), (2, 0, 1), (2, 0), (1, 0, 4), (0, 4)} <= shapes
    with pytest.raises(InputError, match="refused these inputs at run time"):
        art.infer({"x": x, "axes": np.array([3], np.int64)})
    with pytest.raises(InputError, match="expected"):
        art.infer({"x": np.zeros((2, 1, 4), np.float32), "axes": np.array([1], np.int64)})


@pytest.mark.parametrize("target", ["x86_64", "x86_64-c"])
def test_empty_outputs_beside_computed_ones(tmp_path: Path, target: str) -> None:
    """An output left empty (Relu of the empty input, its dims not declared) beside a constant answer
    and an output computed from another input: each in its place, on the VM and the C backend."""
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [oh.make_node("ReduceSum", ["x", "axes"], ["y"]), oh.make_node("Relu", ["x"], ["z"]),
             oh.make_node("Relu", ["w"], ["v"])]
    inputs = [oh.make_tensor_value_info("x", F, [2, 0, 4]), oh.make_tensor_value_info("w", F, [3])]
    model = _model(nodes, inputs, {"y": 3, "z": 3, "v": 1}, [axes])
    onnx.save(model, tmp_path / "m.onnx")
    art = load_artifact(compile_model(tmp_path / "m.onnx", target=target, out_dir=tmp_path / "art",
                                      input_shapes={"x": [2, 0, 4], "w": [3]}, progress=False))
    feeds = {"x": np.empty((2, 0, 4), np.float32), "w": np.array([-1, 0, 2], np.float32)}
    got = art.infer(feeds)
    for name, want in zip(("y", "z", "v"), _ort(model, feeds), strict=True):
        assert got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want)
