"""`fractal compile --quantize int8 --calibration DATA.npz | --calibration-from NODE_DATA_DIR`
(compiler/quantize.py, edgenode/calibration.py): a digits-mlp trained on sklearn digits (the data
the zoo's digits model is for), quantized with onnxruntime's quantize_static on 400 training
samples held in a node's real sample store, compiled once for the host preset through the CLI,
then checked against onnxruntime running the same QDQ model (the artifact keeps it), against the
same samples given as an .npz, and against the float model's accuracy on the held-out digits."""

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
from edgenode.store import SampleSpec, SampleStore


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
def node_dir(tmp_path_factory: pytest.TempPathFactory, digits: tuple) -> Path:
    """A node's data_dir whose sample store (the node's own layout) holds the first 400 training
    digits, labelled, in two requests."""
    d = tmp_path_factory.mktemp("node-data")
    store = SampleStore(d / "samples.db", SampleSpec((("x", (64,), "float32"),), (), "int64"), num_classes=10)
    store.add({"x": digits[0][:250]}, digits[1][:250])
    store.add({"x": digits[0][250:400]}, digits[1][250:400])
    store.close()
    return d


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory: pytest.TempPathFactory, trained_digits: Path, node_dir: Path) -> Path:
    """Compiled by `fractal compile --quantize int8 --calibration-from NODE_DATA_DIR --integer-kernels`."""
    from api.cli import main

    out = tmp_path_factory.mktemp("quant-art") / "art"
    with pytest.raises(SystemExit) as exc:
        main(["compile", str(trained_digits), "-t", host_preset_name(), "-o", str(out), "--quantize", "int8",
              "--calibration-from", str(node_dir), "--integer-kernels", "-q"])
    assert exc.value.code in (0, None)
    return out


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


def test_store_calibration_equals_the_same_samples_as_npz(int8_artifact: Path, trained_digits: Path,
                                                          node_dir: Path, digits: tuple,
                                                          tmp_path: Path) -> None:
    """The store gives back its 400 samples, in order: the QDQ model is the one the .npz path makes."""
    from compiler.quantize import quantize_int8

    man = Manifest.read(int8_artifact)
    assert man.prepared_steps[0] == "quantize_int8(qdq, per-channel weights, 400 calibration samples)"
    np.savez(tmp_path / "cal.npz", x=digits[0][:400])
    qpath, n = quantize_int8(trained_digits, tmp_path / "cal.npz", tmp_path / "q.onnx")
    assert n == 400

    def params(p: Path) -> dict[str, np.ndarray]:
        return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(p)).graph.initializer}

    got, ref = params(int8_artifact / QUANT_FILE), params(qpath)
    assert got.keys() == ref.keys() and any(k.endswith("_scale") for k in ref)
    for k in ref:
        assert np.array_equal(got[k], ref[k]), k
    # the newest N only: 100 samples give other activation ranges
    from edgenode.calibration import open_store, store_calibration

    store = open_store(node_dir)
    try:
        assert np.array_equal(store_calibration(store, 100).arrays["x"], digits[0][300:400])
    finally:
        store.close()


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


def test_calibration_from_cli_errors(run_cli: Callable, trained_digits: Path, tmp_path: Path) -> None:
    """One line each, before any compile work: no dir, no store, an empty store, another model's
    layout, both sources, no --quantize."""
    out = tmp_path / "art"

    def compile_from(src: Path, *extra: str | Path) -> str:
        r = run_cli("compile", trained_digits, "-t", host_preset_name(), "-o", out, "--quantize", "int8",
                    "--calibration-from", src, *extra, "-q")
        assert r.code == 1 and r.error_line.startswith("error: "), r
        return r.error_line

    assert "not found" in compile_from(tmp_path / "nowhere")
    (tmp_path / "bare").mkdir()
    assert "holds no sample store (samples.db)" in compile_from(tmp_path / "bare")
    spec = SampleSpec((("x", (64,), "float32"),), (), "int64")
    SampleStore(tmp_path / "empty" / "samples.db", spec).close()
    line = compile_from(tmp_path / "empty")
    assert "holds no samples" in line and "/v1/samples" in line
    other = SampleStore(tmp_path / "other" / "samples.db",
                        SampleSpec((("x", (32,), "float32"),), (), "int64"))
    other.add({"x": np.zeros((8, 32), np.float32)}, np.zeros(8, np.int64))
    other.close()
    line = compile_from(tmp_path / "other")
    assert "x has shape [8, 32], the model takes [N, 64]" in line and "another model layout" in line
    assert "not both" in compile_from(tmp_path / "other", "--calibration", tmp_path / "c.npz")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "samples.db").write_bytes(b"not a database at all" * 100)
    assert "not a readable sample store" in compile_from(tmp_path / "junk")
    r = run_cli("compile", trained_digits, "-t", host_preset_name(), "-o", out, "--calibration-from",
                tmp_path / "other", "-q")
    assert r.code == 1 and "--quantize (not given)" in r.error_line
    (tmp_path / "empty.onnx").write_bytes(b"")
    r = run_cli("compile", tmp_path / "empty.onnx", "-t", host_preset_name(), "-o", out, "--quantize", "int8",
                "--calibration-from", tmp_path / "other", "-q")
    assert r.code == 1 and "no graph inputs" in r.error_line
    assert not out.exists()
