"""Inference against onnxruntime: any batch N, params as runtime inputs, threads, predict/verify CLI."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from compiler import load_artifact


def _ort(onnx_path, x, name="x", replace: dict[str, np.ndarray] | None = None):
    """onnxruntime on the model (optionally with replaced initializers), one sample at a time."""
    model = onnx.load(str(onnx_path))
    for init in model.graph.initializer:
        if replace and init.name in replace:
            init.CopyFrom(numpy_helper.from_array(replace[init.name], init.name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, {name: x[i : i + 1]})[0] for i in range(len(x))])


@pytest.mark.parametrize("n", [1, 5, 37])
def test_digits_any_batch_matches_onnxruntime(compiler_digits_artifact, compiler_digits_onnx, n):
    art = load_artifact(compiler_digits_artifact)
    x = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
    out = art.infer({"x": x})
    assert list(out) == ["logits"]
    assert out["logits"].shape == (n, 10)
    np.testing.assert_allclose(out["logits"], _ort(compiler_digits_onnx, x), atol=1e-4)


@pytest.mark.parametrize("n", [1, 3])
def test_small_cnn_matches_onnxruntime(cnn_artifact, cnn_onnx, n):
    art = load_artifact(cnn_artifact)
    x = np.random.default_rng(n).standard_normal((n, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(art.infer({"x": x})["logits"], _ort(cnn_onnx, x), atol=1e-4)


def test_params_are_runtime_inputs(compiler_digits_artifact, compiler_digits_onnx):
    art = load_artifact(compiler_digits_artifact)
    rng = np.random.default_rng(1)
    new = [(p * 0.5 + 0.01 * rng.standard_normal(p.shape)).astype(np.float32) for p in art.params]
    x = rng.standard_normal((4, 64)).astype(np.float32)
    want = _ort(compiler_digits_onnx, x, replace=dict(zip(art.param_names, new, strict=True)))
    np.testing.assert_allclose(art.infer({"x": x}, new)["logits"], want, atol=1e-4)
    prepared = art.prepare_params(new)
    np.testing.assert_allclose(art.infer({"x": x}, prepared)["logits"], want, atol=1e-4)
    # the artifact's own params are still the default
    np.testing.assert_allclose(art.infer({"x": x})["logits"], _ort(compiler_digits_onnx, x), atol=1e-4)


def test_concurrent_infer_with_different_params_is_correct(compiler_digits_artifact, compiler_digits_onnx):
    art = load_artifact(compiler_digits_artifact)
    rng = np.random.default_rng(2)
    sets = [art.params] + [[(p * s).astype(np.float32) for p in art.params] for s in (0.5, 2.0, -1.0)]
    x = rng.standard_normal((7, 64)).astype(np.float32)
    want = [_ort(compiler_digits_onnx, x, replace=dict(zip(art.param_names, ps, strict=True))) for ps in sets]

    def work(i):
        return [art.infer({"x": x}, sets[i % 4])["logits"] for _ in range(25)]

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(8)))
    for i, outs in enumerate(results):
        for o in outs:
            np.testing.assert_allclose(o, want[i % 4], atol=1e-4)


def test_infer_input_errors(compiler_digits_artifact):
    from compiler import InputError

    art = load_artifact(compiler_digits_artifact)
    with pytest.raises(InputError, match="missing input"):
        art.infer({"y": np.zeros((1, 64), np.float32)})
    with pytest.raises(InputError, match="dtype float64"):
        art.infer({"x": np.zeros((1, 64))})
    with pytest.raises(InputError, match=r"shape \[1, 63\]"):
        art.infer({"x": np.zeros((1, 63), np.float32)})
    with pytest.raises(InputError, match="N >= 1"):
        art.infer({"x": np.zeros((0, 64), np.float32)})
    with pytest.raises(InputError, match="parameter 'w_1'"):
        art.infer({"x": np.zeros((1, 64), np.float32)}, [np.zeros((2, 2), np.float32)] + art.params[1:])


def test_cli_predict_roundtrip(run_cli, compiler_digits_artifact, compiler_digits_onnx, tmp_path):
    x = np.random.default_rng(3).standard_normal((6, 64)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    res = run_cli(
        "predict", compiler_digits_artifact, "--input", tmp_path / "in.npz", "--output", tmp_path / "out.npz"
    )
    assert res.code == 0, res.err
    with np.load(tmp_path / "out.npz") as out:
        assert out.files == ["logits"]
        np.testing.assert_allclose(out["logits"], _ort(compiler_digits_onnx, x), atol=1e-4)


def test_cli_verify_prints_max_abs_error(run_cli, cnn_artifact, cnn_onnx):
    res = run_cli("verify", cnn_artifact, "--model", cnn_onnx)
    assert res.code == 0, res.err
    line = res.out.strip().splitlines()[-1]
    assert line.startswith("max_abs_error=")
    assert float(line.split()[0].split("=")[1]) < 1e-4


def test_verify_api_detects_a_wrong_model(compiler_digits_artifact, tmp_path):
    from compiler import ArtifactError, zoo
    from compiler.verify import verify_artifact

    other = zoo.save("digits-mlp", tmp_path / "other.onnx", seed=1)
    with pytest.raises(ArtifactError, match="not the model"):
        verify_artifact(compiler_digits_artifact, other)
