"""Foreign-arch artifacts shared by the emulation tests (auto-loaded by ``tests/conftest.py``).

* ``emulate_onnx``: zoo ``ds-cnn-kws`` at batch 2 (Conv, depthwise Conv, BatchNorm, Relu,
  GlobalAveragePool, Gemm) as an ONNX file.
* ``foreign_artifact(preset)``: that model compiled for ``preset`` (built once per preset and
  session; e.g. ``"aarch64"``, ``"rpi4"``, ``"riscv64"``). Read-only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def emulate_build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("emulate-artifacts")


@pytest.fixture(scope="session")
def emulate_onnx(emulate_build_dir: Path) -> Path:
    """zoo ``ds-cnn-kws`` (batch 2, seed 0) as an ONNX file."""
    from compiler import zoo

    return zoo.save("ds-cnn-kws", emulate_build_dir / "ds-cnn-kws.onnx", batch=2)


@pytest.fixture(scope="session")
def foreign_artifact(emulate_build_dir: Path, emulate_onnx: Path) -> Callable[[str], Path]:
    """``foreign_artifact(preset) -> artifact dir`` of ``emulate_onnx``, compiled once per preset."""
    from compiler import compile_model

    cache: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in cache:
            cache[preset] = compile_model(emulate_onnx, target=preset,
                                          out_dir=emulate_build_dir / preset, progress=False)
        return cache[preset]

    return get
