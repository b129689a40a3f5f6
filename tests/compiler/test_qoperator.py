"""QOperator-format quantized models (compiler/qoperator.py): every zoo model quantized by
onnxruntime's quantize_static in QOperator format (QLinearConv, QGemm, QLinearAdd,
QLinearGlobalAveragePool; the calibration and settings of the QDQ models of test_integer.py)
goes through the preparation stage's rewrite to QDQ onto the same integer kernels as its QDQ
twin, and its outputs equal onnxruntime's (which runs its own integer QOperator kernels) within
one output quantization step; one on aarch64 under qemu-user (the C backend's native runner:
seconds, where an emulated Python process takes minutes). uint8 activations with per-tensor
weights against ONNX's reference implementation, and the refusal of the quantized operators not
rewritten, on small models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler import compile_model
from compiler.emulate import run_emulated
from compiler.inspect import inspect_model
from compiler.manifest import Manifest, QuantSettings
from compiler.quantize import quantize_int8
from compiler.targets import best_host_preset_name, host_preset_name
from tests.compiler.test_integer import _EXPECTED
from tests.fixtures_int8 import ZOO_INT8, int8_input, steps_from_reference

# the ops quantize_static writes in QOperator format for each zoo model (what the rewrite must cover)
_QOPS = {"ds-cnn-kws": {"QLinearConv", "QLinearGlobalAveragePool", "QGemm"},
         "resnet8-cifar10": {"QLinearConv", "QLinearAdd", "QLinearGlobalAveragePool", "QGemm"},
         "mobilenet-v1-0.25-vww": {"QLinearConv", "QLinearGlobalAveragePool", "QGemm"},
         "fc-autoencoder": {"QGemm"}, "digits-mlp": {"QGemm"}}


def _qops(model: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(model)).graph.node if n.op_type.startswith("Q") and
            n.op_type != "QuantizeLinear"}


@pytest.mark.parametrize("name", ZOO_INT8)
def test_zoo_qoperator_model_on_integer_kernels_matches_onnxruntime(
        name: str, qoperator_model: Callable[[str], Path], tmp_path: Path) -> None:
    qop = qoperator_model(name)
    assert _qops(qop) == _QOPS[name]
    conv, mm = _EXPECTED[name]  # every quantized conv / matmul (all the model has), as for the QDQ model
    # the naive lowering for what the dot-product kernels do not cover: the arithmetic is checked
    art = compile_model(qop, target=best_host_preset_name(), out_dir=tmp_path / "art", progress=False,
                        integer=True, default_schedules=False)
    steps = Manifest.read(art).prepared_steps
    assert "qoperator_to_qdq" in steps and f"integer_kernels({conv} conv2d, {mm} matmul int8->int32)" in steps
    from compiler.artifact import load_artifact

    a = load_artifact(art)
    for seed in (100, 101, 102):
        inputs = int8_input(name, seed)
        assert steps_from_reference(qop, inputs, next(iter(a.infer(inputs).values()))) <= 1.001, (name, seed)


@pytest.mark.emulate
def test_aarch64_c_backend_runs_a_qoperator_model_like_onnxruntime(
        qoperator_model: Callable[[str], Path], tmp_path: Path) -> None:
    qop = qoperator_model("ds-cnn-kws")
    art = compile_model(qop, target="aarch64-c", out_dir=tmp_path / "art", progress=False, integer=True)
    man = Manifest.read(art)
    assert man.arch == "aarch64" and man.libs.runtime == "c"
    assert "integer_kernels(9 conv2d, 1 matmul int8->int32)" in man.prepared_steps
    inputs = int8_input("ds-cnn-kws")
    got = next(iter(run_emulated(art, inputs).values()))  # the native runner under qemu-aarch64
    assert steps_from_reference(qop, inputs, got) <= 1.001


def test_uint8_activations_and_per_tensor_weights_follow_the_onnx_definition(tmp_path: Path) -> None:
    """onnxruntime's other QOperator flavour (uint8 activations with a zero point, one weight scale
    per tensor): a padded, strided convolution (the zero point is the padding value) and a
    QLinearMatMul, both on integer kernels, equal to ONNX's reference implementation of the
    QOperator model (onnx.reference) exactly. (Not to onnxruntime's: its u8 x s8 kernels on a CPU
    without VNNI saturate int16 pair sums, 58 steps off the definition on one output here.)"""
    from onnx.reference import ReferenceEvaluator

    from compiler.artifact import load_artifact

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("w", (8, 3, 3, 3)), ("b", (8,)), ("g", (8 * 6 * 6, 5)))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("MatMul", ["f", "g"], ["y"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
          for n, s in (("x", [1, 3, 12, 12]), ("y", [1, 5]))]
    model = helper.make_model(helper.make_graph(nodes, "cm", io[:1], io[1:], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "cm.onnx"))
    np.savez(tmp_path / "cal.npz", x=rng.standard_normal((16, 3, 12, 12)).astype(np.float32))
    settings = QuantSettings(per_channel=False, activation_type="uint8")
    qop = quantize_int8(tmp_path / "cm.onnx", tmp_path / "cal.npz", tmp_path / "cm.qop.onnx", settings,
                        qoperator=True)[0]
    assert _qops(qop) == {"QLinearConv", "QLinearMatMul"}
    m = onnx.load(str(qop))
    conv = next(n for n in m.graph.node if n.op_type == "QLinearConv")
    inits_q = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    assert inits_q[conv.input[2]].dtype == np.uint8 and inits_q[conv.input[4]].size == 1
    art = compile_model(qop, target=host_preset_name(), out_dir=tmp_path / "art", progress=False,
                        integer=True, default_schedules=False)
    assert "integer_kernels(1 conv2d, 1 matmul int8->int32)" in Manifest.read(art).prepared_steps
    # quantize_static imports domains it does not use; onnx.reference has Q/DQ from opset 19 (the
    # same arithmetic for int8 / uint8)
    del m.opset_import[:]
    m.opset_import.append(helper.make_opsetid("", 21))
    a, ref = load_artifact(art), ReferenceEvaluator(m)
    for seed in range(4):
        inputs = {"x": np.random.default_rng(seed).standard_normal((1, 3, 12, 12)).astype(np.float32) * 2}
        (want,) = ref.run(["y"], inputs)
        np.testing.assert_array_equal(a.infer(inputs)["y"], want)


def _contrib_ops_model(path: Path) -> tuple[dict[str, str], dict[str, float]]:
    """Each rewritten com.microsoft operator once on int8 and once on uint8 activations, straight
    from the quantized inputs (no chain: a one-step difference would grow along one), every
    result dequantized to a graph output. Returns output -> operator, output -> its step."""
    ms = "com.microsoft"
    nodes, inits, outs = [], [], []
    ops: dict[str, str] = {}
    steps: dict[str, float] = {}
    for dt, z in ((np.int8, -3), (np.uint8, 120)):
        t = dt.__name__
        grid = ((0.05, 0), (0.01, 2), (0.02, -1), (0.03, 0))  # (scale, zero point offset) of s0..s3
        sz = {f"s{i}_{t}": (s, z + dz) for i, (s, dz) in enumerate(grid)}
        for name, (s, zz) in sz.items():
            inits += [numpy_helper.from_array(np.array(s, np.float32), name),
                      numpy_helper.from_array(np.array(zz, dt), "z" + name[1:])]
        s0, s1, s2, s3 = (f"s{i}_{t}" for i in range(4))
        z0, z1, z2, z3 = (f"z{i}_{t}" for i in range(4))
        q, q2 = f"q_{t}", f"q2_{t}"
        nodes += [helper.make_node("QuantizeLinear", ["x", s0, z0], [q]),
                  helper.make_node("QuantizeLinear", ["x2", s1, z1], [q2])]
        pool = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2], "count_include_pad": 0}
        for op, ins, (ys, yz), attrs, shape in (
                ("QLinearSigmoid", [q, s0, z0], (s1, z1), {}, [1, 4, 9, 9]),
                ("QLinearLeakyRelu", [q, s0, z0], (s2, z2), {"alpha": 0.1}, [1, 4, 9, 9]),
                ("QLinearMul", [q, s0, z0, q2, s1, z1], (s3, z3), {}, [1, 4, 9, 9]),
                ("QLinearAdd", [q, s0, z0, q2, s1, z1], (s3, z3), {}, [1, 4, 9, 9]),
                ("QLinearAveragePool", [q, s0, z0], (s2, z2), pool, [1, 4, 5, 5]),
                ("QLinearGlobalAveragePool", [q, s0, z0], (s1, z1), {"channels_last": 0}, [1, 4, 1, 1]),
                ("QLinearConcat", [q, s0, z0, q2, s1, z1], (s2, z2), {"axis": 1}, [1, 8, 9, 9])):
            out = f"{op}_{t}"
            inputs = [ys, yz, *ins] if op == "QLinearConcat" else [*ins, ys, yz]
            nodes += [helper.make_node(op, inputs, [out + "_q"], domain=ms, **attrs),
                      helper.make_node("DequantizeLinear", [out + "_q", ys, yz], [out])]
            outs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, shape))
            ops[out], steps[out] = op, sz[ys][0]
    x = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 9, 9]) for n in ("x", "x2")]
    # opset 12 as the ONNX model zoo's int8 models (upgraded to 13 before the rewrite), and a domain
    # onnx does not know among the imports, as quantize_static writes them
    opsets = [helper.make_opsetid("", 12), helper.make_opsetid(ms, 1), helper.make_opsetid(ms + ".nchwc", 1)]
    model = helper.make_model(helper.make_graph(nodes, "contrib", x, outs, inits), opset_imports=opsets)
    model.ir_version = 10
    onnx.save(model, str(path))
    return ops, steps


def test_onnxruntime_contrib_quantized_ops_each_within_one_step(tmp_path: Path) -> None:
    """QLinearSigmoid, QLinearLeakyRelu, QLinearMul, QLinearAdd, QLinearAveragePool,
    QLinearGlobalAveragePool and QLinearConcat (int8 and uint8) through their QDQ form (float
    path: dequantize, op, quantize) against onnxruntime's own kernels for them: equal, or one
    step apart (measured: QLinearMul, uint8 QLinearAveragePool; onnxruntime rounds once with
    the scales folded together)."""
    import onnxruntime as ort

    from compiler.artifact import load_artifact

    ops, steps = _contrib_ops_model(tmp_path / "contrib.onnx")
    report = inspect_model(tmp_path / "contrib.onnx")  # fractal inspect: rewritten, not unsupported
    assert not report.unsupported and report.decomposed["com.microsoft::QLinearConcat"] == 2
    art = compile_model(tmp_path / "contrib.onnx", target=host_preset_name(), out_dir=tmp_path / "art",
                        progress=False, default_schedules=False)
    assert Manifest.read(art).prepared_steps[:2] == ("upgrade_opset", "qoperator_to_qdq")
    a = load_artifact(art)
    sess = ort.InferenceSession(str(tmp_path / "contrib.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for seed in range(4):
        rng = np.random.default_rng(seed)
        feeds = {"x": rng.standard_normal((1, 4, 9, 9)).astype(np.float32) * 3,
                 "x2": rng.standard_normal((1, 4, 9, 9)).astype(np.float32)}
        got = a.infer(feeds)
        for name, want in zip(names, sess.run(None, feeds), strict=True):
            assert float(np.abs(got[name] - want).max()) / steps[name] <= 1.001, (ops[name], seed)


def test_quantized_operators_not_rewritten_are_refused_in_one_line(run_cli: object, tmp_path: Path) -> None:
    """QLinearSoftmax (onnxruntime's contrib domain) has no QDQ rewrite: one line naming it and
    the QDQ format as the fix."""
    x = helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 4])
    inits = [numpy_helper.from_array(np.array(v, dtype=dt), n) for n, v, dt in (
        ("xs", 0.1, np.float32), ("xz", 0, np.uint8), ("ys", 1 / 256, np.float32), ("yz", 0, np.uint8))]
    node = helper.make_node("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], name="qs",
                            domain="com.microsoft", axis=-1, opset=13)
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], inits), opset_imports=opsets)
    onnx.save(model, str(tmp_path / "qs.onnx"))
    r = run_cli("compile", tmp_path / "qs.onnx", "-t", host_preset_name(), "-o", tmp_path / "art", "-q")  # type: ignore[operator]
    assert r.code != 0 and "QLinearSoftmax at node 'qs'" in r.error_line and "QDQ" in r.error_line
    assert inspect_model(tmp_path / "qs.onnx").unsupported == {"com.microsoft::QLinearSoftmax": 1}
