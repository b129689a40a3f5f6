"""aarch64 artifacts run under qemu-user in the aarch64 sysroot and match x86 (and onnxruntime);
riscv64 artifacts (C backend) are RISC-V ELF and run under qemu-riscv64 (see also test_cbackend.py)."""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest

from compiler import host_preset_name, load_artifact
from compiler.emulate import EM_AARCH64, EM_RISCV, EM_X86_64, elf_info, run_emulated, sysroot_dir
from compiler.errors import ArtifactError, EmulationError
from compiler.runner import main as runner_main


@pytest.fixture(scope="module")
def inputs(emulate_onnx):
    rng = np.random.default_rng(7)
    return {"x": rng.standard_normal((2, 1, 49, 10)).astype(np.float32)}


@pytest.fixture(scope="module")
def x86_outputs(foreign_artifact, inputs):
    return load_artifact(foreign_artifact(host_preset_name())).infer(inputs)


@pytest.mark.emulate
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["aarch64", "rpi4"])
def test_emulated_aarch64_matches_x86_and_onnxruntime(preset, foreign_artifact, inputs, x86_outputs,
                                                      emulate_onnx):
    art = foreign_artifact(preset)
    assert elf_info(art / "infer.so").machine == EM_AARCH64
    got = run_emulated(art, inputs)
    assert list(got) == ["logits"] and got["logits"].shape == (2, 12)
    np.testing.assert_allclose(got["logits"], x86_outputs["logits"], rtol=0, atol=1e-4)
    ref = ort.InferenceSession(str(emulate_onnx), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    np.testing.assert_allclose(got["logits"], ref, rtol=0, atol=1e-4)


def test_aarch64_artifact_is_refused_natively(foreign_artifact):
    with pytest.raises(ArtifactError, match="compiled for aarch64"):
        load_artifact(foreign_artifact("aarch64"))


@pytest.mark.emulate
def test_emulated_failure_is_relayed_as_one_line(foreign_artifact, inputs, tmp_path):
    # a tampered library: the runner inside qemu refuses it, and that reason comes back
    bad = shutil.copytree(foreign_artifact("aarch64"), tmp_path / "bad")
    with open(bad / "infer.so", "r+b") as fh:
        fh.seek(4096)
        b = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(EmulationError) as ei:
        run_emulated(bad, inputs)
    msg = str(ei.value)
    assert "emulated aarch64 run failed" in msg and "sha256" in msg and "\n" not in msg


def test_missing_sysroot_is_a_clear_error(foreign_artifact, inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("FRACTAL_SYSROOT_AARCH64", str(tmp_path / "nowhere"))
    assert sysroot_dir() == tmp_path / "nowhere"
    with pytest.raises(EmulationError) as ei:
        run_emulated(foreign_artifact("aarch64"), inputs)
    assert "no aarch64 Python sysroot" in str(ei.value) and "make sysroot" in ei.value.hint


def test_missing_qemu_is_a_clear_error(foreign_artifact, inputs, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(EmulationError) as ei:
        run_emulated(foreign_artifact("aarch64"), inputs)
    assert "qemu-aarch64 is not installed" in str(ei.value) and "qemu-user" in ei.value.hint


def test_default_sysroot_is_in_repo_cache(monkeypatch):
    monkeypatch.delenv("FRACTAL_SYSROOT_AARCH64", raising=False)
    assert sysroot_dir().parts[-2:] == (".cache", "sysroot-aarch64")


@pytest.mark.emulate
@pytest.mark.parametrize("preset", ["riscv64", "riscv64-rvv"])
def test_riscv_artifacts_are_riscv64_and_run_under_qemu(preset, foreign_artifact, inputs, x86_outputs):
    art = foreign_artifact(preset)
    info = elf_info(art / "libmodel.so")
    assert (info.machine, info.bits, info.little_endian, info.shared_object) == (EM_RISCV, 64, True, True)
    assert info.arch == "riscv64"
    assert info.flags & 0x6 == 0x4  # EF_RISCV_FLOAT_ABI_DOUBLE: the lp64d ABI Debian's libs use
    # the RISC-V attributes section names the ISA; only the rvv preset has the vector extension
    isa = (art / "libmodel.so").read_bytes()
    arch_string = isa[isa.find(b"rv64i"):][:120]
    assert arch_string.startswith(b"rv64i")
    assert (b"_v1p0" in arch_string) == (preset == "riscv64-rvv")
    assert elf_info(art / "fractal-run").machine == EM_RISCV
    # the C backend's runner under qemu-riscv64 agrees with the x86_64 Relax VM
    got = run_emulated(art, inputs)
    np.testing.assert_allclose(got["logits"], x86_outputs["logits"], rtol=0, atol=1e-4)


def test_host_artifact_is_x86_elf(foreign_artifact):
    info = elf_info(foreign_artifact(host_preset_name()) / "infer.so")
    assert info.machine == EM_X86_64 and info.bits == 64 and info.shared_object


def test_elf_info_rejects_non_elf(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"not an elf at all" * 8)
    with pytest.raises(EmulationError, match="not an ELF file"):
        elf_info(p)


def test_runner_round_trip_on_host(foreign_artifact, inputs, x86_outputs, tmp_path, capsys):
    np.savez(tmp_path / "in.npz", **inputs)
    assert runner_main([str(foreign_artifact(host_preset_name())), str(tmp_path / "in.npz"),
                        str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_array_equal(out["logits"], x86_outputs["logits"])
    np.savez(tmp_path / "bad.npz", wrong=inputs["x"])
    assert runner_main([str(foreign_artifact(host_preset_name())), str(tmp_path / "bad.npz"),
                        str(tmp_path / "o2.npz")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and not (tmp_path / "o2.npz").exists()
