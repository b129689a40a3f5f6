"""compiler.prepare: operators TVM's importer lacks, rewritten in the preparation stage (Attention,
Celu, CenterCropPad, the losses, RotaryEmbedding, CausalConvWithState, Swish and the normalization
variants TVM gets wrong as ONNX's function bodies; CumProd, Det as standard ops), match onnxruntime on
the original model; the variants that cannot be compiled are refused with one line naming the op."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from compiler.errors import ModelError
from compiler.prepare import DECOMPOSED_OPS, prepare

F = TensorProto.FLOAT


def _model(node: Any, inputs: list[Any], outputs: list[str], opset: int,
           inits: list[Any] | None = None) -> onnx.ModelProto:
    graph = oh.make_graph([node], "one_op", inputs, [oh.make_tensor_value_info(o, F, None) for o in outputs],
                          inits or [])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _same_as_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray], step: str) -> onnx.ModelProto:
    want = _run(model, feeds)
    prepared, steps = prepare(model)
    assert step in steps
    assert not any(n.op_type in DECOMPOSED_OPS for n in prepared.graph.node)
    got = _run(prepared, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    return prepared


def _attention(*, q_heads: int = 4, kv_heads: int = 2, past: int = 3, mask: str = "bool",
               **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """4-D grouped-query attention with a KV cache: Q [B, Hq, S, D], K/V [B, Hkv, S, D]."""
    rng = np.random.default_rng(0)
    b, s, d = 2, 4, 8
    total = s + past
    arrays = {"Q": rng.standard_normal((b, q_heads, s, d)), "K": rng.standard_normal((b, kv_heads, s, d)),
              "V": rng.standard_normal((b, kv_heads, s, d)),
              "past_key": rng.standard_normal((b, kv_heads, past, d)),
              "past_value": rng.standard_normal((b, kv_heads, past, d))}
    feeds: dict[str, np.ndarray] = {k: v.astype(np.float32) for k, v in arrays.items()}
    feeds["mask"] = rng.random((s, total)) > 0.3 if mask == "bool" else \
        rng.standard_normal((s, total)).astype(np.float32)
    inputs = [oh.make_tensor_value_info(k, TensorProto.BOOL if v.dtype == bool else F, list(v.shape))
              for k, v in feeds.items()]
    node = oh.make_node("Attention", ["Q", "K", "V", "mask", "past_key", "past_value"],
                        ["Y", "present_key", "present_value", "qk"], **attrs)
    return _model(node, inputs, ["Y", "present_key", "present_value", "qk"], 23), feeds


@pytest.mark.parametrize("kw", [
    {"mask": "bool", "is_causal": 1},
    {"mask": "float", "scale": 0.3, "softcap": 2.0, "qk_matmul_output_mode": 2},
    {"mask": "float", "q_heads": 2, "qk_matmul_output_mode": 3},
], ids=["gqa-causal-boolmask", "softcap-floatmask", "mha-softmax-out"])
def test_attention_matches_onnxruntime(kw: dict[str, Any]) -> None:
    model, feeds = _attention(**kw)
    _same_as_onnxruntime(model, feeds, "expand_functions")


def test_attention_3d_compiles_with_tvm_and_matches() -> None:
    """3-D inputs (heads from q_num_heads / kv_num_heads) through TVM."""
    import tvm
    from tvm import relax

    from compiler.importer import import_model

    rng = np.random.default_rng(1)
    feeds = {"Q": rng.standard_normal((1, 4, 16)).astype(np.float32),
             "K": rng.standard_normal((1, 6, 8)).astype(np.float32),
             "V": rng.standard_normal((1, 6, 8)).astype(np.float32)}
    inputs = [oh.make_tensor_value_info(k, F, list(v.shape)) for k, v in feeds.items()]
    node = oh.make_node("Attention", ["Q", "K", "V"], ["Y"], q_num_heads=4, kv_num_heads=2, is_causal=1,
                        softcap=3.0)
    model = _model(node, inputs, ["Y"], 23)
    want = _run(model, feeds)[0]
    imported = import_model(model)
    assert "expand_functions" in imported.prepared_steps
    vm = relax.VirtualMachine(relax.build(imported.mod, target="llvm"), tvm.cpu())
    args = [tvm.runtime.tensor(feeds[s.name]) for s in imported.inputs]
    got = vm["main"](*args, *[tvm.runtime.tensor(p) for p in imported.params])
    got = got[0] if isinstance(got, tvm.ir.Array | list | tuple) else got
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)


def test_celu_and_center_crop_pad_with_a_constant_shape() -> None:
    x = np.random.default_rng(2).standard_normal((3, 7, 4)).astype(np.float32)
    celu = _model(oh.make_node("Celu", ["x"], ["y"], alpha=0.7),
                  [oh.make_tensor_value_info("x", F, [3, 7, 4])], ["y"], 18)
    _same_as_onnxruntime(celu, {"x": x}, "expand_functions")
    shape = nh.from_array(np.array([5, 6], np.int64), "shape")
    crop = _model(oh.make_node("CenterCropPad", ["x", "shape"], ["y"], axes=[1, 2]),
                  [oh.make_tensor_value_info("x", F, [3, 7, 4])], ["y"], 18, [shape])
    _same_as_onnxruntime(crop, {"x": x}, "expand_functions")


def test_center_crop_pad_with_a_computed_shape_is_refused() -> None:
    """A target shape that is a model input keeps the node whole (compiler.dynshape_pad converts
    it, tests/compiler/test_dynshape.py); one computed in the graph is refused in one line."""
    inputs = [oh.make_tensor_value_info("x", F, [3, 7, 4]), oh.make_tensor_value_info("shape", 7, [2])]
    model = _model(oh.make_node("CenterCropPad", ["x", "shape"], ["y"], axes=[1, 2]), inputs, ["y"], 18)
    assert [n.op_type for n in prepare(model)[0].graph.node] == ["CenterCropPad"]
    computed = _model(oh.make_node("CenterCropPad", ["x", "half"], ["y"], axes=[1, 2]), inputs, ["y"], 18)
    computed.graph.node.insert(0, oh.make_node("Abs", ["shape"], ["half"]))
    with pytest.raises(ModelError, match=r"^CenterCropPad at node '#1': the target shape 'half' is computed "
                                         "in the graph") as err:
        prepare(computed)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("shape", "axis", "attrs"), [
    ((4, 5), np.int64(1), {}),
    ((3, 4, 2), np.int32(-2), {"exclusive": 1}),
    ((3, 4, 2), np.int64(0), {"reverse": 1, "exclusive": 1}),
], ids=["axis1", "neg-axis-exclusive", "reverse-exclusive"])
@pytest.mark.parametrize("axis_at_run_time", [False, True], ids=["const-axis", "input-axis"])
def test_cumprod_matches_onnxruntime(shape: tuple[int, ...], axis: np.ndarray, attrs: dict[str, Any],
                                     axis_at_run_time: bool) -> None:
    x = np.random.default_rng(3).uniform(-2, 2, shape).astype(np.float32)
    inputs = [oh.make_tensor_value_info("x", F, list(shape))]
    feeds = {"x": x}
    inits = []
    axis_arr = np.array(axis)
    if axis_at_run_time:
        inputs.append(oh.make_tensor_value_info("axis", nh.from_array(axis_arr).data_type, []))
        feeds["axis"] = axis_arr
    else:
        inits.append(nh.from_array(axis_arr, "axis"))
    model = _model(oh.make_node("CumProd", ["x", "axis"], ["y"], **attrs), inputs, ["y"], 26, inits)
    _same_as_onnxruntime(model, feeds, "decompose_ops")


@pytest.mark.parametrize("shape", [(2, 2), (4, 3, 3), (2, 4, 4), (5, 5)])
def test_det_matches_onnxruntime(shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    model = _model(oh.make_node("Det", ["x"], ["y"]), [oh.make_tensor_value_info("x", F, list(shape))],
                   ["y"], 22)
    _same_as_onnxruntime(model, {"x": x}, "decompose_ops")


@pytest.mark.parametrize(("op", "shape", "needle"), [
    ("Det", (6, 6), "6x6 matrices; the determinant is expanded only up to 5x5"),
    ("CumProd", (2, 300), "the product runs along 300 elements"),
])
def test_too_big_to_unroll_is_refused_by_name(op: str, shape: tuple[int, ...], needle: str) -> None:
    inits = [nh.from_array(np.array(1, np.int64), "axis")] if op == "CumProd" else []
    node = oh.make_node(op, ["x", "axis"] if op == "CumProd" else ["x"], ["y"])
    model = _model(node, [oh.make_tensor_value_info("x", F, list(shape))], ["y"], 26, inits)
    with pytest.raises(ModelError, match=rf"^{op} at node '#0': {needle}") as err:
        prepare(model)
    assert "\n" not in str(err.value)


def test_attention_3d_without_head_counts_is_refused() -> None:
    inputs = [oh.make_tensor_value_info(n, F, [1, 4, 16]) for n in "QKV"]
    model = _model(oh.make_node("Attention", list("QKV"), ["Y"]), inputs, ["Y"], 23)
    with pytest.raises(ModelError, match=r"^Attention at node '#0': 3-D inputs without q_num_heads and "
                                         "kv_num_heads$"):
        prepare(model)


def _loss(op: str, opset: int, *, weights: bool, outputs: list[str], **attrs: Any) -> None:
    """N=3 samples, C=5 classes over a 2x2 spatial map; one label set to the ignored class."""
    rng = np.random.default_rng(5)
    feeds: dict[str, np.ndarray] = {"x": rng.standard_normal((3, 5, 2, 2)).astype(np.float32),
                                    "t": rng.integers(0, 5, (3, 2, 2)).astype(np.int64)}
    feeds["t"][0, 1, 1] = 2
    if weights:
        feeds["w"] = rng.uniform(0.2, 2.0, 5).astype(np.float32)
    inputs = [oh.make_tensor_value_info(k, TensorProto.INT64 if v.dtype == np.int64 else F, list(v.shape))
              for k, v in feeds.items()]
    model = _model(oh.make_node(op, list(feeds), outputs, **attrs), inputs, outputs, opset)
    _same_as_onnxruntime(model, feeds, "expand_functions")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_softmax_cross_entropy_loss_matches_onnxruntime(reduction: str) -> None:
    """Its ONNX body calls NegativeLogLikelihoodLoss, whose body is expanded in turn."""
    _loss("SoftmaxCrossEntropyLoss", 13, weights=reduction != "sum", outputs=["loss", "log_prob"],
          reduction=reduction, ignore_index=2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_negative_log_likelihood_loss_matches_onnxruntime(reduction: str) -> None:
    _loss("NegativeLogLikelihoodLoss", 22, weights=True, outputs=["loss"], reduction=reduction,
          ignore_index=2)


@pytest.mark.parametrize("attrs", [{}, {"interleaved": 1, "rotary_embedding_dim": 4}],
                         ids=["half-split", "interleaved-partial"])
def test_rotary_embedding_matches_onnxruntime(attrs: dict[str, Any]) -> None:
    """4-D X [B, H, S, D] with position ids into a [max_pos, rotary_dim / 2] cache."""
    rng = np.random.default_rng(6)
    half = attrs.get("rotary_embedding_dim", 8) // 2
    angles = rng.uniform(0, 3, (10, half))
    feeds = {"X": rng.standard_normal((2, 3, 4, 8)).astype(np.float32),
             "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32),
             "pos": rng.integers(0, 10, (2, 4)).astype(np.int64)}
    inputs = [oh.make_tensor_value_info(k, TensorProto.INT64 if v.dtype == np.int64 else F, list(v.shape))
              for k, v in feeds.items()]
    model = _model(oh.make_node("RotaryEmbedding", list(feeds), ["Y"], **attrs), inputs, ["Y"], 23)
    _same_as_onnxruntime(model, feeds, "expand_functions")


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_causal_conv_with_state_matches_onnxruntime(activation: str) -> None:
    """Depthwise causal convolution over [N, C, L] with a carried state [N, C, K-1]."""
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((2, 3, 6)).astype(np.float32),
             "w": rng.standard_normal((3, 1, 4)).astype(np.float32),
             "b": rng.standard_normal(3).astype(np.float32),
             "state": rng.standard_normal((2, 3, 3)).astype(np.float32)}
    inputs = [oh.make_tensor_value_info(k, F, list(v.shape)) for k, v in feeds.items()]
    node = oh.make_node("CausalConvWithState", list(feeds), ["y", "present"], activation=activation)
    model = _model(node, inputs, ["y", "present"], 27)
    _same_as_onnxruntime(model, feeds, "expand_functions")


def test_swish_matches_onnxruntime() -> None:
    x = np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32)
    inputs = [oh.make_tensor_value_info("x", F, [3, 4])]
    model = _model(oh.make_node("Swish", ["x"], ["y"], alpha=0.6), inputs, ["y"], 24)
    _same_as_onnxruntime(model, {"x": x}, "expand_functions")


@pytest.mark.parametrize(("op", "axis", "outputs", "expanded"), [
    ("LayerNormalization", 1, ["y", "mean", "inv_std"], True),  # TVM computes only Y
    ("LayerNormalization", 1, ["y"], False),  # TVM's own converter stays
    ("RMSNormalization", 0, ["y"], True),  # every axis: TVM's converter fails to schedule it
    ("RMSNormalization", -3, ["y"], True),
    ("RMSNormalization", 1, ["y"], False),
])
def test_normalizations_expanded_only_where_tvm_fails(op: str, axis: int, outputs: list[str],
                                                       expanded: bool) -> None:
    rng = np.random.default_rng(9)
    feeds = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32),
             "scale": rng.standard_normal((3, 4) if axis in (1, -2) else (2, 3, 4)).astype(np.float32)}
    inputs = [oh.make_tensor_value_info(k, F, list(v.shape)) for k, v in feeds.items()]
    model = _model(oh.make_node(op, list(feeds), outputs, axis=axis, epsilon=1e-3), inputs, outputs, 23)
    if not expanded:
        prepared, steps = prepare(model)
        assert "expand_functions" not in steps and prepared.graph.node[0].op_type == op
        return
    prepared = _same_as_onnxruntime(model, feeds, "expand_functions")
    assert op not in {n.op_type for n in prepared.graph.node}


def test_causal_conv_with_an_empty_state(tmp_path) -> None:
    """Kernel size 1 makes present_state [N, C, 0]: the artifact answers it as an empty array
    (compiled, TVM could not load the library: "Invalid DLTensor file format"); y is computed."""
    from compiler.artifact import load_artifact
    from compiler.build import compile_model

    inputs = [oh.make_tensor_value_info("x", F, [2, 3, 5]), oh.make_tensor_value_info("w", F, [3, 1, 1])]
    node = oh.make_node("CausalConvWithState", ["x", "w"], ["y", "present"])
    graph = oh.make_graph([node], "one_op", inputs, [oh.make_tensor_value_info("y", F, [2, 3, 5]),
                                                     oh.make_tensor_value_info("present", F, [2, 3, 0])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 27)])
    model.ir_version = 10
    onnx.save(model, tmp_path / "m.onnx")
    art = load_artifact(compile_model(tmp_path / "m.onnx", target="x86_64", out_dir=tmp_path / "a",
                                      progress=False))
    assert [o.shape for o in art.outputs] == [(2, 3, 5), (2, 3, 0)] and not art.batched
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 3, 5)).astype(np.float32),
             "w": rng.standard_normal((3, 1, 1)).astype(np.float32)}
    got = art.infer(feeds)
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-6)
    assert got["present"].shape == want[1].shape == (2, 3, 0) and got["present"].dtype == np.float32


@pytest.mark.parametrize(("p", "axis", "opset"), [(1, 0, 22), (2, 1, 22), (2, -1, 13)])
def test_lp_normalization_matches_onnxruntime(p: int, axis: int, opset: int) -> None:
    """A reduction and a division; a zero vector normalizes to zeros as in onnxruntime (not NaN)."""
    x = np.random.default_rng(10).standard_normal((3, 4)).astype(np.float32)
    x[1, :] = 0.0
    x[:, 2] = 0.0
    model = _model(oh.make_node("LpNormalization", ["x"], ["y"], p=p, axis=axis),
                   [oh.make_tensor_value_info("x", F, [3, 4])], ["y"], opset)
    _same_as_onnxruntime(model, {"x": x}, "decompose_ops")


@pytest.mark.parametrize("exp_type", [np.int64, np.int32])
def test_pow_of_a_float_by_an_integer_matches_onnxruntime(exp_type: Any) -> None:
    rng = np.random.default_rng(11)
    feeds = {"x": rng.uniform(-3, 3, (2, 5)).astype(np.float32), "n": rng.integers(0, 5, 5).astype(exp_type)}
    inputs = [oh.make_tensor_value_info("x", F, [2, 5]),
              oh.make_tensor_value_info("n", nh.from_array(feeds["n"]).data_type, [5])]
    model = _model(oh.make_node("Pow", ["x", "n"], ["y"]), inputs, ["y"], 15)
    prepared = _same_as_onnxruntime(model, feeds, "cast_pow_exponent")
    assert [n.op_type for n in prepared.graph.node] == ["Cast", "Pow"]
