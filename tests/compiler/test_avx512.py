"""The x86_64-avx512 preset: LLVM emits 512-bit code for it, and it matches onnxruntime on an AVX-512 host."""

from __future__ import annotations

import subprocess

import numpy as np
import onnxruntime as ort
import pytest

from compiler import compile_model, get_preset, load_artifact
from compiler import targets as targets_mod
from compiler.tuning import can_measure


def test_preset_fields():
    p = get_preset("x86_64-avx512")
    assert p.arch == "x86_64" and p.cross_compiler is None
    assert p.target["mcpu"] == "skylake-avx512"
    assert {"+avx512f", "+avx512bw", "+avx512dq", "+avx512vl"} <= set(p.target["mattr"])
    assert "-prefer-256-bit" in p.target["mattr"]
    assert p.tvm_target().kind.name == "llvm"


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ({"sse2"}, "x86_64"),
        ({"sse2", "avx2", "fma"}, "x86_64-avx2"),
        ({"sse2", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}, "x86_64-avx512"),
        ({"sse2", "avx2", "fma", "avx512f"}, "x86_64-avx2"),  # Knights Landing-like: no BW/DQ/VL
        (set(), "x86_64"),
    ],
)
def test_best_host_preset_follows_cpu_flags(monkeypatch, flags, want):
    monkeypatch.setattr(targets_mod, "host_arch", lambda: "x86_64")
    monkeypatch.setattr(targets_mod, "cpu_flags", lambda: flags)
    assert targets_mod.best_host_preset_name() == want


def test_avx512_artifact_uses_zmm_and_matches_onnxruntime(tmp_path, mlp_onnx):
    out = compile_model(mlp_onnx, target="x86_64-avx512", out_dir=tmp_path / "a", progress=False)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(out / "infer.so")],
                         capture_output=True, text=True, check=True).stdout
    assert "%zmm" in asm, "no 512-bit vector code in the avx512 build"
    ok, why = can_measure(get_preset("x86_64-avx512").target)
    if not ok:  # this CPU cannot run it: the tuner must say so instead of crashing on SIGILL
        assert "lacks avx512" in why or "lacks avx2" in why or "lacks fma" in why
        return
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    sess = ort.InferenceSession(str(mlp_onnx), providers=["CPUExecutionProvider"])
    want = np.concatenate([sess.run(None, {"x": x[i:i + 1]})[0] for i in range(5)])
    np.testing.assert_allclose(load_artifact(out).infer({"x": x})["y"], want, atol=1e-5)
