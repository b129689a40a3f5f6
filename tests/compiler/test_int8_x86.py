"""x86 int8 dot-product kernels (compiler/int8_x86.py): one tensorized convolution checked against
numpy's integer arithmetic, and the instructions the compiled libraries contain (objdump): AVX2's
vpmaddubsw + vpmaddwd (u8 x s8 quads, where no int16 pair sum can saturate) or vpmaddwd alone
(exact int16 pairs, where it could), and VNNI's vpdpbusd. The VNNI kernels run where the CPU has
AVX-512 VNNI (qemu 7.2 has no AVX-512 to emulate it); on an AVX2 CPU only their disassembly is
checked. The zoo models on these kernels are compared with onnxruntime in test_integer.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from compiler import compile_model, int8_x86
from compiler.disasm import kernel_instructions
from compiler.int8_depthwise import DEPTHWISE
from compiler.manifest import Manifest
from compiler.targets import get_preset
from tests.compiler.test_integer import _qdq


def _disassembly(lib: Path) -> str:
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True,
                          text=True, check=True).stdout


def _reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray, scale: np.ndarray, zx: int, sy: float,
               zy: int, stride: int, pad: int) -> np.ndarray:
    """round((conv(x - zx, w) + bias) * (scale / sy)) + zy in int64 / float32 (the kernels' one
    multiplier per channel, compiler.int8_depthwise.multiplier), NCHW, ReLU on the grid."""
    o, _, kh, kw = w.shape
    xp = np.pad(x.astype(np.int64) - zx, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (xp.shape[2] - kh) // stride + 1, (xp.shape[3] - kw) // stride + 1
    acc = np.zeros((x.shape[0], o, oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            win = xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
            acc += np.einsum("nchw,oc->nohw", win, w[:, :, i, j].astype(np.int64))
    mult = (scale.astype(np.float64) / sy).astype(np.float32)
    real = (acc + bias.reshape(1, o, 1, 1)).astype(np.float32) * mult.reshape(1, o, 1, 1)
    return np.clip(np.round(real) + zy, max(-128, zy), 127).astype(np.int8)


@pytest.mark.parametrize(("preset", "wmax", "instructions"), [
    ("x86_64-avx2", 64, {"vpmaddubsw", "vpmaddwd"}),
    ("x86_64-avx2", 127, {"vpmaddwd"}),
    ("x86_64-avx512-vnni", 127, {"vpdpbusd"}),
])
def test_int8_kernel_equals_integer_arithmetic_and_uses_the_dot_instructions(
        preset: str, wmax: int, instructions: set[str], tmp_path: Path) -> None:
    """AVX2, |w| <= 64: no vpmaddubsw pair sum can leave int16 (255 * 64 * 2 < 32768), so the u8 x
    s8 quads run; full-range weights could saturate, so the exact int16 pairs run. VNNI's vpdpbusd
    sums into int32 and never saturates. Each equals the integer arithmetic exactly (3 input
    channels: the merged window-row reduction, stride 2), run where this CPU has the preset's
    features (VNNI: on an AVX-512 VNNI CPU; elsewhere its instructions only)."""
    import tvm
    from tvm import relax

    from compiler.tuning import can_measure

    target = get_preset(preset).tvm_target()
    kern = int8_x86.kernels(target)
    assert kern is not None
    rng = np.random.default_rng(wmax)
    w = rng.integers(-wmax, wmax + 1, (24, 3, 3, 3)).astype(np.int8)
    w[0, 0, 0, :2] = wmax  # a pair at the bound
    bias = rng.integers(-3000, 3000, 24)
    scale = (rng.random(24) * 0.01 + 0.001).astype(np.float32)
    zx, sy, zy = -7, 0.05, 3
    x = relax.Var("x", relax.TensorType([1, 3, 17, 17], "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        # (bias as compiler.integer passes it: the -zx * sum(w) term folded in)
        folded = bias - zx * w.astype(np.int64).reshape(24, -1).sum(axis=1)
        out = kern.conv2d(x, w, folded, scale, zx=zx, sy=sy, zy=zy, out_dtype="int8", relu=True,
                          strides=(2, 2), dilation=(1, 1), pads=(1, 1, 1, 1), groups=1)
        bb.emit_func_output(bb.emit(out))
    mod = bb.get()
    for gv, f in kern.funcs:
        mod[gv] = f
    ex = relax.build(relax.transform.LegalizeOps()(mod), target)
    ex.export_library(str(tmp_path / "k.so"))
    asm = _disassembly(tmp_path / "k.so")
    assert {i for i in ("vpmaddubsw", "vpmaddwd", "vpmulld", "vpdpbusd") if i in asm} == instructions
    if not can_measure(get_preset(preset).target)[0]:
        return
    xi = rng.integers(-128, 128, (1, 3, 17, 17)).astype(np.int8)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(xi)).numpy()
    np.testing.assert_array_equal(got, _reference(xi, w, bias, scale, zx, sy, zy, 2, 1))


@pytest.mark.slow
def test_vnni_build_runs_its_int8_kernels_on_vpdpbusd(tmp_path: Path) -> None:
    """The x86_64-avx512-vnni preset: every non-depthwise quantized convolution and the matmul of
    ds-cnn-kws on the vpdpbusd intrinsic, and the library holds vpdpbusd; the depthwise ones on
    the fused kernel with zmm multiplies. On a VNNI CPU every zoo model's VNNI build runs and
    matches onnxruntime on the same QDQ model (within one output step; elsewhere, the
    instructions only)."""
    qdq = _qdq("ds-cnn-kws", tmp_path)
    art = compile_model(qdq, target="x86_64-avx512-vnni", out_dir=tmp_path / "art", progress=False,
                        integer=True)
    steps = Manifest.read(art).prepared_steps
    assert f"dot_product_kernels(10 of them: 4 {DEPTHWISE}, 6 {int8_x86.VNNI_DOT_16X4})" in steps
    lib = json.loads((art / "manifest.json").read_text())["libs"]["infer"]
    asm = _disassembly(art / lib)
    assert asm.count("vpdpbusd") >= 6 and "vpmaddubsw" not in asm
    # the depthwise ones: compiler.int8_depthwise's kernel on 512-bit vectors (16 channels each)
    dw = {k: c for k, c in kernel_instructions(art / lib, "x86_64").items()
          if k.startswith("fractal_int8_depthwise")}
    assert len(dw) == 4 and all(c["vpmulld"] >= 18 for c in dw.values()), dw
    for name in dw:
        assert "zmm" in asm.split(f"<{name}_compute_>:")[1].split("\n\n")[0], name
    from compiler import load_artifact
    from compiler.tuning import can_measure
    from tests.fixtures_int8 import int8_input, steps_from_reference

    if not can_measure(get_preset("x86_64-avx512-vnni").target)[0]:
        return
    for name in ("ds-cnn-kws", "resnet8-cifar10", "mobilenet-v1-0.25-vww", "fc-autoencoder"):
        model = qdq if name == "ds-cnn-kws" else _qdq(name, tmp_path)
        built = art if name == "ds-cnn-kws" else compile_model(
            model, target="x86_64-avx512-vnni", out_dir=tmp_path / f"{name}-art", progress=False,
            integer=True)
        inputs = int8_input(name)
        got = next(iter(load_artifact(built).infer(inputs).values()))
        assert steps_from_reference(model, inputs, got) <= 1.001, name
