"""Run-time operands the compiler derives from model inputs (issue 29): shape operands computed in
the graph from a model input (compiler.dynshape_flow: CenterCropPad's expanded body), Range and
OneHot with run-time scalars, CumSum with a run-time axis, a Loop whose run-time trip count its
static scan output fixes and a DFT whose run-time axis the declared output shape fixes (both
checked at run time). Answers are
compared with onnxruntime; values it refuses, or that the compiled shapes cannot take, stop
inference with an InputError."""

from __future__ import annotations

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
from compiler.dynshape_flow import mark_runtime_operands, marked
from compiler.errors import InputError

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
REFUSED = "refused these inputs at run time"
_vi = oh.make_tensor_value_info


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], opset: int = 18,
           inits: list[Any] | None = None) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _compile(model: onnx.ModelProto, tmp: Path) -> Any:
    path = tmp / "m.onnx"
    onnx.save(model, path)
    return load_artifact(compile_model(path, target="x86_64", out_dir=tmp / "art", progress=False))


def _same_as_ort(model: onnx.ModelProto, art: Any, feeds: dict[str, np.ndarray]) -> None:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = art.infer(feeds)
    for out, w in zip(art.outputs, want, strict=True):
        assert got[out.name].shape == w.shape, (feeds, got[out.name].shape, w.shape)
        np.testing.assert_allclose(got[out.name], w, rtol=1e-5, atol=1e-5, err_msg=str(feeds))


def _i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def _center_crop_pad() -> onnx.ModelProto:
    """CenterCropPad's function body on a [5, 6] input: pads and slice bounds computed from the
    model input ``shape``."""
    c = [oh.make_tensor("two", I64, [], [2])]
    n = oh.make_node
    nodes = [
        n("Shape", ["x"], ["xs"]), n("Max", ["xs", "shape"], ["big"]), n("Sub", ["big", "xs"], ["grow"]),
        n("Div", ["grow", "two"], ["left"]), n("Sub", ["grow", "left"], ["right"]),
        n("Concat", ["left", "right"], ["pads"], axis=0), n("Pad", ["x", "pads"], ["padded"]),
        n("Shape", ["padded"], ["ps"]), n("Sub", ["ps", "shape"], ["diff"]),
        n("Div", ["diff", "two"], ["lo"]),
        n("Add", ["lo", "shape"], ["hi"]), n("Slice", ["padded", "lo", "hi"], ["y"]),
    ]
    return _model(nodes, [_vi("x", F, [5, 6]), _vi("shape", I64, [2])],
                  [_vi("y", F, [None, None])], inits=c)


def test_marks_only_operands_computed_from_input_values() -> None:
    """Pad / Slice fed from the input ``shape`` and the Shape of the padded tensor are marked; the
    Shape of the input itself (static dims) is not."""
    model = _center_crop_pad()
    assert mark_runtime_operands(model)
    hits = {node.output[0] for node in model.graph.node if marked(node)}
    assert hits == {"padded", "ps", "y"}


def test_shape_operands_computed_from_a_model_input(tmp_path: Path) -> None:
    """One compile; crops, pads and both at once match onnxruntime; a negative size is refused."""
    model = _center_crop_pad()
    art = _compile(model, tmp_path)
    assert art.outputs[0].shape == (-1, -1)
    x = np.arange(30, dtype=np.float32).reshape(5, 6)
    for shape in [(3, 4), (7, 8), (2, 9), (5, 6)]:
        _same_as_ort(model, art, {"x": x, "shape": _i64(*shape)})
    with pytest.raises(InputError, match=REFUSED):
        art.infer({"x": x, "shape": _i64(-3, 4)})


def test_range_and_onehot_with_run_time_scalars(tmp_path: Path) -> None:
    """Range (int64 start / limit / delta) and OneHot (float depth, negative and out-of-range
    indices) match onnxruntime on several values; a zero delta and a zero depth are refused."""
    n = oh.make_node
    model = _model(
        [n("Range", ["start", "limit", "delta"], ["r"]),
         n("OneHot", ["idx", "depth", "values"], ["h"], axis=0)],
        [_vi(k, I64, []) for k in ("start", "limit", "delta")]
        + [_vi("idx", I64, [4]), _vi("depth", F, []),
           _vi("values", F, [2])],
        [_vi("r", I64, [None]), _vi("h", F, [None, 4])],
    )
    art = _compile(model, tmp_path)
    idx, values = _i64(0, 3, -2, 7), np.array([0.5, 2.0], np.float32)
    for start, limit, delta, depth in [(0, 5, 1, 4.0), (10, -3, -4, 6.0), (2, 3, 5, 1.0), (4, 4, 1, 9.0)]:
        feeds = {"start": np.array(start), "limit": np.array(limit), "delta": np.array(delta), "idx": idx,
                 "depth": np.array(depth, np.float32), "values": values}
        _same_as_ort(model, art, feeds)
    bad = {"start": np.array(0), "limit": np.array(3), "delta": np.array(0), "idx": idx,
           "depth": np.array(4.0, np.float32), "values": values}
    with pytest.raises(InputError, match=REFUSED):
        art.infer(bad)
    with pytest.raises(InputError, match=REFUSED):
        art.infer({**bad, "delta": np.array(1), "depth": np.array(0.0, np.float32)})
    # lengths past the run-time size bound, one whose limit - start wraps int64 (it gave an empty
    # answer), and a depth of 2**40 columns: refused, never allocated
    for start, limit, delta, depth in [(-(2**63), 2**63 - 1, 1, 4.0), (2**63 - 1, -(2**63), -1, 4.0),
                                       (0, 2**62, 1, 4.0), (0, 3, 1, 2.0**40)]:
        with pytest.raises(InputError, match=REFUSED):
            art.infer({**bad, "start": np.array(start), "limit": np.array(limit), "delta": np.array(delta),
                       "depth": np.array(depth, np.float32)})


