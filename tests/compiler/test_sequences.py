"""Sequences inside a graph (compiler.sequences, issue 29): with lengths known at compile time they
become lists of tensors in the preparation stage, and every sequence operator agrees with
onnxruntime (negative positions, Split by sizes / by a chunk size / per element without keepdims,
ConcatFromSequence with and without new_axis, SequenceMap with a tensor operand and two outputs);
a sequence model input or output, or a position known only at run time, is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from compiler.artifact import load_artifact
from compiler.build import compile_model
from compiler.errors import CompilerError
from compiler.prepare import prepare

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes: list[Any], ins: list[Any], outs: dict[str, tuple[int, int]],
           inits: list[Any]) -> onnx.ModelProto:
    outputs = [oh.make_tensor_value_info(k, t, [None] * r) for k, (t, r) in outs.items()]
    graph = oh.make_graph(nodes, "seq", ins, outputs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _body() -> onnx.GraphProto:
    """SequenceMap's body: (element, t) -> (element * 2 + t, Shape(element))."""
    return oh.make_graph(
        [oh.make_node("Add", ["e", "e"], ["twice"]), oh.make_node("Add", ["twice", "t"], ["out"]),
         oh.make_node("Shape", ["e"], ["s"])], "body",
        [oh.make_tensor_value_info("e", F, [None, 4]), oh.make_tensor_value_info("t", F, [4])],
        [oh.make_tensor_value_info("out", F, [None, 4]), oh.make_tensor_value_info("s", I64, [2])])


def test_sequence_operators_match_onnxruntime(tmp_path: Path) -> None:
    c = {"sp": [2, 4], "one": 1, "neg": -1, "zero": 0, "three": 3, "chunk": 3}
    inits = [nh.from_array(np.array(v, np.int64), k) for k, v in c.items()]
    nodes = [oh.make_node("SplitToSequence", ["x", "sp"], ["seq"], axis=0),
             oh.make_node("SequenceAt", ["seq", "one"], ["a"]),
             oh.make_node("SequenceAt", ["seq", "neg"], ["a_neg"]),
             oh.make_node("SequenceLength", ["seq"], ["n"]),
             oh.make_node("ConcatFromSequence", ["seq"], ["back"], axis=0),
             oh.make_node("SplitToSequence", ["x"], ["rows"], axis=0, keepdims=0),
             oh.make_node("ConcatFromSequence", ["rows"], ["stacked"], axis=1, new_axis=1),
             oh.make_node("ConcatFromSequence", ["rows"], ["stacked_neg"], axis=-1, new_axis=1),
             oh.make_node("SplitToSequence", ["x"], ["cols"], axis=-1),
             oh.make_node("SequenceAt", ["cols", "three"], ["col3"]),
             oh.make_node("SequenceConstruct", ["y", "y"], ["pair"]),
             oh.make_node("SequenceInsert", ["pair", "x2"], ["triple"]),
             oh.make_node("SequenceErase", ["triple", "zero"], ["pair2"]),
             oh.make_node("ConcatFromSequence", ["pair2"], ["pc"], axis=0),
             oh.make_node("SequenceInsert", ["pair", "x2", "zero"], ["tri0"]),
             oh.make_node("SequenceAt", ["tri0", "zero"], ["t0"]),
             oh.make_node("SequenceErase", ["tri0"], ["erased"]),
             oh.make_node("SequenceLength", ["erased"], ["n_erased"]),
             oh.make_node("SplitToSequence", ["x", "chunk"], ["chunks"], axis=0),
             oh.make_node("SequenceAt", ["chunks", "one"], ["chunk1"]),
             oh.make_node("SequenceEmpty", [], ["empty"]),
             oh.make_node("SequenceInsert", ["empty", "y"], ["single"]),
             oh.make_node("ConcatFromSequence", ["single"], ["single_cat"], axis=0, new_axis=1),
             oh.make_node("SequenceMap", ["seq", "t"], ["mapped", "shapes"], body=_body()),
             oh.make_node("ConcatFromSequence", ["mapped"], ["mapped_cat"], axis=0),
             oh.make_node("ConcatFromSequence", ["shapes"], ["shapes_cat"], axis=0, new_axis=1)]
    outs = dict(a=(F, 2), a_neg=(F, 2), n=(I64, 0), back=(F, 2), stacked=(F, 2), stacked_neg=(F, 2),
                col3=(F, 2), pc=(F, 2), t0=(F, 2), n_erased=(I64, 0), chunk1=(F, 2), single_cat=(F, 3),
                mapped_cat=(F, 2), shapes_cat=(I64, 2))
    ins = [oh.make_tensor_value_info("x", F, [6, 4]), oh.make_tensor_value_info("y", F, [2, 4]),
           oh.make_tensor_value_info("x2", F, [3, 4]), oh.make_tensor_value_info("t", F, [4])]
    model = _model(nodes, ins, outs, inits)
    prepared, steps = prepare(model)
    assert "lower_sequences" in steps
    assert not {n.op_type for n in prepared.graph.node} & {"SequenceMap", "SplitToSequence", "SequenceAt"}
    onnx.save(model, tmp_path / "m.onnx")
    art = load_artifact(compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "art",
                                      progress=False))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    for _ in range(2):
        feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
                 .astype(np.float32) for i in ins}
        want = dict(zip(outs, sess.run(list(outs), feeds), strict=True))
        got = art.infer(feeds)
        for name, w in want.items():
            assert got[name].shape == w.shape, name
            np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=1e-6, err_msg=name)


def _seq_info(name: str) -> Any:
    return oh.make_value_info(name, oh.make_sequence_type_proto(oh.make_tensor_type_proto(F, [1, 3])))


@pytest.mark.parametrize("case", ["output", "input", "runtime_position"])
def test_sequences_that_cannot_be_lowered_are_refused_in_one_line(tmp_path: Path, case: str) -> None:
    x = oh.make_tensor_value_info("x", F, [4, 3])
    if case == "output":  # a sequence model output: the Open Inference Protocol has no sequences
        graph = oh.make_graph([oh.make_node("SplitToSequence", ["x"], ["s"])], "g", [x],
                              [_seq_info("s")])
        match = r"output 's' is a sequence\(tensor\), not a tensor"
    elif case == "input":
        graph = oh.make_graph([oh.make_node("ConcatFromSequence", ["s"], ["y"], axis=0)], "g",
                              [_seq_info("s")], [oh.make_tensor_value_info("y", F, [None, 3])])
        match = "input 's' is of type sequence"
    else:
        graph = oh.make_graph([oh.make_node("SplitToSequence", ["x"], ["s"]),
                               oh.make_node("SequenceAt", ["s", "p"], ["y"])], "g",
                              [x, oh.make_tensor_value_info("p", I64, [])],
                              [oh.make_tensor_value_info("y", F, [None, 3])])
        match = "SequenceAt"
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(CompilerError, match=match) as err:
        compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "art", progress=False)
    assert "\n" not in str(err.value.args[0])
