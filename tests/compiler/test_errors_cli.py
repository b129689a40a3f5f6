"""Every user error of the compiler verbs: one `error: ... (help: ...)` line and exit code 1."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.compiler.models import IR_VERSION, OPSET, save


def _one_line_error(res, *needles: str) -> str:
    assert res.code == 1, (res.code, res.out, res.err)
    line = res.error_line
    for needle in needles:
        assert needle in line, line
    assert "(help: " in line, line
    return line


def test_corrupt_file(run_cli, tmp_path):
    bad = tmp_path / "corrupt.onnx"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    _one_line_error(run_cli("compile", bad, "--target", "x86_64", "--out", tmp_path / "o"), "corrupt.onnx")
    assert not (tmp_path / "o").exists()


def test_text_file_is_not_onnx(run_cli, tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not a model\n")
    _one_line_error(run_cli("compile", bad, "--target", "x86_64", "--out", tmp_path / "o"), "notes.onnx")


def test_truncated_model(run_cli, tmp_path, mlp_onnx):
    bad = tmp_path / "trunc.onnx"
    bad.write_bytes(mlp_onnx.read_bytes()[:-37])
    _one_line_error(run_cli("compile", bad, "--target", "x86_64", "--out", tmp_path / "o"), "trunc.onnx")


def test_missing_model_file(run_cli, tmp_path):
    _one_line_error(
        run_cli("compile", tmp_path / "nope.onnx", "--target", "x86_64", "--out", tmp_path / "o"), "not found"
    )


def test_unsupported_operator_names_op_and_node(run_cli, tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu0"),
            # random sampling: no converter, and nothing to rewrite it into
            helper.make_node("Bernoulli", ["r"], ["y"], name="my_coin"),
        ],
        "g",
        [x],
        [y],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = IR_VERSION
    path = save(m, tmp_path / "coin.onnx")
    _one_line_error(
        run_cli("compile", path, "--target", "x86_64", "--out", tmp_path / "o"),
        "unsupported operator 'Bernoulli'",
        "'my_coin'",
    )


def test_custom_domain_operator(run_cli, tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph(
        [helper.make_node("Fancy", ["x"], ["y"], name="fancy0", domain="com.acme")], "g", [x], [y]
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.acme", 1)]
    )
    m.ir_version = IR_VERSION
    path = save(m, tmp_path / "fancy.onnx")
    _one_line_error(
        run_cli("compile", path, "--target", "x86_64", "--out", tmp_path / "o"), "com.acme::Fancy", "'fancy0'"
    )


def test_dynamic_non_batch_dimension_names_the_input(run_cli, tmp_path):
    x = helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", "width"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "width"])
    g = helper.make_graph([helper.make_node("Relu", ["features"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = IR_VERSION
    path = save(m, tmp_path / "dyn.onnx")
    _one_line_error(
        run_cli("compile", path, "--target", "x86_64", "--out", tmp_path / "o"),
        "input 'features'",
        "dimension 1",
        "'width'",
    )


def test_unknown_target(run_cli, tmp_path, mlp_onnx):
    line = _one_line_error(
        run_cli("compile", mlp_onnx, "--target", "esp32", "--out", tmp_path / "o"),
        "unknown target preset 'esp32'",
    )
    assert "rpi4" in line


def test_missing_cross_compiler(run_cli, tmp_path, mlp_onnx, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    _one_line_error(
        run_cli("compile", mlp_onnx, "--target", "rpi4", "--out", tmp_path / "o"),
        "aarch64-linux-gnu-g++",
        "not found",
    )


def test_bad_training_settings(run_cli, tmp_path, mlp_onnx):
    _one_line_error(
        run_cli(
            "compile", mlp_onnx, "--target", "x86_64", "--out", tmp_path / "o", "--train", "--loss", "hinge"
        ),
        "bad training settings",
    )


def test_refuses_to_overwrite_a_non_artifact_dir(run_cli, tmp_path, mlp_onnx):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.txt").write_text("do not delete")
    _one_line_error(run_cli("compile", mlp_onnx, "--target", "x86_64", "--out", out), "not an artifact")
    assert (out / "thesis.txt").read_text() == "do not delete"


@pytest.fixture
def artifact_copy(tmp_path, compiler_digits_artifact) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(compiler_digits_artifact, dst)
    return dst


def _npz(tmp_path, **arrays) -> Path:
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    return path


def _predict(run_cli, tmp_path, artifact, **arrays):
    """``fractal predict ARTIFACT --input IN.npz --output o.npz`` (default input: one digits row)."""
    inp = _npz(tmp_path, **(arrays or {"x": np.zeros((1, 64), np.float32)}))
    return run_cli("predict", artifact, "--input", inp, "--output", tmp_path / "o.npz")


def test_missing_artifact_file(run_cli, tmp_path, artifact_copy):
    (artifact_copy / "params.npz").unlink()
    res = _predict(run_cli, tmp_path, artifact_copy)
    _one_line_error(res, "'params.npz' is missing")


def test_sha256_mismatch(run_cli, tmp_path, artifact_copy):
    lib = artifact_copy / "infer.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    res = _predict(run_cli, tmp_path, artifact_copy)
    _one_line_error(res, "'infer.so' fails its sha256 check")


def test_not_an_artifact_dir(run_cli, tmp_path):
    (tmp_path / "empty").mkdir()
    res = _predict(run_cli, tmp_path, tmp_path / "empty")
    _one_line_error(res, "no manifest.json")


def test_bad_manifest_json(run_cli, tmp_path, artifact_copy):
    (artifact_copy / "manifest.json").write_text("{not json")
    res = _predict(run_cli, tmp_path, artifact_copy)
    _one_line_error(res, "not valid JSON")


@pytest.mark.parametrize(
    ("arrays", "needle"),
    [
        ({"input": np.zeros((1, 64), np.float32)}, "missing input(s) 'x'; unknown input(s) 'input'"),
        ({"x": np.zeros((2, 65), np.float32)}, "input 'x' has shape [2, 65], expected [N, 64]"),
        ({"x": np.zeros((2, 64), np.float64)}, "input 'x' has dtype float64, expected float32"),
        ({"x": np.zeros((2, 64), np.float32), "extra": np.zeros(1)}, "unknown input(s) 'extra'"),
    ],
)
def test_predict_bad_npz(run_cli, tmp_path, compiler_digits_artifact, arrays, needle):
    res = _predict(run_cli, tmp_path, compiler_digits_artifact, **arrays)
    _one_line_error(res, needle)
    assert not (tmp_path / "o.npz").exists()


def test_predict_not_an_npz(run_cli, tmp_path, compiler_digits_artifact):
    bad = tmp_path / "in.npz"
    bad.write_text("x,y\n1,2\n")
    _one_line_error(
        run_cli("predict", compiler_digits_artifact, "--input", bad, "--output", tmp_path / "o.npz"),
        "not a readable .npz",
    )


def test_foreign_arch_artifact_is_refused(run_cli, tmp_path, mlp_onnx):
    from compiler.targets import host_arch

    foreign, arch = ("rpi4", "aarch64") if host_arch() != "aarch64" else ("x86_64", "x86_64")
    res = run_cli("compile", mlp_onnx, "--target", foreign, "--out", tmp_path / "rpi4", "-q")
    assert res.code == 0, res.err
    res = _predict(run_cli, tmp_path, tmp_path / "rpi4", x=np.zeros((1, 8), np.float32))
    _one_line_error(res, f"compiled for {arch}", f"this machine is {host_arch()}", "--emulate")


def test_console_script_exit_code_and_single_line(tmp_path, mlp_onnx):
    """The installed `fractal` entry point (not just the in-process runner)."""
    exe = Path(sys.executable).parent / "fractal"
    proc = subprocess.run(
        [str(exe), "compile", str(mlp_onnx), "--target", "nope", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown target preset 'nope'"), proc.stderr
