"""Conformance: ONNX's backend test data (shipped in the onnx wheel) through prepare + compile + infer.

Runs every case through ``fractal``'s pipeline (x86_64, untuned, input shapes from the test data),
onnxruntime, and plain TVM import (see tests/compiler/conformance.py; results are cached under
.cache/conformance keyed by the case and the compiler's source). Pins the exact set of passing
cases: a case that stops passing fails the test; a case that starts passing is printed so it can
be added. Every case that does not pass must be refused at compile time with one clear line.

Measure by hand: ``PYTHONPATH=. python -m tests.compiler.conformance report``.
"""

from __future__ import annotations

import os

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
    "simple/test_sequence_model1",
    "simple/test_sequence_model2",
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
    "simple/test_expand_shape_model1": "output shapes decided at run time are not supported",
    "simple/test_expand_shape_model3": "output shapes decided at run time are not supported",
    "simple/test_sequence_model3": "negative position",
    "simple/test_strnorm_model_nostopwords_nochangecase": "unsupported operator 'StringNormalizer'",
}

BAD = ("wrong", "error", "crash", "refused-at-run")


def _check(suites: tuple[str, ...], only: frozenset[str] | None = None) -> None:
    selected = [c for c in cf.cases(suites) if only is None or c.id in only]
    assert selected, f"no ONNX backend test data found under {cf.data_root()}"
    res = cf.results(selected)
    ids = set(res)
    passed = {c for c, r in res.items() if r["project"]["status"] == "pass"}
    ort = {c for c, r in res.items() if r["ort"]["status"] == "pass"}
    tvm = {c for c, r in res.items() if r["tvm"]["status"] == "pass"}
    n = len(ids)
    print(f"\nconformance {'+'.join(suites)}: project {len(passed)}/{n}, onnxruntime {len(ort)}/{n}, "
          f"plain TVM import {len(tvm)}/{len(ids)}; of onnxruntime's {len(ort)}: project passes "
          f"{len(ort & passed)}")
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
