"""Every target preset compiles and links to the right ELF; the manifest records what it must."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess

import numpy as np
import pytest

from compiler import PRESETS, TargetError, compile_model, get_preset, host_preset_name, load_artifact
from compiler.manifest import file_sha256
from compiler.targets import host_arch
from compiler.tuning import can_measure

_EM = {"x86_64": 62, "aarch64": 183, "riscv64": 243}
EF_RISCV_RVC, EF_RISCV_FLOAT_ABI_MASK, EF_RISCV_FLOAT_ABI_DOUBLE = 0x1, 0x6, 0x4


def _elf_header(path):
    data = path.read_bytes()[:64]
    assert data[:4] == b"\x7fELF", f"{path} is not ELF"
    assert data[4] == 2, "not ELF64"
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    (e_flags,) = struct.unpack_from("<I", data, 48)
    return e_type, e_machine, e_flags


def test_presets_table():
    assert set(PRESETS) >= {"x86_64", "x86_64-avx2", "aarch64", "rpi4", "rpi5", "riscv64", "riscv64-rvv"}
    assert get_preset("rpi4").target["mcpu"] == "cortex-a72"
    assert get_preset("rpi5").target["mcpu"] == "cortex-a76"
    assert "+neon" in get_preset("aarch64").target["mattr"]
    assert "+v" in get_preset("riscv64-rvv").target["mattr"]
    assert "+v" not in get_preset("riscv64").target["mattr"]
    assert get_preset("riscv64").cross_compiler == "riscv64-linux-gnu-g++"
    assert get_preset("x86_64").cross_compiler is None
    assert host_preset_name() == host_arch()
    for p in PRESETS.values():
        assert p.tvm_target().kind.name == "llvm"  # every dict is a valid TVM target
    with pytest.raises(TargetError, match="unknown target preset"):
        get_preset("x86")


def test_cli_targets_lists_every_preset(run_cli):
    """One row per preset in columns as wide as their longest entry (`x86_64-avx512-vnni` pushed
    the rest out of line before), then the preset `--target native` picks on this machine."""
    from compiler.targets import native_preset

    res = run_cli("targets")
    assert res.code == 0
    table, _, native = res.out.partition("\n\n")
    lines = table.splitlines()
    assert [ln.split()[0] for ln in lines] == ["preset", *PRESETS]
    start = lines[0].index("description")
    for ln, p in zip(lines[1:], PRESETS.values(), strict=True):
        assert ln[start:] == p.description and ln[start - 1] == " ", ln
    name, why = native_preset()
    assert native.strip() == f"native (this machine): {name} ({why})"


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(PRESETS))
def test_compile_every_preset(preset, tmp_path, mlp_onnx):
    from compiler import TrainSettings

    p = get_preset(preset)
    train = TrainSettings(loss="ce", optimizer="sgd", batch=2) if preset in ("rpi4", "riscv64-rvv") else None
    out = compile_model(mlp_onnx, target=preset, out_dir=tmp_path / preset, train=train, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    libs = [manifest["libs"]["infer"]] + ([manifest["libs"]["train"]] if train else [])
    for lib in libs:
        e_type, e_machine, e_flags = _elf_header(out / lib)
        assert e_type == 3, "not a shared object"
        assert e_machine == _EM[p.arch], (lib, e_machine)
        if p.arch == "riscv64":
            assert e_flags & EF_RISCV_FLOAT_ABI_MASK == EF_RISCV_FLOAT_ABI_DOUBLE
            assert e_flags & EF_RISCV_RVC
    if shutil.which("file") and p.arch == "riscv64":
        desc = subprocess.run(["file", "-b", str(out / libs[0])], capture_output=True, text=True).stdout
        assert "RISC-V" in desc and "64-bit" in desc and "double-float ABI" in desc, desc
    assert manifest["target"]["preset"] == preset
    assert manifest["target"]["tvm_target"] == p.target
    if p.arch == host_arch() and can_measure(p.target)[0]:  # (needs this CPU's features, e.g. AVX-512)
        art = load_artifact(out)
        x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
        ref = load_artifact(out).infer({"x": x})["y"]
        assert np.isfinite(ref).all() and art.infer({"x": x})["y"].shape == (3, 4)


def test_manifest_contents(compiler_digits_artifact, compiler_digits_onnx):
    import tvm

    m = json.loads((compiler_digits_artifact / "manifest.json").read_text())
    assert m["format_version"] == 1
    assert m["name"] == "digits-mlp"
    assert m["onnx_sha256"] == file_sha256(compiler_digits_onnx)
    assert m["tvm_version"] == tvm.__version__
    assert m["target"]["preset"] == host_preset_name() and m["target"]["arch"] == host_arch()
    assert m["inputs"] == [{"name": "x", "shape": [1, 64], "dtype": "float32"}]
    assert m["outputs"] == [{"name": "logits", "shape": [1, 10], "dtype": "float32"}]
    assert set(m["files"]) == {"infer.so", "train.so", "params.npz"}
    for rel, digest in m["files"].items():
        assert file_sha256(compiler_digits_artifact / rel) == digest
    assert m["tuning"]["tuned"] is False
    t = m["training"]
    assert (t["loss"], t["optimizer"], t["lr"], t["batch"]) == ("ce", "sgd", 0.1, 32)
    assert m["params"]["shapes"] == [[64, 64], [64], [64, 10], [10]]
    assert t["targets"] == {"name": "targets", "shape": [32], "dtype": "int64"}
    assert m["created"].startswith("20")
    art = load_artifact(compiler_digits_artifact)
    assert art.name == "digits-mlp"
    assert [s.name for s in art.inputs] == ["x"] and art.inputs[0].shape == (1, 64)
    assert [p.shape for p in art.params] == [(64, 64), (64,), (64, 10), (10,)]


def test_name_option_and_no_training(run_cli, tmp_path, mlp_onnx):
    res = run_cli(
        "compile", mlp_onnx, "--target", host_preset_name(), "--out", tmp_path / "a", "--name", "sensor", "-q"
    )
    assert res.code == 0, res.err
    art = load_artifact(tmp_path / "a")
    assert art.name == "sensor"
    assert art.trainer is None
    assert art.manifest.training is None and "train.so" not in art.manifest.files


def test_symbolic_batch_model_compiles_and_takes_any_batch(tmp_path):
    import onnxruntime as ort

    from tests.compiler.models import mlp, save

    path = save(mlp(batch="N")[0], tmp_path / "dyn.onnx")
    out = compile_model(
        path,
        target=host_preset_name(),
        out_dir=tmp_path / "a",
        progress=False,
        train=__import__("compiler").TrainSettings(loss="mse", batch=3),
    )
    art = load_artifact(out)
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(art.infer({"x": x})["y"], want, atol=1e-4)
    assert art.trainer.batch == 3


def test_recompile_replaces_an_existing_artifact(tmp_path, mlp_onnx):
    out = compile_model(mlp_onnx, target=host_preset_name(), out_dir=tmp_path / "a", progress=False)
    first = (out / "manifest.json").read_text()
    out = compile_model(
        mlp_onnx, target=host_preset_name(), out_dir=tmp_path / "a", name="again", progress=False
    )
    assert json.loads((out / "manifest.json").read_text())["name"] == "again" != json.loads(first)["name"]
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no temp dirs left behind


def test_cli_compile_with_training_flags(run_cli, tmp_path, mlp_onnx):
    res = run_cli(
        "compile",
        mlp_onnx,
        "--target",
        host_preset_name(),
        "--out",
        tmp_path / "t",
        "--train",
        "--loss",
        "mse",
        "--optimizer",
        "adam",
        "--lr",
        "0.02",
        "--batch",
        "3",
        "-q",
    )
    assert res.code == 0, res.err
    assert res.out.strip() == str(tmp_path / "t")
    tr = load_artifact(tmp_path / "t").trainer
    assert (tr.loss, tr.optimizer, tr.lr, tr.batch) == ("mse", "adam", 0.02, 3)
    assert len(tr.init_state(load_artifact(tmp_path / "t").params)) == 3 + 2 * 4


@pytest.mark.parametrize("verb", ["compile", "predict", "verify", "targets"])
def test_every_verb_has_help(run_cli, verb):
    res = run_cli(verb, "--help")
    assert res.code == 0 and "Usage" in res.out


def test_artifact_needing_missing_cpu_features_is_refused(compiler_digits_artifact, tmp_path, run_cli):
    """An artifact built for instructions this CPU lacks fails to load with a clear error, not SIGILL."""
    from compiler import ArtifactError

    art = tmp_path / "art"
    shutil.copytree(compiler_digits_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["target"]["tvm_target"]["mattr"] = ["+sse2", "+avx9000x", "+amx-fp99"]
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"lacks: amx-fp99, avx9000x"):
        load_artifact(art)
    res = run_cli("predict", art, "--input", tmp_path / "x.npz", "--output", tmp_path / "y.npz")
    assert res.code == 1 and "needs CPU features" in res.err
    # the unmodified artifact (generic x86-64) still loads
    assert load_artifact(compiler_digits_artifact).name == "digits-mlp"


def test_cpu_features_are_read_in_llvm_spelling(compiler_digits_artifact, tmp_path, monkeypatch):
    """/proc/cpuinfo writes ``avx512_vnni`` where presets and manifests write LLVM's ``avx512vnni``
    (and ``sse4_1`` for ``sse4.1``): an x86_64-avx512-vnni artifact loads on a VNNI CPU. Before, every
    VNNI artifact was refused on the very machines it was built for."""
    from compiler import ArtifactError
    from compiler import artifact as artifact_mod
    from compiler.targets import feature_names, get_preset

    # the flags line of an AMD EPYC (Zen 4) with AVX-512 VNNI, cut to the x86 vector features
    line = "sse sse2 pni ssse3 fma sse4_1 sse4_2 avx avx2 abm avx512f avx512dq avx512cd avx512bw avx512vl " \
           "avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq"
    names = feature_names(set(line.split()))
    assert {"avx512vnni", "avx512bf16", "avx512vbmi2", "sse4.1", "sse4.2", "sse3", "lzcnt"} <= names
    need = {f[1:] for f in get_preset("x86_64-avx512-vnni").target["mattr"] if f.startswith("+")}
    assert need <= names
    art = tmp_path / "art"
    shutil.copytree(compiler_digits_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["target"]["tvm_target"]["mattr"] = sorted(f"+{f}" for f in need)
    (art / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(artifact_mod, "cpu_flags", lambda: names)
    artifact_mod._check_cpu_features(artifact_mod.Manifest.read(art))  # loads: nothing lacking
    monkeypatch.setattr(artifact_mod, "cpu_flags", lambda: names - {"avx512vnni", "avx512_vnni"})
    with pytest.raises(ArtifactError, match=r"lacks: avx512vnni"):
        artifact_mod._check_cpu_features(artifact_mod.Manifest.read(art))
