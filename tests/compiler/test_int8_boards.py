"""int8 QDQ zoo models on the boards' presets (issue 30): built on integer kernels for rpi5
(Cortex-A76, Arm dotprod), generic aarch64 (no dotprod), riscv64-rvv (C backend) and the x86_64
presets, run (under qemu-user for the foreign ones) and compared with onnxruntime running the same
QDQ model: equal or one output quantization step apart. The instructions the int8 kernels use
are read from the disassembly of the built libraries (compiler.disasm): ``sdot`` on rpi5 and none
without dotprod; RVV widening multiply-accumulates on riscv64-rvv."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from compiler.disasm import kernel_instructions
from compiler.emulate import run_emulated, run_emulated_many
from compiler.manifest import Manifest
from tests.fixtures_int8 import ZOO_INT8, int8_input, steps_from_reference

# RVV instructions that multiply-accumulate int8 products (widening, or after vsext in int32)
_RVV_MACS = ("vwmacc.vv", "vwmacc.vx", "vwmaccu.vx", "vmacc.vv", "vmacc.vx", "vwmul.vv", "vwmul.vx")


def _int8_kernels(art: Path) -> dict[str, Counter[str]]:
    """Instruction counts of the artifact's conv2d / matmul kernels (what integer.py made int8,
    generic or the target's own ``fractal_int8_*``)."""
    man = Manifest.read(art)
    kernels = kernel_instructions(art / man.libs.infer, man.arch)
    return {k: c for k, c in kernels.items()
            if "conv2d" in k or "matmul" in k or k.startswith("fractal_int8_")}


@pytest.mark.emulate
@pytest.mark.slow
def test_aarch64_int8_builds_use_sdot_with_dotprod_and_match_onnxruntime_under_qemu(
        int8_build: Callable[..., Path], qdq_model: Callable[[str], Path]) -> None:
    rpi5 = {name: int8_build(name, "rpi5") for name in ZOO_INT8}
    plain = {name: int8_build(name, "aarch64") for name in ("ds-cnn-kws", "fc-autoencoder")}
    for name, art in rpi5.items():
        kernels = _int8_kernels(art)
        with_sdot = [k for k, c in kernels.items() if c["sdot"]]
        assert with_sdot, (name, kernels)
        if name in ("ds-cnn-kws", "resnet8-cifar10", "mobilenet-v1-0.25-vww"):
            # the CNNs' pointwise / k x k convolutions (input channels innermost: int8_arm)
            assert any("conv2d" in k for k in with_sdot), (name, with_sdot)
        if name == "fc-autoencoder":
            # its [K, N] matmuls as [N, K] row dot products (int8_depthwise.DepthwiseKernels.matmul):
            # all but the 8-wide bottleneck's (K = 8: too short to vectorise)
            assert len(with_sdot) >= 9, kernels
        if name in ("ds-cnn-kws", "mobilenet-v1-0.25-vww"):
            # depthwise: compiler.int8_depthwise's kernel, NEON widening multiply-accumulates
            dw = [c for k, c in kernels.items() if k.startswith("fractal_int8_depthwise")]
            assert dw and all(c["smull"] + c["smull2"] and c["saddw"] + c["saddw2"] for c in dw), (name, dw)
    for name, art in plain.items():  # no dotprod in the target: no sdot anywhere
        assert not any(c["sdot"] for c in _int8_kernels(art).values()), name
    # one emulated process runs them all (qemu-aarch64's default CPU has the dot product)
    runs = [(art, int8_input(name)) for name, art in (*rpi5.items(), *plain.items())]
    outs = run_emulated_many(runs)
    names = [*rpi5, *plain]
    for name, (_, inputs), out in zip(names, runs, outs, strict=True):
        assert steps_from_reference(qdq_model(name), inputs, next(iter(out.values()))) <= 1.001, name


