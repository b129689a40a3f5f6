"""compiler.prepare: LSTM / GRU / RNN unrolled match onnxruntime (layout=1: onnx reference evaluator)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh
from onnx.reference import ReferenceEvaluator

from compiler.errors import ModelError
from compiler.prepare import decompose_rnn, prepare

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def rnn_model(op: str, *, direction: str = "forward", layout: int = 0, init: bool = True, peep: bool = False,
              seq: int = 5, batch: int = 2, size: int = 3, hidden: int = 4, seq_lens: bool = False,
              weights_as_inputs: bool = False, **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    dirs = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    inits = [nh.from_array((rng.standard_normal((dirs, g * hidden, size)) * .5).astype(np.float32), "W"),
             nh.from_array((rng.standard_normal((dirs, g * hidden, hidden)) * .5).astype(np.float32), "R"),
             nh.from_array((rng.standard_normal((dirs, 2 * g * hidden)) * .5).astype(np.float32), "B")]
    ins = ["X", "W", "R", "B", "", ""]
    xdims = [seq, batch, size] if layout == 0 else [batch, seq, size]
    inputs = [oh.make_tensor_value_info("X", TensorProto.FLOAT, xdims)]
    if seq_lens:
        ins[4] = "lens"
        inits.append(nh.from_array(np.full(batch, seq, np.int32), "lens"))
    state = [dirs, batch, hidden] if layout == 0 else [batch, dirs, hidden]
    if init:
        ins[5] = "h0"
        inputs.append(oh.make_tensor_value_info("h0", TensorProto.FLOAT, state))
        if op == "LSTM":
            ins.append("c0")
            inputs.append(oh.make_tensor_value_info("c0", TensorProto.FLOAT, state))
    if peep:
        ins += [""] * (7 - len(ins)) + ["P"]
        inits.append(nh.from_array(rng.standard_normal((dirs, 3 * hidden)).astype(np.float32), "P"))
    given: dict[str, np.ndarray] = {}
    if weights_as_inputs:  # W, R, B (P) fed at run time (ONNX's own RNN test cases do this)
        given = {t.name: nh.to_array(t) for t in inits if t.name in ("W", "R", "B", "P")}
        inits = [t for t in inits if t.name not in given]
        inputs += [oh.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in given.items()]
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = oh.make_node(op, ins, outs, hidden_size=hidden, direction=direction, **attrs,
                        **({"layout": 1} if layout else {}))
    graph = oh.make_graph([node], "rnn", inputs, [oh.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                   for o in outs], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 14)])
    model.ir_version = 8
    feeds = {i.name: given[i.name] if i.name in given else
             rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in inputs}
    return model, feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], reference: bool = False) -> list[np.ndarray]:
    if reference:
        return [np.asarray(x) for x in ReferenceEvaluator(model).run(None, feeds)]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


DIRECTIONS = ("forward", "reverse", "bidirectional")
CASES = [(op, {"direction": d, "layout": lay}) for op in GATES for d in DIRECTIONS for lay in (0, 1)]
CASES += [(op, {"init": False}) for op in GATES]
CASES += [(op, {"clip": 0.7, "direction": "bidirectional"}) for op in GATES]
CASES += [(op, {"seq_lens": True}) for op in GATES]
CASES += [(op, {"weights_as_inputs": True, "direction": "bidirectional"}) for op in GATES]
CASES += [("LSTM", {"weights_as_inputs": True, "peep": True}),
          ("GRU", {"weights_as_inputs": True, "linear_before_reset": 1})]
CASES += [
    ("LSTM", {"peep": True, "direction": "bidirectional"}),
    ("LSTM", {"input_forget": 1}),
    ("GRU", {"linear_before_reset": 1, "direction": "bidirectional"}),
    ("LSTM", {"activations": ["HardSigmoid", "LeakyRelu", "Softsign"], "activation_alpha": [0.3, 0.1],
              "activation_beta": [0.4]}),
    ("GRU", {"activations": ["Sigmoid", "Elu", "Relu", "Tanh"], "activation_alpha": [0.5],
             "direction": "bidirectional"}),
    ("RNN", {"activations": ["Relu"]}),
    ("RNN", {"activations": ["Affine"], "activation_alpha": [0.5], "activation_beta": [0.2]}),
    ("RNN", {"activations": ["ScaledTanh"], "activation_alpha": [0.5], "activation_beta": [0.2]}),
    ("RNN", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.2]}),
    ("RNN", {"activations": ["Softplus"]}),
]


@pytest.mark.parametrize(("op", "kw"), CASES, ids=[f"{op}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                                                   for op, kw in CASES])
def test_decomposition_matches_onnxruntime(op: str, kw: dict[str, Any]) -> None:
    model, feeds = rnn_model(op, **kw)
    reference = kw.get("layout") == 1  # onnxruntime refuses batch-first recurrent layouts
    want = _run(model, feeds, reference)
    prepared, steps = prepare(model)
    assert "decompose_rnn" in steps
    assert not any(n.op_type in GATES for n in prepared.graph.node)
    got = _run(prepared, feeds, reference=False)
    assert [w.shape for w in want] == [g.shape for g in got]
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_no_recurrent_op_is_no_change() -> None:
    model, _ = rnn_model("GRU")
    model.graph.node[0].op_type = "Relu"
    assert decompose_rnn(model) is False


@pytest.mark.parametrize(("op", "direction"),
                         [("LSTM", "bidirectional"), ("GRU", "reverse"), ("RNN", "forward")])
@pytest.mark.parametrize("at_run_time", [False, True], ids=["constant-lens", "input-lens"])
def test_partial_sequence_lens_match_onnxruntime(op: str, direction: str, at_run_time: bool) -> None:
    """Samples shorter than the sequence: past its length a sample's state stays and its output is 0."""
    model, feeds = rnn_model(op, seq_lens=True, direction=direction, peep=op == "LSTM")
    lens = next(t for t in model.graph.initializer if t.name == "lens")
    short = np.array([5, 3], np.int32)
    lens.CopyFrom(nh.from_array(short, "lens"))
    if at_run_time:
        model.graph.initializer.remove(lens)
        model.graph.input.append(oh.make_tensor_value_info("lens", TensorProto.INT32, [2]))
        feeds["lens"] = short
    want = _run(model, feeds)
    prepared, steps = prepare(model)
    assert "decompose_rnn" in steps
    for w, g in zip(want, _run(prepared, feeds), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_dynamic_sequence_length_refused_with_shape_hint() -> None:
    model, _ = rnn_model("GRU")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    with pytest.raises(ModelError, match="no fixed shape") as err:
        prepare(model)
    assert "--shape" in (err.value.hint or "")
    fixed, steps = prepare(model, shapes={"X": [5, 2, 3]})
    assert steps == ["apply_shapes", "decompose_rnn"]


def test_lstm_compiles_with_tvm_and_matches() -> None:
    from compiler.importer import import_model

    model, feeds = rnn_model("LSTM", direction="bidirectional", init=False, seq=4, batch=1)
    want = _run(model, feeds)
    imported = import_model(model)
    assert "decompose_rnn" in imported.prepared_steps
    import tvm
    from tvm import relax

    ex = relax.build(imported.mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(feeds["X"]), *[tvm.runtime.tensor(p) for p in imported.params])
    got = [o.numpy() for o in out]
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
