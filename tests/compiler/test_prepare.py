"""compiler.prepare: each preparation step on its own (IR, opset, shapes, folding)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from compiler.errors import ModelError
from compiler.prepare import apply_shapes, fold_constants, normalize_ir, parse_shape, prepare, upgrade_opset


def _reshape_model(ir: int = 8, opset: int = 13, dynamic: bool = True) -> onnx.ModelProto:
    """x[N, C, H, W] -> Shape -> Gather(0) -> Unsqueeze -> Concat([n, -1]) -> Reshape -> MatMul(w)."""
    dims: list[int | str] = ["N", 2, "H", 4] if dynamic else [1, 2, 3, 4]
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])
    inits = [nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array([-1], np.int64), "minus1"),
             nh.from_array(np.array([0], np.int64), "axes"),
             nh.from_array(np.ones((24, 5), np.float32), "w")]
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "zero"], ["n"]),
             oh.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
             oh.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
             oh.make_node("Reshape", ["x", "target"], ["flat"]), oh.make_node("MatMul", ["flat", "w"], ["y"])]
    m = oh.make_model(oh.make_graph(nodes, "g", [x], [y], inits), opset_imports=[oh.make_opsetid("", opset)])
    m.ir_version = ir
    return m


def test_normalize_ir_drops_initializers_from_inputs() -> None:
    m = _reshape_model(ir=3)
    m.graph.input.append(oh.make_tensor_value_info("w", TensorProto.FLOAT, [24, 5]))
    assert normalize_ir(m) is True
    assert [i.name for i in m.graph.input] == ["x"] and m.ir_version >= 4
    assert normalize_ir(m) is False


def test_normalize_ir_leaves_a_modern_model_alone() -> None:
    assert normalize_ir(_reshape_model()) is False


def test_upgrade_opset() -> None:
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    m = oh.make_model(oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                      opset_imports=[oh.make_opsetid("", 6)])
    m.ir_version = 3
    assert upgrade_opset(m) is True
    assert m.opset_import[0].version == 13
    assert upgrade_opset(m) is False


def test_apply_shapes_and_batch() -> None:
    m = _reshape_model()
    assert apply_shapes(m, {"x": [-1, 2, 3, 4]}, batch=1) is True
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [1, 2, 3, 4]
    assert apply_shapes(m, {"x": [1, 2, 3, 4]}) is False


@pytest.mark.parametrize(("shapes", "match"), [({"nope": [1, 2, 3, 4]}, "not an input"),
                                               ({"x": [1, 2, 3]}, "gives 3 dimensions"),
                                               ({"x": [1, 5, 3, 4]}, "fixed to 2"),
                                               ({"x": [-2, 2, 3, 4]}, "negative")])
def test_apply_shapes_refuses(shapes: dict[str, list[int]], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        apply_shapes(_reshape_model(), shapes)


@pytest.mark.parametrize(("text", "want"), [("x=1,3,224,224", ("x", [1, 3, 224, 224])),
                                           ("a=b=?,7", ("a=b", [-1, 7])), ("x=0,5", ("x", [0, 5]))])
def test_parse_shape(text: str, want: tuple[str, list[int]]) -> None:
    assert parse_shape(text) == want


@pytest.mark.parametrize("text", ["x", "x=", "=1,2", "x=1,,2", "x=-2,2", "x=a", "x=1e9"])
def test_parse_shape_refuses(text: str) -> None:
    with pytest.raises(ModelError, match="bad"):
        parse_shape(text)


def test_fold_collapses_shape_chain_and_keeps_numbers() -> None:
    m = _reshape_model()
    apply_shapes(m, {"x": [1, 2, 3, 4]})
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)}
    want = ort.InferenceSession(m.SerializeToString()).run(None, feeds)[0]
    assert fold_constants(m) is True
    assert [n.op_type for n in m.graph.node] == ["Reshape", "MatMul"]
    got = ort.InferenceSession(m.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert fold_constants(m) is False


def test_fold_leaves_dynamic_shapes() -> None:
    m = _reshape_model()
    assert fold_constants(m) is False


def test_prepare_reports_steps_and_leaves_input_alone() -> None:
    m = _reshape_model(ir=3)
    before = m.SerializeToString()
    out, steps = prepare(m, shapes={"x": [-1, 2, 3, 4]}, batch=1)
    assert steps == ["normalize_ir", "apply_shapes", "fold_constants"]
    assert m.SerializeToString() == before
    assert prepare(out)[1] == []


def test_prepared_reshape_model_imports_into_tvm() -> None:
    from compiler.importer import import_model

    imported = import_model(_reshape_model(), shapes={"x": [-1, 2, 3, 4]})
    assert "fold_constants" in imported.prepared_steps
    assert [tuple(s.shape) for s in imported.inputs] == [(1, 2, 3, 4)]
    assert [tuple(s.shape) for s in imported.outputs] == [(1, 5)]
