"""compiler.unroll: Loop and Scan with a compile-time iteration count are unrolled, an If on a constant
condition becomes its branch; the prepared model matches onnxruntime on the original one, and what
cannot be unrolled is refused in one line naming the operator and the reason."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from compiler.errors import ModelError
from compiler.prepare import prepare
from compiler.unroll import MAX_ITERATIONS

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _model(
    nodes: list[Any], inputs: list[Any], outputs: list[Any], opset: int = 17, inits: list[Any] | None = None
) -> onnx.ModelProto:
    model = oh.make_model(
        oh.make_graph(nodes, "loops", inputs, outputs, inits or []),
        opset_imports=[oh.make_opsetid("", opset)],
    )
    model.ir_version = 8
    return model


def _same_as_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[str]:
    onnx.checker.check_model(model)
    want = _run(model, feeds)
    prepared, steps = prepare(model)
    assert not any(n.op_type in ("Loop", "Scan", "If") for n in prepared.graph.node)
    got = _run(prepared, feeds)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    return steps


def _scan_body() -> onnx.GraphProto:
    """state' = state * 0.5 + x_t; scan output = state' - x_t."""
    return oh.make_graph(
        [
            oh.make_node("Mul", ["s", "half"], ["m"]),
            oh.make_node("Add", ["m", "x_t"], ["s2"]),
            oh.make_node("Sub", ["s2", "x_t"], ["y_t"]),
        ],
        "body",
        [oh.make_tensor_value_info("s", F, [3]), oh.make_tensor_value_info("x_t", F, [3])],
        [oh.make_tensor_value_info("s2", F, [3]), oh.make_tensor_value_info("y_t", F, [3])],
    )


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"scan_input_directions": [1]},
        {"scan_output_directions": [1]},
        {"scan_input_axes": [1], "scan_output_axes": [1]},
        {"scan_input_axes": [-1], "scan_output_axes": [-1]},
    ],
    ids=["forward", "input-reversed", "output-reversed", "axis-1", "negative-axes"],
)
def test_scan_matches_onnxruntime(attrs: dict[str, Any]) -> None:
    rng = np.random.default_rng(0)
    axis = attrs.get("scan_input_axes", [0])[0]
    xshape = [4, 3] if axis == 0 else [3, 4]
    half = nh.from_array(np.array(0.5, np.float32), "half")
    node = oh.make_node("Scan", ["s0", "x"], ["s_final", "ys"], num_scan_inputs=1, body=_scan_body(), **attrs)
    model = _model(
        [node],
        [oh.make_tensor_value_info("s0", F, [3]), oh.make_tensor_value_info("x", F, xshape)],
        [oh.make_tensor_value_info("s_final", F, [3]), oh.make_tensor_value_info("ys", F, xshape)],
        inits=[half],
    )
    feeds = {
        "s0": rng.standard_normal(3).astype(np.float32),
        "x": rng.standard_normal(xshape).astype(np.float32),
    }
    assert "unroll_loops" in _same_as_onnxruntime(model, feeds)


def test_opset8_batched_scan_matches_onnxruntime() -> None:
    """Opset 8's Scan carries a batch axis (and onnx's version converter drops it): unrolled first."""
    body = oh.make_graph(
        [oh.make_node("Add", ["s", "x_t"], ["s2"]), oh.make_node("Identity", ["s2"], ["y_t"])],
        "body",
        [oh.make_tensor_value_info("s", F, [2]), oh.make_tensor_value_info("x_t", F, [2])],
        [oh.make_tensor_value_info("s2", F, [2]), oh.make_tensor_value_info("y_t", F, [2])],
    )
    node = oh.make_node("Scan", ["", "s0", "x"], ["s_final", "ys"], num_scan_inputs=1, body=body)
    model = _model(
        [node],
        [oh.make_tensor_value_info("s0", F, [2, 2]), oh.make_tensor_value_info("x", F, [2, 3, 2])],
        [oh.make_tensor_value_info("s_final", F, [2, 2]), oh.make_tensor_value_info("ys", F, [2, 3, 2])],
        opset=8,
    )
    rng = np.random.default_rng(1)
    feeds = {
        "s0": rng.standard_normal((2, 2)).astype(np.float32),
        "x": rng.standard_normal((2, 3, 2)).astype(np.float32),
    }
    assert "unroll_scan8" in _same_as_onnxruntime(model, feeds)


def _loop_model(
    trip: str | None = "trip", cond_out: str = "cond_in", steps: int = 4, inner_if: bool = False,
    rows: int | None = -1,
) -> onnx.ModelProto:
    """acc' = acc + x[i] * i; scan output acc' (declared ``rows`` long: -1 for ``steps``, None for
    unknown); optionally an If on (i == 0) inside the body."""
    nodes = [
        oh.make_node("Gather", ["x", "i"], ["x_i"], axis=0),
        oh.make_node("Cast", ["i"], ["i_f"], to=F),
        oh.make_node("Mul", ["x_i", "i_f"], ["term"]),
        oh.make_node("Add", ["acc", "term"], ["acc2"]),
    ]
    if cond_out == "keep_going":  # a while loop's condition: max(x[i]) < 0.5
        nodes += [
            oh.make_node("ReduceMax", ["x_i"], ["x_max"], keepdims=0),
            oh.make_node("Less", ["x_max", "limit"], ["keep_going"]),
        ]
    nodes.append(oh.make_node("Identity", [cond_out], ["cond2"]))
    out = "acc2"
    if inner_if:
        then = oh.make_graph(
            [oh.make_node("Neg", ["acc2"], ["t_out"])],
            "then",
            [],
            [oh.make_tensor_value_info("t_out", F, [3])],
        )
        other = oh.make_graph(
            [oh.make_node("Identity", ["acc2"], ["e_out"])],
            "else",
            [],
            [oh.make_tensor_value_info("e_out", F, [3])],
        )
        nodes += [
            oh.make_node("Equal", ["i", "zero"], ["first"]),
            oh.make_node("If", ["first"], ["acc3"], then_branch=then, else_branch=other),
        ]
        out = "acc3"
    nodes.append(oh.make_node("Identity", [out], ["y_i"]))
    body = oh.make_graph(
        nodes,
        "body",
        [
            oh.make_tensor_value_info("i", I64, []),
            oh.make_tensor_value_info("cond_in", B, []),
            oh.make_tensor_value_info("acc", F, [3]),
        ],
        [
            oh.make_tensor_value_info("cond2", B, []),
            oh.make_tensor_value_info(out, F, [3]),
            oh.make_tensor_value_info("y_i", F, [3]),
        ],
    )
    inits = [
        nh.from_array(np.array(True), "go"),
        nh.from_array(np.array(0, np.int64), "zero"),
        nh.from_array(np.array(0.5, np.float32), "limit"),
    ]
    inputs = [oh.make_tensor_value_info("x", F, [steps, 3]), oh.make_tensor_value_info("acc0", F, [3])]
    if trip == "trip":
        inits.append(nh.from_array(np.array(steps, np.int64), "trip"))
    elif trip is not None:
        inputs.append(oh.make_tensor_value_info(trip, I64, []))
    loop = oh.make_node("Loop", [trip or "", "go", "acc0"], ["acc_final", "ys"], body=body)
    return _model(
        [loop],
        inputs,
        [oh.make_tensor_value_info("acc_final", F, [3]),
         oh.make_tensor_value_info("ys", F, [steps if rows == -1 else rows, 3])],
        inits=inits,
    )


@pytest.mark.parametrize("inner_if", [False, True], ids=["plain", "if-on-the-iteration"])
def test_loop_matches_onnxruntime(inner_if: bool) -> None:
    model = _loop_model(inner_if=inner_if)
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.standard_normal((4, 3)).astype(np.float32),
        "acc0": rng.standard_normal(3).astype(np.float32),
    }
    assert "unroll_loops" in _same_as_onnxruntime(model, feeds)


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        # (a declared scan output length fixes it: tests/compiler/test_dynshape_flow.py)
        (lambda: _loop_model(trip="n", rows=None), "the trip count 'n' is known only at run time"),
        (lambda: _loop_model(trip=None), "no trip count (a while loop)"),
        (lambda: _loop_model(cond_out="keep_going"), "computes its own continue condition"),
        (lambda: _loop_model(steps=MAX_ITERATIONS + 1), f"unrolled at compile time, up to {MAX_ITERATIONS}"),
    ],
    ids=["run-time-trip-count", "while-loop", "data-dependent-condition", "too-many-iterations"],
)
def test_loops_that_cannot_be_unrolled_are_refused_by_name(model: Any, needle: str) -> None:
    with pytest.raises(ModelError) as err:
        prepare(model())
    line = str(err.value)
    assert "Loop at node" in line and needle in line and "\n" not in line


def test_torch_for_loop_compiles_and_matches_onnxruntime(tmp_path: Path) -> None:
    """A recurrence written as a Python for loop, scripted and exported by torch.onnx (a Loop whose
    body reads x[i] and whose condition is the outer graph's constant true), compiled for x86_64."""
    import torch

    from compiler.artifact import load_artifact
    from compiler.build import compile_model

    class Recurrence(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8) * 0.3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.zeros(x.shape[1], 8)
            for i in range(x.shape[0]):
                h = torch.tanh(h @ self.w + x[i])
            return h

    torch.manual_seed(0)
    buf = io.BytesIO()
    with pytest.warns(DeprecationWarning):
        torch.onnx.export(
            torch.jit.script(Recurrence()),
            (torch.randn(5, 2, 8),),
            buf,
            input_names=["x"],
            output_names=["h"],
            dynamo=False,
            opset_version=17,
        )
    path = tmp_path / "loop.onnx"
    path.write_bytes(buf.getvalue())
    assert any(n.op_type == "Loop" for n in onnx.load(str(path)).graph.node)
    compile_model(path, target="x86_64", out_dir=tmp_path / "art", progress=False)
    art = load_artifact(tmp_path / "art")
    x = np.random.default_rng(3).standard_normal((5, 2, 8)).astype(np.float32)
    got = art.infer({"x": x})["h"]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
