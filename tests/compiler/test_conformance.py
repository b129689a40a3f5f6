"""Conformance: ONNX's backend test data (shipped in the onnx wheel) through prepare + compile + infer.

Runs every case through ``fractal``'s pipeline (x86_64, untuned, input shapes from the test data),
onnxruntime, and plain TVM import (see tests/compiler/conformance.py; results are cached under
.cache/conformance keyed by the case and the compiler's source). Pins the exact set of passing
cases: a case that stops passing fails the test; a case that starts passing is printed so it can
be added. Every case that does not pass must be refused at compile time with one clear line.

Measure by hand: ``PYTHONPATH=. python -m tests.compiler.conformance report``.

ONNX's operator ("node") suite (1,884 one-operator cases) runs the same way: ``make test`` runs a
stable subset (every case that once gave a wrong answer or crashed, one case per operator the
preparation stage converts, plus one case in ``NODE_SHARD``), ``make conformance``
(CONFORMANCE_FULL=1) all of them. Both fail on a wrong answer,
a crash (including a dead or hung worker: each case has a time limit) and on any case listed in
``node_suite_expected.txt`` that no longer passes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.compiler import conformance as cf

# Cases the project passes (suite/name). Keep sorted; add a case when the test reports it newly passing.
PASSING: frozenset[str] = frozenset({
    "pytorch-converted/test_AvgPool1d",
    "pytorch-converted/test_AvgPool1d_stride",
    "pytorch-converted/test_AvgPool2d",
    "pytorch-converted/test_AvgPool2d_stride",
    "pytorch-converted/test_AvgPool3d",
    "pytorch-converted/test_AvgPool3d_stride",
    "pytorch-converted/test_AvgPool3d_stride1_pad0_gpu_input",
    "pytorch-converted/test_BatchNorm1d_3d_input_eval",
    "pytorch-converted/test_BatchNorm2d_eval",
    "pytorch-converted/test_BatchNorm2d_momentum_eval",
    "pytorch-converted/test_BatchNorm3d_eval",
    "pytorch-converted/test_BatchNorm3d_momentum_eval",
    "pytorch-converted/test_ConstantPad2d",
    "pytorch-converted/test_Conv1d",
    "pytorch-converted/test_Conv1d_dilated",
    "pytorch-converted/test_Conv1d_groups",
    "pytorch-converted/test_Conv1d_pad1",
    "pytorch-converted/test_Conv1d_pad1size1",
    "pytorch-converted/test_Conv1d_pad2",
    "pytorch-converted/test_Conv1d_pad2size1",
    "pytorch-converted/test_Conv1d_stride",
    "pytorch-converted/test_Conv2d",
    "pytorch-converted/test_Conv2d_depthwise",
    "pytorch-converted/test_Conv2d_depthwise_padded",
    "pytorch-converted/test_Conv2d_depthwise_strided",
    "pytorch-converted/test_Conv2d_depthwise_with_multiplier",
    "pytorch-converted/test_Conv2d_dilated",
    "pytorch-converted/test_Conv2d_groups",
    "pytorch-converted/test_Conv2d_groups_thnn",
    "pytorch-converted/test_Conv2d_no_bias",
    "pytorch-converted/test_Conv2d_padding",
    "pytorch-converted/test_Conv2d_strided",
    "pytorch-converted/test_Conv3d",
    "pytorch-converted/test_Conv3d_dilated",
    "pytorch-converted/test_Conv3d_dilated_strided",
    "pytorch-converted/test_Conv3d_groups",
    "pytorch-converted/test_Conv3d_no_bias",
    "pytorch-converted/test_Conv3d_stride",
    "pytorch-converted/test_Conv3d_stride_padding",
    "pytorch-converted/test_ConvTranspose2d",
    "pytorch-converted/test_ConvTranspose2d_no_bias",
    "pytorch-converted/test_ELU",
    "pytorch-converted/test_Embedding",
    "pytorch-converted/test_Embedding_sparse",
    "pytorch-converted/test_GLU",
    "pytorch-converted/test_GLU_dim",
    "pytorch-converted/test_LeakyReLU",
    "pytorch-converted/test_LeakyReLU_with_negval",
    "pytorch-converted/test_Linear",
    "pytorch-converted/test_Linear_no_bias",
    "pytorch-converted/test_LogSoftmax",
    "pytorch-converted/test_MaxPool1d",
    "pytorch-converted/test_MaxPool1d_stride",
    "pytorch-converted/test_MaxPool1d_stride_padding_dilation",
    "pytorch-converted/test_MaxPool2d",
    "pytorch-converted/test_MaxPool2d_stride_padding_dilation",
    "pytorch-converted/test_MaxPool3d",
    "pytorch-converted/test_MaxPool3d_stride",
    "pytorch-converted/test_MaxPool3d_stride_padding",
    "pytorch-converted/test_PReLU_1d",
    "pytorch-converted/test_PReLU_2d",
    "pytorch-converted/test_PReLU_3d",
    "pytorch-converted/test_PixelShuffle",
    "pytorch-converted/test_PoissonNLLLLoss_no_reduce",
    "pytorch-converted/test_ReLU",
    "pytorch-converted/test_ReflectionPad2d",
    "pytorch-converted/test_ReplicationPad2d",
    "pytorch-converted/test_SELU",
    "pytorch-converted/test_Sigmoid",
    "pytorch-converted/test_Softmax",
    "pytorch-converted/test_Softmin",
    "pytorch-converted/test_Softplus",
    "pytorch-converted/test_Softsign",
    "pytorch-converted/test_Tanh",
    "pytorch-converted/test_ZeroPad2d",
    "pytorch-converted/test_log_softmax_dim3",
    "pytorch-converted/test_log_softmax_lastdim",
    "pytorch-converted/test_softmax_functional_dim3",
    "pytorch-converted/test_softmax_lastdim",
    "pytorch-operator/test_operator_add_broadcast",
    "pytorch-operator/test_operator_add_size1_broadcast",
    "pytorch-operator/test_operator_add_size1_right_broadcast",
    "pytorch-operator/test_operator_add_size1_singleton_broadcast",
    "pytorch-operator/test_operator_addconstant",
    "pytorch-operator/test_operator_addmm",
    "pytorch-operator/test_operator_basic",
    "pytorch-operator/test_operator_chunk",
    "pytorch-operator/test_operator_clip",
    "pytorch-operator/test_operator_concat2",
    "pytorch-operator/test_operator_conv",
    "pytorch-operator/test_operator_convtranspose",
    "pytorch-operator/test_operator_exp",
    "pytorch-operator/test_operator_flatten",
    "pytorch-operator/test_operator_index",
    "pytorch-operator/test_operator_max",
    "pytorch-operator/test_operator_maxpool",
    "pytorch-operator/test_operator_min",
    "pytorch-operator/test_operator_mm",
    "pytorch-operator/test_operator_non_float_params",
    "pytorch-operator/test_operator_pad",
    "pytorch-operator/test_operator_params",
    "pytorch-operator/test_operator_permute2",
    "pytorch-operator/test_operator_pow",
    "pytorch-operator/test_operator_reduced_mean",
    "pytorch-operator/test_operator_reduced_mean_keepdim",
    "pytorch-operator/test_operator_reduced_sum",
    "pytorch-operator/test_operator_reduced_sum_keepdim",
    "pytorch-operator/test_operator_repeat",
    "pytorch-operator/test_operator_repeat_dim_overflow",
    "pytorch-operator/test_operator_selu",
    "pytorch-operator/test_operator_sqrt",
    "pytorch-operator/test_operator_symbolic_override",
    "pytorch-operator/test_operator_symbolic_override_nested",
    "pytorch-operator/test_operator_view",
    "simple/test_expand_shape_model1",
    "simple/test_expand_shape_model2",
    "simple/test_expand_shape_model3",
    "simple/test_expand_shape_model4",
    "simple/test_sequence_model1",
    "simple/test_sequence_model2",
    "simple/test_sequence_model3",
    "simple/test_sequence_model4",
    "simple/test_sequence_model5",
    "simple/test_sequence_model6",
    "simple/test_sequence_model7",
    "simple/test_shrink",
    "simple/test_sign_model",
    "simple/test_single_relu_model",
})

# Cases refused at compile time, each with the cause (the test checks the refusal line contains it).
REFUSED: dict[str, str] = {
    "simple/test_strnorm_model_nostopwords_nochangecase": "unsupported operator 'StringNormalizer'",
}

BAD = ("wrong", "error", "crash", "refused-at-run")


def _check(suites: tuple[str, ...], only: frozenset[str] | None = None) -> None:
    selected = [c for c in cf.cases(suites) if only is None or c.id in only]
    assert selected, f"no ONNX backend test data found under {cf.data_root()}"
    # the plain-TVM comparison is for the report (nothing here asserts on it, and it nearly doubles
    # a cold run): `make test` leaves it out, `make conformance` computes it for its report
    res = cf.results(selected, plain_tvm=bool(os.environ.get("CONFORMANCE_FULL")))
    ids = set(res)
    passed = {c for c, r in res.items() if r["project"]["status"] == "pass"}
    ort = {c for c, r in res.items() if r["ort"]["status"] == "pass"}
    n = len(ids)
    print(f"\nconformance {'+'.join(suites)}: project {len(passed)}/{n}, onnxruntime {len(ort)}/{n}; "
          f"of onnxruntime's {len(ort)}: project passes {len(ort & passed)}")
    for c in sorted(ort - passed):
        print(f"  onnxruntime passes, project refuses: {c}: {res[c]['project'].get('detail', '')[:160]}")
    bad = {c: f"{r['project']['status']}: {r['project'].get('detail', '')}" for c, r in res.items()
           if r["project"]["status"] in BAD}
    assert not bad, f"cases neither passing nor cleanly refused: {bad}"
    for c, r in res.items():
        if r["project"]["status"] == "refused":
            line = r["project"]["detail"]
            assert line and "\n" not in line and "Traceback" not in line, (c, line)
            if c in REFUSED:
                assert REFUSED[c] in line, (c, line)
    pinned = {c for c in PASSING if c in ids}
    newly_failing = pinned - passed
    assert not newly_failing, f"cases that passed before and fail now: {sorted(newly_failing)}"
    newly_passing = passed - pinned
    if newly_passing:
        print(f"NEWLY PASSING (add to PASSING in {__file__}): {sorted(newly_passing)}")


@pytest.mark.slow
def test_backend_test_data() -> None:
    _check(("simple", "pytorch-operator", "pytorch-converted"))


# The light model-zoo networks compile in 0.5-9 minutes each (DenseNet-121 the longest): `make test`
# runs the three quickest, `make conformance` (CONFORMANCE_FULL=1) all of them.
LIGHT_QUICK = frozenset({"light/light_squeezenet", "light/light_shufflenet", "light/light_inception_v1"})


@pytest.mark.slow
def test_light_model_zoo() -> None:
    """The `light` model-zoo networks (ResNet-50, DenseNet-121, VGG-19, ...) through the project."""
    _check(("light",), None if os.environ.get("CONFORMANCE_FULL") else LIGHT_QUICK)


# ------------------------------------------------------------------------------ ONNX's node suite
NODE_EXPECTED = Path(__file__).with_name("node_suite_expected.txt")  # cases that pass; keep sorted
NODE_SHARD = 24  # make test: one case in NODE_SHARD by a stable hash of its name, plus NODE_GUARD
# Cases that gave a wrong answer or crashed on b10b7cb (issue 29): always run.
NODE_GUARD = frozenset("""
attention_4d_fp16_expanded attention_causal_boolmask_nan_robustness_expanded
attention_24_qk_matmul_output_mode3_softmax_precision_expanded
attention_4d_gqa_with_past_and_present_fp16_expanded
attention_23_fullymasked_qk_matmul_output_mode3_zero_expanded attention_local_window_gqa_rank4_mask_expanded
batchnorm_example_training_mode batchnorm_epsilon_training_mode
bitshift_right_int32_shift_ge_width bitshift_left_int32_shift_ge_width
bitshift_right_int32_negative_shift bitshift_left_int32_negative_shift
causal_conv_with_state_silu_fp16_expanded convtranspose_output_shape
layer_normalization_2d_axis1 layer_normalization_4d_axis_negative_3 layer_normalization_default_axis
roialign_mode_max spacetodepth_crd_mode_example
clip clip_default_int8_max clip_default_min_expanded dequantizelinear quantizelinear_uint16
div_int8 div_uint64 mod_mixed_sign_int32 mod_broadcast mod_uint8
dropout_default_ratio training_dropout_mask training_dropout training_dropout_zero_ratio
einsum_sum_bfloat16 einsum_scalar if if_seq
maxunpool_export_without_output_shape nonmaxsuppression_single_box nonmaxsuppression_two_batches
pow_bcast_scalar pow_types_int32_int32 rms_normalization_2d_axis0 scatter_with_axis
optional_has_element_optional_input
scatter_elements_with_reduction_max split_to_sequence_nokeepdims triu_neg tril_pos
""".split())
# One case per operator (or variant) the preparation stage converts (issue 29: Attention, CumProd,
# Det, Celu, the losses, RotaryEmbedding, CausalConvWithState, Swish, LpNormalization, Pow of a float
# by an integer as standard ops; LinearAttention and Scan unrolled, an RNN with run-time weights,
# EyeLike with a dtype, ReverseSequence, the training optimizers; ScatterElements, SpaceToDepth CRD,
# ConvTranspose output_shape and BatchNormalization training are NODE_GUARD's; the expanded
# LayerNormalization and RMSNormalization variants are NODE_GUARD's cases; BitCast's Relax converter,
# Col2Im and STFT with their run-time operand guarded, DeformConv, MaxPool's Indices, TfIdfVectorizer;
# MaxUnpool and integer Pow are NODE_GUARD's): always run, so a broken converter shows in make test.
NODE_REACH = frozenset("""
attention_4d_gqa_causal_nonpad_decode_fp16 attention_3d_with_past_and_present_qk_matmul_softcap
attention_23_boolmask_fullymasked_row_nan_robustness cumprod_2d_negative_axis det_nd celu_float16
sce_mean_weight_ii_3d_log_prob nllloss_NCd1_weight_ii rotary_embedding_interleaved swish
causal_conv_with_state_silu_with_past_state l2normalization_axis_1 pow_types_float32_int64
linear_attention_decode_step scan9_sum scan_sum gru_with_initial_bias eyelike_with_dtype reversesequence_time
adam_multiple dft_irfft_opset19 tensorscatter_circular qlinearconv
bitcast_float32_to_int32 col2im_strides deform_conv_with_mask_bias maxpool_with_argmax_2d_precomputed_strides
stft tfidfvectorizer_tf_only_bigrams_skip0
""".split()) | frozenset("""
reduce_l2_do_not_keepdims_example reduce_sum_default_axes_keepdims_random reduce_max_keepdims_random
reshape_negative_dim expand_dim_changed unsqueeze_two_axes squeeze_negative_axes slice_neg_steps tile
constantofshape_int_zeros resize_downsample_sizes_nearest_not_larger upsample_nearest
split_variable_parts_1d_opset13 top_k_same_values edge_pad center_crop_pad_crop affine_grid_2d
""".split()) | frozenset("""
nonzero_example unique_not_sorted_without_axis compress_negative_axis nonmaxsuppression_two_batches
""".split())  # a shape operand from a model input (compiler.dynshape), an output length that depends on
# the data (compiler.dataops): one case per converted operator
NODE_REACH |= frozenset("""
isnan isinf_negative mod_float_edge_cases_fmod_0_float32 castlike_FLOAT_to_DOUBLE
causal_conv_with_state_kernel_size_one dynamicquantizelinear_expanded slice_start_out_of_bounds
""".split())  # NaN / inf inputs, IsInf's sign and Mod by inf (compiler.lower_ieee), an input that only
# carries a dtype, an empty output answered by the artifact
NODE_REACH |= frozenset("""
ai_onnx_ml_label_encoder_tensor_mapping equal_string_broadcast regex_full_match_email_domain
string_concat_utf8 string_split_maxsplit strnormalizer_export_monday_insensintive_upper_twodim
""".split())  # string tensors: one case per operator of the host stage (compiler/hoststage.py)
NODE_REACH |= frozenset("reduce_sum_empty_set_non_reduced_axis_zero triu_zero".split())  # empty data inputs
# (compiler.empty): a run-time-axes reduction over them, a model whose every output is empty
NODE_REACH |= frozenset("""
center_crop_pad_crop_expanded loop11 dft_irfft range_int32_type_negative_delta onehot_with_axis hannwindow
cumsum_2d_negative_axis constant_pad_axes
""".split())  # shape operands computed from a model input (compiler.dynshape_flow), a run-time trip count
# and DFT axis fixed by static shapes and guarded, Range / OneHot with run-time scalars, a window function,
# CumSum and Pad with a run-time axis


def _in_shard(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % NODE_SHARD == 0


def node_subset(all_cases: list[cf.Case]) -> list[cf.Case]:
    always = NODE_GUARD | NODE_REACH
    return [c for c in all_cases if c.name.removeprefix("test_") in always or _in_shard(c.name)]


def expected_node_passes() -> set[str]:
    lines = NODE_EXPECTED.read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


@pytest.mark.slow
def test_node_suite() -> None:
    """ONNX's operator suite through compile_model + inference, next to onnxruntime: no wrong answer,
    no crash, every refusal one line from the compiler's error tree, no expected pass lost."""
    every = cf.node_cases()
    assert len(every) > 1800, f"only {len(every)} node cases collected"
    full = bool(os.environ.get("CONFORMANCE_FULL"))
    selected = every if full else node_subset(every)
    names = {c.name.removeprefix("test_") for c in every}
    assert NODE_GUARD | NODE_REACH <= names, "a guarded case was renamed"
    res = cf.results(selected, timeout=float(os.environ.get("CONFORMANCE_TIMEOUT", "120")))
    kinds = {c.name: cf.kind(res[c.id]["project"]["status"]) for c in selected}
    ort = {c.name: cf.kind(res[c.id]["ort"]["status"], "ort") for c in selected}
    count = {k: sum(1 for v in kinds.values() if v == k) for k in ("pass", "wrong", "refused", "crash")}
    print(f"\nnode suite ({'all' if full else 'make-test subset'}, {len(selected)} cases): project "
          f"{count}; onnxruntime passes {sum(1 for v in ort.values() if v == 'pass')}")
    if full:
        print(cf.node_table(res, selected))
    bad = {n: res[f"node/{n}"]["project"].get("detail", "")[:200] for n, k in kinds.items()
           if k in ("wrong", "crash")}
    assert not bad, f"wrong answers or crashes (a clean refusal is better than either): {bad}"
    for n, k in kinds.items():
        line = res[f"node/{n}"]["project"].get("detail", "")
        if k == "refused":
            assert line and "\n" not in line and "Traceback" not in line, (n, line)
    expected = expected_node_passes() & set(kinds)
    lost = sorted(n for n in expected if kinds[n] != "pass")
    assert not lost, f"cases that passed before and do not now: {lost}"
    new = sorted(n for n, k in kinds.items() if k == "pass" and n not in expected)
    if new:
        print(f"NEWLY PASSING (add to {NODE_EXPECTED.name}): {new}")