@pytest.mark.slow
def test_riscv64_rvv_int8_builds_use_vector_macs(int8_build: Callable[..., Path]) -> None:
    """(Not run here: Debian's qemu-riscv64 7.2 aborts translating ``vfncvt.rtz.x.f.w``, which LLVM
    emits for the vectorised quantize, QEMU issue 1441, fixed in 8.0; the arithmetic of the same
    C-backend kernels is checked on rv64gc under qemu below.)"""
    for name in ZOO_INT8:
        kernels = _int8_kernels(int8_build(name, "riscv64-rvv"))
        scalar = [k for k, c in kernels.items() if not any(c[m] for m in _RVV_MACS)]
        # every one vectorised but a few depthwise convolutions on 3x3 / 6x6 maps (mobilenet)
        assert len(scalar) <= 3, (name, scalar)
        assert sum(c["vle8.v"] for c in kernels.values()), name  # int8 vector loads


@pytest.mark.emulate
@pytest.mark.slow
def test_riscv64_int8_builds_match_onnxruntime_under_qemu(int8_build: Callable[..., Path],
                                                          qdq_model: Callable[[str], Path]) -> None:
    for name in ZOO_INT8:
        art = int8_build(name, "riscv64")
        inputs = int8_input(name)
        got = next(iter(run_emulated(art, inputs).values()))  # fractal-run under qemu-riscv64
        assert steps_from_reference(qdq_model(name), inputs, got) <= 1.001, name


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["x86_64-avx2", "x86_64-avx512"])
def test_x86_presets_build_every_int8_zoo_model(preset: str, int8_build: Callable[..., Path],
                                                qdq_model: Callable[[str], Path]) -> None:
    """(x86_64 itself: test_integer.py. The naive lowering: the arithmetic is what is checked
    here; x86 int8 scheduling is another test's subject. An AVX-512 build runs where the CPU has
    AVX-512, as in test_avx512.py: qemu's TCG has no AVX-512 to emulate it.)"""
    from compiler import get_preset, load_artifact
    from compiler.tuning import can_measure

    runs_here = can_measure(get_preset(preset).target)[0]
    for name in ZOO_INT8:
        art = int8_build(name, preset, default_schedules=False)
        assert any(s.startswith("integer_kernels(") for s in Manifest.read(art).prepared_steps)
        if not runs_here:
            continue
        inputs = int8_input(name)
        got = next(iter(load_artifact(art).infer(inputs).values()))
        assert steps_from_reference(qdq_model(name), inputs, got) <= 1.001, (name, preset)


def test_targets_that_get_the_board_int8_layouts() -> None:
    from compiler.int8_arm import dot_product_target
    from compiler.int8_rvv import rvv_target
    from compiler.targets import PRESETS

    assert {n for n, p in PRESETS.items() if dot_product_target(p.tvm_target())} == {"rpi5"}
    assert {n for n, p in PRESETS.items() if rvv_target(p.tvm_target())} == {"riscv64-rvv"}


def test_a_quantized_convolution_runs_on_sdot_only_where_the_target_has_dotprod(tmp_path: Path) -> None:
    """One 3x3 convolution over 16 channels (QDQ): its int8 kernel has ``sdot`` for rpi5 (NHWC /
    OHWI, int8_arm's schedule) and none for rpi4 (Cortex-A72, no dotprod)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from compiler import compile_model
    from compiler.quantize import quantize_int8

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 16, 8, 8]) for n in "xy")
    graph = helper.make_graph(nodes, "conv", [x], [y], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "conv.onnx"))
    np.savez(tmp_path / "cal.npz", x=rng.standard_normal((8, 16, 8, 8)).astype(np.float32))
    qdq = quantize_int8(tmp_path / "conv.onnx", tmp_path / "cal.npz", tmp_path / "conv.int8.onnx")[0]
    sdot = {}
    for preset in ("rpi5", "rpi4"):
        art = compile_model(qdq, target=preset, out_dir=tmp_path / preset, progress=False, integer=True)
        kernels = _int8_kernels(art)
        assert kernels and all("conv2d" in k for k in kernels), kernels
        sdot[preset] = sum(c["sdot"] for c in kernels.values())
    assert sdot["rpi5"] > 0 and sdot["rpi4"] == 0, sdot
