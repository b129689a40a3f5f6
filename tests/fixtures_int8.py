"""QDQ zoo models and their int8 builds, shared by the int8 tests (auto-loaded by ``tests/conftest.py``).

* ``qdq_model(name)``: zoo ``name`` quantized by onnxruntime's ``quantize_static``
  (:func:`compiler.quantize.quantize_int8`, 64 seeded random-normal calibration samples, as
  bench.int8 does); made once per session.
* ``qoperator_model(name)``: the same quantization in onnxruntime's QOperator format.
* ``int8_build(name, preset)``: that model compiled for ``preset`` on integer kernels, with the
  default schedules (the build users get); once per session. Read-only.
* :func:`steps_from_reference`: the largest output difference from onnxruntime running the
  same QDQ model (ORT_DISABLE_ALL: its reference dequantize -> float op -> quantize semantics),
  in output quantization steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

ZOO_INT8 = ("ds-cnn-kws", "resnet8-cifar10", "mobilenet-v1-0.25-vww", "fc-autoencoder", "digits-mlp")


def int8_input(name: str, seed: int = 100) -> dict[str, np.ndarray]:
    """One seeded random-normal batch for zoo ``name`` (input ``x``, batch 1)."""
    from compiler import zoo

    return {"x": np.random.default_rng(seed).standard_normal(zoo.input_shape(name)).astype(np.float32)}


def steps_from_reference(qdq: Path, inputs: dict[str, np.ndarray], got: np.ndarray) -> float:
    """``got``'s largest difference from onnxruntime's output for ``qdq``, in output steps."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    m = onnx.load(str(qdq))
    node = next(n for n in m.graph.node if m.graph.output[0].name in n.output)
    assert node.op_type == "DequantizeLinear"
    step = float(next(numpy_helper.to_array(i) for i in m.graph.initializer if i.name == node.input[1]))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(qdq), opts, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    assert got.shape == ref.shape
    return float(np.abs(got - ref).max()) / step


@pytest.fixture(scope="session")
def int8_build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("int8-builds")


def _quantized(work: Path, name: str, qoperator: bool) -> Path:
    from compiler import zoo
    from compiler.quantize import quantize_int8

    f32 = work / f"{name}.onnx"
    cal = work / f"{name}-cal.npz"
    if not cal.is_file():
        zoo.save(name, f32)
        np.savez(cal, x=np.random.default_rng(0).standard_normal((64, *zoo.input_shape(name)[1:]))
                 .astype(np.float32))
    out = work / f"{name}.{'qop' if qoperator else 'int8'}.onnx"
    return quantize_int8(f32, cal, out, qoperator=qoperator)[0]


@pytest.fixture(scope="session")
def qdq_model(int8_build_dir: Path) -> Callable[[str], Path]:
    """``qdq_model(name) -> QDQ .onnx`` of zoo ``name``, quantized once per session."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = _quantized(int8_build_dir, name, qoperator=False)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def qoperator_model(int8_build_dir: Path) -> Callable[[str], Path]:
    """``qoperator_model(name) -> .onnx`` of zoo ``name`` quantized as ``qdq_model`` does (same
    calibration samples and settings) in onnxruntime's QOperator format (QLinearConv, QGemm,
    QLinearAdd, ...); once per session."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = _quantized(int8_build_dir, name, qoperator=True)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def int8_build(int8_build_dir: Path, qdq_model: Callable[[str], Path]) -> Callable[..., Path]:
    """``int8_build(name, preset, default_schedules=True) -> artifact dir`` of ``qdq_model(name)``
    on integer kernels, compiled once per session and arguments."""
    from compiler import compile_model

    cache: dict[tuple[str, str, bool], Path] = {}

    def get(name: str, preset: str, default_schedules: bool = True) -> Path:
        key = (name, preset, default_schedules)
        if key not in cache:
            out = int8_build_dir / f"{name}-{preset}{'' if default_schedules else '-naive'}"
            cache[key] = compile_model(qdq_model(name), target=preset, out_dir=out, progress=False,
                                       integer=True, default_schedules=default_schedules)
        return cache[key]

    return get