def test_node_subset_and_expected_list() -> None:
    """The make-test shard takes about one name in NODE_SHARD (a hash, not Python's per-process
    one), and the committed list of expected passes is well formed."""
    names = [f"test_case_{i}" for i in range(4000)]
    share = sum(_in_shard(n) for n in names) / len(names)
    assert 0.5 / NODE_SHARD < share < 2.0 / NODE_SHARD
    listed = expected_node_passes()
    assert listed and all(n.startswith("test_") for n in listed)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv_transpose_after_conv(tmp_path: Path, stride: int) -> None:
    """Conv then ConvTranspose (the shape of PaddleOCR's text detector, issue 29) through the default
    x86_64 path: the convolution goes channels-last, the transposed one must still compile (it stopped
    doing so: "CodeGenVM cannot emit ... R.nn.conv2d_transpose") and match onnxruntime."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from compiler.artifact import load_artifact
    from compiler.build import compile_model

    rng = np.random.default_rng(stride)
    wc = numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32), "wc")
    wt = numpy_helper.from_array(rng.standard_normal((8, 4, 2, 2)).astype(np.float32), "wt")
    size = (16 - 1) * stride + 2
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "wc"], ["h"], pads=[1, 1, 1, 1]),
         helper.make_node("ConvTranspose", ["h", "wt"], ["y"], strides=[stride, stride])],
        "conv_then_transpose", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, size, size])], [wc, wt])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    compile_model(path, target="x86_64", out_dir=tmp_path / "art", progress=False)
    x = rng.standard_normal((1, 8, 16, 16)).astype(np.float32)
    got = load_artifact(tmp_path / "art").infer({"x": x})["y"]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
