"""`fractal compile --quantize int8 --calibration DATA.npz` (compiler/quantize.py): a digits-mlp
trained on sklearn digits (the data the zoo's digits model is for), quantized with onnxruntime's
quantize_static on 400 training samples, compiled once for the host preset, then checked against
onnxruntime running the same QDQ model (the artifact keeps it) and against the float model's
accuracy on the held-out digits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from compiler import zoo
from compiler.artifact import load_artifact
from compiler.build import QUANT_FILE
from compiler.manifest import Manifest
from compiler.targets import host_preset_name


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    idx = np.random.default_rng(0).permutation(len(y))
    tr, te = idx[:1300], idx[1300:]
    return x[tr], y[tr], x[te], y[te]


@pytest.fixture(scope="module")
def trained_digits(tmp_path_factory: pytest.TempPathFactory, digits: tuple) -> Path:
    """zoo digits-mlp (64-64-10, Gemm+ReLU) with weights fitted by sklearn's MLPClassifier."""
    from sklearn.neural_network import MLPClassifier

    xtr, ytr, _, _ = digits
    clf = MLPClassifier(hidden_layer_sizes=(64,), max_iter=300, random_state=0).fit(xtr, ytr)
    m = zoo.build("digits-mlp")
    gemms = [n for n in m.graph.node if n.op_type == "Gemm"]
    inits = {i.name: i for i in m.graph.initializer}
    for node, w, b in zip(gemms, clf.coefs_, clf.intercepts_, strict=True):
        trans_b = any(a.name == "transB" and a.i == 1 for a in node.attribute)
        wt = (w.T if trans_b else w).astype(np.float32)
        for name, arr in ((node.input[1], wt), (node.input[2], b.astype(np.float32))):
            assert tuple(inits[name].dims) == arr.shape
            inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr), name))
    path = tmp_path_factory.mktemp("quant") / "digits.onnx"
    onnx.save(m, str(path))
    return path


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory: pytest.TempPathFactory, trained_digits: Path, digits: tuple) -> Path:
    from compiler import compile_model

    d = tmp_path_factory.mktemp("quant-art")
    np.savez(d / "cal.npz", x=digits[0][:400])
    return compile_model(trained_digits, target=host_preset_name(), out_dir=d / "art", progress=False,
                         quantize="int8", calibration=d / "cal.npz", integer=True)


def _output_step(qdq: onnx.ModelProto) -> float:
    """The quantization step of the graph output (the scale of the DequantizeLinear producing it)."""
    out = qdq.graph.output[0].name
    node = next(n for n in qdq.graph.node if out in n.output)
    assert node.op_type == "DequantizeLinear"
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    return float(inits[node.input[1]])


def test_int8_matches_onnxruntime_on_the_same_qdq_model(int8_artifact: Path, digits: tuple) -> None:
    import onnxruntime as ort

    man = Manifest.read(int8_artifact)
    assert QUANT_FILE in man.files and man.prepared_steps[0].startswith("quantize_int8(")
    # both Gemm layers ran on the integer kernels (compiler/integer.py), not dequantize -> float
    assert "integer_kernels(0 conv2d, 2 matmul int8->int32)" in man.prepared_steps
    qdq = onnx.load(str(int8_artifact / QUANT_FILE))
    ops = {n.op_type for n in qdq.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    step = _output_step(qdq)
    # onnxruntime's reference semantics of the QDQ graph (no graph optimizations): with
    # ORT_ENABLE_ALL it runs fused integer kernels whose requantization differs from its own
    # reference by several output steps on this model, so that is not the reference
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(int8_artifact / QUANT_FILE), opts, providers=["CPUExecutionProvider"])
    art = load_artifact(int8_artifact)
    xte = digits[2][:200]
    worst = 0.0
    for i in range(len(xte)):
        x = xte[i:i + 1]
        got = art.infer({"x": x})["logits"]
        ref = sess.run(None, {"x": x})[0]
        worst = max(worst, float(np.abs(got - ref).max()))
    # the outputs are on the int8 grid: equal, or one quantization step apart at most
    assert worst <= step * 1.001, (worst, step)


def test_int8_accuracy_within_one_point_of_float(int8_artifact: Path, trained_digits: Path,
                                                 digits: tuple) -> None:
    import onnxruntime as ort

    _, _, xte, yte = digits
    sess = ort.InferenceSession(str(trained_digits), providers=["CPUExecutionProvider"])
    art = load_artifact(int8_artifact)
    f_pred = np.array([sess.run(None, {"x": xte[i:i + 1]})[0].argmax() for i in range(len(yte))])
    q_pred = np.array([art.infer({"x": xte[i:i + 1]})["logits"].argmax() for i in range(len(yte))])
    f_acc, q_acc = (f_pred == yte).mean() * 100, (q_pred == yte).mean() * 100
    assert f_acc > 90, f_acc  # the float model really learned the digits
    assert q_acc >= f_acc - 1.0, (f_acc, q_acc)


def test_quantize_cli_errors(run_cli: Callable, trained_digits: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    r = run_cli("compile", trained_digits, "-t", host_preset_name(), "-o", out, "--quantize", "int8", "-q")
    assert r.code != 0 and "--calibration" in r.error_line
    r = run_cli("compile", trained_digits, "-t", host_preset_name(), "-o", out, "--quantize", "int4",
                "--calibration", tmp_path / "c.npz", "-q")
    assert r.code != 0 and "int8" in r.error_line
    np.savez(tmp_path / "wrong.npz", a=np.zeros((8, 64), np.float32), b=np.zeros((8, 64), np.float32))
    r = run_cli("compile", trained_digits, "-t", host_preset_name(), "-o", out, "--quantize", "int8",
                "--calibration", tmp_path / "wrong.npz", "-q")
    assert r.code != 0 and "no samples for the model input(s) x" in r.error_line
    np.savez(tmp_path / "shape.npz", x=np.zeros((8, 32), np.float32))
    r = run_cli("compile", trained_digits, "-t", host_preset_name(), "-o", out, "--quantize", "int8",
                "--calibration", tmp_path / "shape.npz", "-q")
    assert r.code != 0 and "[N, 64]" in r.error_line
    np.savez(tmp_path / "nan.npz", x=np.full((8, 64), np.nan, np.float32))
    r = run_cli("compile", trained_digits, "-t", host_preset_name(), "-o", out, "--quantize", "int8",
                "--calibration", tmp_path / "nan.npz", "-q")
    assert r.code != 0 and "NaN" in r.error_line
    r = run_cli("compile", trained_digits, "-t", host_preset_name(), "-o", out, "--quantize", "int8",
                "--calibration", tmp_path / "missing.npz", "-q")
    assert r.code != 0 and "not found" in r.error_line
    assert not out.exists()