def test_loop_trip_count_fixed_by_its_scan_output(tmp_path: Path) -> None:
    """A Loop whose trip count and condition are model inputs, its scan output declared [3, 1]:
    unrolled 3 times; any other trip count, or a false condition, is refused at run time."""
    n = oh.make_node
    body = oh.make_graph(
        [n("Identity", ["c_in"], ["c_out"]), n("Cast", ["i"], ["fi"], to=F),
         n("Add", ["y_in", "fi"], ["y_out"]),
         n("Identity", ["y_out"], ["scan"])],
        "body",
        [_vi("i", I64, []), _vi("c_in", B, []),
         _vi("y_in", F, [1])],
        [_vi("c_out", B, []), _vi("y_out", F, [1]),
         _vi("scan", F, [1])],
    )
    model = _model([n("Loop", ["trip", "cond", "y"], ["res", "rows"], body=body)],
                   [_vi("trip", I64, []), _vi("cond", B, []),
                    _vi("y", F, [1])],
                   [_vi("res", F, [1]), _vi("rows", F, [3, 1])], opset=13)
    art = _compile(model, tmp_path)
    feeds = {"trip": np.array(3), "cond": np.array(True), "y": np.array([0.5], np.float32)}
    _same_as_ort(model, art, feeds)
    for wrong in ({"trip": np.array(4)}, {"cond": np.array(False)}):
        with pytest.raises(InputError, match=REFUSED):
            art.infer({**feeds, **wrong})


def test_dft_axis_fixed_by_the_declared_output(tmp_path: Path) -> None:
    """An inverse one-sided DFT (opset 20) with a run-time axis: of the axes 1 and 2, only 1 gives
    the declared [1, 6, 4, 1]; 1 and -3 (the same axis) match onnxruntime, 2 is refused."""
    model = _model([oh.make_node("DFT", ["x", "", "axis"], ["y"], inverse=1, onesided=1)],
                   [_vi("x", F, [1, 4, 4, 2]), _vi("axis", I64, [])],
                   [_vi("y", F, [1, 6, 4, 1])], opset=20)
    art = _compile(model, tmp_path)
    x = np.random.default_rng(0).standard_normal((1, 4, 4, 2)).astype(np.float32)
    for axis in (1, -3):
        _same_as_ort(model, art, {"x": x, "axis": np.array(axis)})
    with pytest.raises(InputError, match=REFUSED):
        art.infer({"x": x, "axis": np.array(2)})


def test_cumsum_axis_given_at_run_time(tmp_path: Path) -> None:
    """CumSum (exclusive, reverse) with its axis a model input: every axis, negative ones too,
    matches onnxruntime; an axis out of range is refused at run time."""
    model = _model([oh.make_node("CumSum", ["x", "axis"], ["y"], exclusive=1, reverse=1)],
                   [_vi("x", F, [3, 4]), _vi("axis", I64, [])], [_vi("y", F, [3, 4])], opset=14)
    art = _compile(model, tmp_path)
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    for axis in (0, 1, -1, -2):
        _same_as_ort(model, art, {"x": x, "axis": np.array(axis)})
    with pytest.raises(InputError, match=REFUSED):
        art.infer({"x": x, "axis": np.array(2)})


@pytest.mark.parametrize("const_pads", [False, True], ids=["run-time-pads", "constant-pads"])
def test_pad_axes_given_at_run_time(tmp_path: Path, const_pads: bool) -> None:
    """Pad (constant mode) with its axes a model input, the pads too or a constant: several axes
    (negative ones too) match onnxruntime; a repeated axis is refused at run time."""
    inits = [oh.make_tensor("pads", I64, [4], [1, 0, 2, 3])] if const_pads else []
    inputs = [_vi("x", F, [2, 3, 4]), _vi("axes", I64, [2])] + ([] if const_pads else [_vi("pads", I64, [4])])
    model = _model([oh.make_node("Pad", ["x", "pads", "", "axes"], ["y"], mode="constant")], inputs,
                   [_vi("y", F, [None, None, None])], inits=inits)
    art = _compile(model, tmp_path)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    extra = {} if const_pads else {"pads": _i64(1, -1, 2, 0)}
    for axes in [(0, 2), (-1, 1), (2, 0)]:
        _same_as_ort(model, art, {"x": x, "axes": _i64(*axes), **extra})
    with pytest.raises(InputError, match=REFUSED):
        art.infer({"x": x, "axes": _i64(1, -2), **extra})
