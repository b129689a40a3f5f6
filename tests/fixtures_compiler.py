"""Compiled artifacts shared by every area's tests (auto-loaded by ``tests/conftest.py``).

Built once per session into a session tmp dir, for this machine's preset:

* ``digits_onnx`` / ``digits_artifact`` (also as ``compiler_digits_onnx`` /
  ``compiler_digits_artifact``, the names the compiler tests use): zoo ``digits-mlp`` at
  batch 1 (x float32 [N, 64] -> logits [N, 10]) with a training module (loss ce, optimizer
  sgd, batch 32, lr 0.1). ``digits_artifact`` is the artifact DIRECTORY (a ``Path``); load it
  with ``compiler.load_artifact(path)``. Treat it as read-only (copy it with
  ``shutil.copytree`` before modifying anything).
* ``digits_c_artifact``: the same digits-mlp with the same training module for ``x86_64-c`` (the
  C backend: what a board runs, no TVM needed to load it).
* ``digits_int8_artifact``: the same digits-mlp and training module, ``--quantize int8`` on the
  integer kernels, calibrated on 400 sklearn digits: a node serving int8 and training float.
* ``autoencoder_artifact``: zoo ``fc-autoencoder`` with training (mse, adam, batch 32, lr 0.001).
* ``cnn_onnx`` / ``cnn_artifact``: a small CNN (x [N, 3, 8, 8] -> logits [N, 4]; Conv, depthwise
  Conv, BatchNorm, MaxPool, GlobalAveragePool, Gemm) with training (ce, sgd, batch 4, lr 0.05).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def compiler_build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session directory holding the shared ONNX files and artifacts."""
    return tmp_path_factory.mktemp("compiler-artifacts")


@pytest.fixture(scope="session")
def compiler_digits_onnx(compiler_build_dir: Path) -> Path:
    """The zoo ``digits-mlp`` model (batch 1, seed 0) as an ONNX file."""
    from compiler import zoo

    return Path(zoo.save("digits-mlp", compiler_build_dir / "digits-mlp.onnx"))


@pytest.fixture(scope="session")
def compiler_digits_artifact(compiler_build_dir: Path, compiler_digits_onnx: Path) -> Path:
    """``digits-mlp`` compiled for the host preset with training (ce, sgd, batch 32, lr 0.1)."""
    from compiler import TrainSettings, compile_model, host_preset_name

    return compile_model(
        compiler_digits_onnx,
        target=host_preset_name(),
        out_dir=compiler_build_dir / "digits-mlp",
        train=TrainSettings(loss="ce", optimizer="sgd", lr=0.1, batch=32),
        progress=False,
    )


@pytest.fixture(scope="session")
def digits_onnx(compiler_digits_onnx: Path) -> Path:
    """Alias of ``compiler_digits_onnx``."""
    return compiler_digits_onnx


@pytest.fixture(scope="session")
def digits_artifact(compiler_digits_artifact: Path) -> Path:
    """Alias of ``compiler_digits_artifact`` (the shared name other areas use)."""
    return compiler_digits_artifact


@pytest.fixture(scope="session")
def digits_c_artifact(compiler_build_dir: Path, compiler_digits_onnx: Path) -> Path:
    """``digits-mlp`` for ``x86_64-c`` with training (ce, sgd, batch 32, lr 0.1), as digits_artifact."""
    from compiler import TrainSettings, compile_model

    return compile_model(compiler_digits_onnx, target="x86_64-c", out_dir=compiler_build_dir / "digits-mlp-c",
                         train=TrainSettings(loss="ce", optimizer="sgd", lr=0.1, batch=32), progress=False)


@pytest.fixture(scope="session")
def digits_int8_artifact(compiler_build_dir: Path, compiler_digits_onnx: Path) -> Path:
    """``digits-mlp`` for the host preset with training (ce, sgd, batch 32, lr 0.1) and its int8
    library (``--train --quantize int8 --integer-kernels``, calibrated on the first 400 sklearn
    digits scaled to [0, 1])."""
    import numpy as np
    from sklearn.datasets import load_digits

    from compiler import TrainSettings, compile_model, host_preset_name
    from compiler.quantize import CalibrationSet

    cal = CalibrationSet({"x": (load_digits().data[:400] / 16.0).astype(np.float32)}, "sklearn digits")
    return compile_model(compiler_digits_onnx, target=host_preset_name(),
                         out_dir=compiler_build_dir / "digits-mlp-int8",
                         train=TrainSettings(loss="ce", optimizer="sgd", lr=0.1, batch=32), progress=False,
                         quantize="int8", calibration=cal, integer=True)


@pytest.fixture(scope="session")
def cnn_onnx(compiler_build_dir: Path) -> Path:
    """A small CNN (see ``tests/compiler/models.py``) as an ONNX file."""
    from tests.compiler.models import save, small_cnn

    return save(small_cnn()[0], compiler_build_dir / "small-cnn.onnx")


@pytest.fixture(scope="session")
def cnn_artifact(compiler_build_dir: Path, cnn_onnx: Path) -> Path:
    """The small CNN compiled for the host preset with training (ce, sgd, batch 4, lr 0.05)."""
    from compiler import TrainSettings, compile_model, host_preset_name

    return compile_model(
        cnn_onnx,
        target=host_preset_name(),
        out_dir=compiler_build_dir / "small-cnn",
        train=TrainSettings(loss="ce", optimizer="sgd", lr=0.05, batch=4),
        progress=False,
    )


@pytest.fixture(scope="session")
def autoencoder_artifact(compiler_build_dir: Path) -> Path:
    """The zoo ``fc-autoencoder`` (x [N, 640] -> recon [N, 640], MLPerf Tiny's anomaly model)
    compiled for the host preset with training (mse, adam, batch 32, lr 0.001): ~1 min to build."""
    from compiler import TrainSettings, compile_model, host_preset_name, zoo

    onnx_path = Path(zoo.save("fc-autoencoder", compiler_build_dir / "fc-autoencoder.onnx"))
    return compile_model(onnx_path, target=host_preset_name(), out_dir=compiler_build_dir / "fc-autoencoder",
                         train=TrainSettings(loss="mse", optimizer="adam", lr=0.001, batch=32),
                         progress=False)
