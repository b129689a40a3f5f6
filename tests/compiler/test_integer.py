"""QDQ models on integer kernels (compiler/integer.py): every zoo model quantized with
onnxruntime's quantize_static (compiler.quantize, 64 seeded random-normal calibration samples, as
bench.int8 does), compiled, and checked against onnxruntime running the same QDQ model with
ORT_DISABLE_ALL (its reference semantics: dequantize -> float op -> quantize). The test fails if
a quantized conv2d / matmul is left on the float path: the imported module must hold int32-
accumulating conv2d / matmul only, and the artifact's manifest must say so."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from compiler import compile_model, int8_x86, zoo
from compiler.artifact import load_artifact
from compiler.importer import import_model, load_onnx
from compiler.int8_depthwise import DEPTHWISE
from compiler.manifest import Manifest
from compiler.quantize import quantize_int8
from compiler.targets import best_host_preset_name, get_preset

# (conv2d, matmul) each zoo model puts on integer kernels: every one it has
_EXPECTED = {"ds-cnn-kws": (9, 1), "resnet8-cifar10": (9, 1), "mobilenet-v1-0.25-vww": (27, 1),
             "fc-autoencoder": (0, 10), "digits-mlp": (0, 2)}
# of those, the ones on x86's dot-product kernels (compiler.int8_x86): all but the depthwise
# convolutions, which run compiler.int8_depthwise's kernel
_DOT = {"ds-cnn-kws": 6, "resnet8-cifar10": 10, "mobilenet-v1-0.25-vww": 15, "fc-autoencoder": 10,
        "digits-mlp": 2}
_DEPTHWISE = {"ds-cnn-kws": 4, "mobilenet-v1-0.25-vww": 13}


def _qdq(name: str, work: Path) -> Path:
    f32 = zoo.save(name, work / f"{name}.onnx")
    cal = work / f"{name}-cal.npz"
    np.savez(cal, x=np.random.default_rng(0).standard_normal((64, *zoo.input_shape(name)[1:]))
             .astype(np.float32))
    return quantize_int8(f32, cal, work / f"{name}.int8.onnx")[0]


def _kernels(mod: object) -> Counter[tuple[str, str]]:
    """(op, output dtype) of every conv2d / matmul bound in ``mod``'s main function."""
    from tvm import relax

    out: Counter[tuple[str, str]] = Counter()
    for block in mod["main"].body.blocks:  # type: ignore[index]
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op.name in ("relax.nn.conv2d", "relax.matmul"):
                out[(v.op.name.rsplit(".", 1)[1], str(b.var.ty.dtype))] += 1
    return out


def _output_step(qdq: Path) -> float:
    m = onnx.load(str(qdq))
    node = next(n for n in m.graph.node if m.graph.output[0].name in n.output)
    assert node.op_type == "DequantizeLinear"
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    return float(inits[node.input[1]])


def _worst_steps(art: Path, qdq: Path, name: str, n: int = 8) -> float:
    """The largest output difference from onnxruntime's reference, in output quantization steps."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(qdq), opts, providers=["CPUExecutionProvider"])
    a = load_artifact(art)
    worst = 0.0
    for i in range(n):
        x = np.random.default_rng(100 + i).standard_normal(zoo.input_shape(name)).astype(np.float32)
        got = next(iter(a.infer({"x": x}).values()))
        worst = max(worst, float(np.abs(got - sess.run(None, {"x": x})[0]).max()))
    return worst / _output_step(qdq)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_EXPECTED))
def test_zoo_qdq_model_on_integer_kernels_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    qdq = _qdq(name, tmp_path)
    conv, mm = _EXPECTED[name]
    kernels = _kernels(import_model(load_onnx(qdq)).mod)
    assert kernels == Counter({k: v for k, v in {("conv2d", "int32"): conv, ("matmul", "int32"): mm}.items()
                               if v}), kernels
    # the frontend's own import of the same model runs them in float32 (what the rewrite replaces)
    assert {d for _, d in _kernels(import_model(load_onnx(qdq), integer=False).mod)} == {"float32"}
    # ds-cnn-kws with the default schedules the benchmark builds; the others with the naive
    # lowering for what the dot-product kernels do not cover (the arithmetic is what they check,
    # and it saves minutes of schedule timing). The most specific preset this CPU runs: on AVX2
    # and AVX-512 the convolutions and matmuls run the tensorized kernels of compiler.int8_x86.
    preset = best_host_preset_name()
    art = compile_model(qdq, target=preset, out_dir=tmp_path / "art", progress=False,
                        default_schedules=name == "ds-cnn-kws", integer=True)
    steps = Manifest.read(art).prepared_steps
    assert f"integer_kernels({conv} conv2d, {mm} matmul int8->int32)" in steps
    if int8_x86.kernels(get_preset(preset).tvm_target()) is not None:
        own = _DOT[name] + _DEPTHWISE.get(name, 0)
        assert any(s.startswith(f"dot_product_kernels({own} of them: ") for s in steps), steps
        if name in _DEPTHWISE:
            assert any(f"{_DEPTHWISE[name]} {DEPTHWISE}" in s for s in steps), steps
        # random weights: some vpmaddubsw pair sum could saturate in every layer, so the exact
        # int16 pairs (vpmaddwd) run
        lib = json.loads((art / "manifest.json").read_text())["libs"]["infer"]
        asm = subprocess.run(["objdump", "-d", str(art / lib)], capture_output=True, text=True).stdout
        assert asm.count("vpmaddwd") >= _DOT[name], name
    # the outputs are on the int8 grid: equal, or one quantization step apart at most
    assert _worst_steps(art, qdq, name) <= 1.001


@pytest.mark.slow
def test_c_backend_carries_the_integer_kernels(tmp_path: Path) -> None:
    qdq = _qdq("ds-cnn-kws", tmp_path)
    art = compile_model(qdq, target="x86_64-c", out_dir=tmp_path / "art", progress=False, integer=True)
    man = Manifest.read(art)
    assert man.libs.runtime == "c"
    assert "integer_kernels(9 conv2d, 1 matmul int8->int32)" in man.prepared_steps
    assert _worst_steps(art, qdq, "ds-cnn-kws") <= 1.001


def test_integer_kernels_are_the_default_where_the_cpu_has_an_int8_dot_product() -> None:
    from compiler.build import integer_by_default
    from compiler.targets import get_preset

    # measured slower than the float import on AVX2 (BENCHMARKS.md "int8"): not the default there
    assert not integer_by_default(get_preset("x86_64-avx2"))
    assert not integer_by_default(get_preset("rpi4"))  # Cortex-A72: no dotprod
    assert integer_by_default(get_preset("rpi5"))  # Cortex-A76: sdot
