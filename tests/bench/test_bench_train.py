"""`fractal bench train --json`: TVM's training step against PyTorch on the same model and batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_train_bench_json_matches_pytorch(tmp_path):
    p = subprocess.run([sys.executable, "-c", "from api.cli import main; main()", "bench", "train", "--json",
                        "-m", "digits-mlp", "--steps", "30", "--work-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    m = r["models"]["digits-mlp"]
    assert m["initial_weights_max_abs_diff"] == 0.0  # same starting weights, copied from ONNX
    # same weights, batches and SGD: the two engines' loss curves agree to float rounding
    assert m["loss_curve_max_abs_diff"] < 1e-3, m
    assert m["tvm"]["loss_after_k"] < 0.85 * m["tvm"]["loss_first"]  # real digits data: it learns
    assert m["tvm"]["median_ms"] > 0 and m["torch"]["median_ms"] > 0
    assert r["threads"] >= 1 and r["torch"].startswith("2.")


def test_onnx_torch_matches_onnxruntime_on_every_zoo_classifier():
    """The PyTorch baseline computes what the ONNX graph defines (reference: onnxruntime)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from bench.onnx_torch import OnnxTorch
    from compiler import zoo

    for name in ("digits-mlp", "sensor-mlp", "ds-cnn-kws", "resnet8-cifar10", "fc-autoencoder"):
        model = zoo.build(name, batch=2)
        shape = zoo.input_shape(name, batch=2)
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
        with torch.no_grad():
            got = OnnxTorch(model, trainable=[]).forward(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=name)
