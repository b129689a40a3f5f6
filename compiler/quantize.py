"""Static post-training int8 quantization of a float ONNX model (``fractal compile --quantize int8
--calibration DATA.npz``), by onnxruntime's ``quantization.quantize_static``.

The result is a QDQ model (QuantizeLinear / DequantizeLinear pairs around each quantized op):
int8 activations (asymmetric, MinMax-calibrated on the calibration samples) and int8 weights
(symmetric, per output channel). The float graph is first run through onnxruntime's
``quant_pre_process`` (shape inference and graph optimization: BatchNorm folded into the
convolutions) so the quantized ops are the ones that do the work.

Calibration data: an ``.npz`` with one array per model input, named as the input (a model with
one input also takes an ``.npz`` holding a single array under any name), each
``[N, *input_shape[1:]]`` float32 samples: the samples are fed in batches of the model's batch
size (N at least that size; a remainder is left out). The same arrays may come from elsewhere
as a :class:`CalibrationSet`: ``fractal compile --calibration-from NODE_DATA_DIR`` reads a node's
sample store (:mod:`edgenode.calibration`) and passes its newest samples so.
"""

from __future__ import annotations

import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import ArtifactError, InputError, ModelError
from compiler.manifest import QuantSettings

__all__ = ["MODES", "Calibration", "CalibrationSet", "QuantSettings", "calibration_batches",
           "calibration_count", "check_params_map", "float_model_with_params", "load_calibration",
           "quantize_int8"]

MODES = ("int8",)



@dataclass(frozen=True)
class CalibrationSet:
    """Calibration samples already in memory: input name -> [N, ...] float32 samples."""

    arrays: Mapping[str, np.ndarray]
    source: str  # where they came from, named in errors ("the sample store DIR/samples.db")
    hint: str | None = None  # the fix for a name, dtype or shape that does not fit the model


Calibration = str | Path | CalibrationSet  # an .npz file of samples, or the samples


def _graph_inputs(model: Any) -> list[tuple[str, list[int]]]:
    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim]
        out.append((vi.name, dims))
    return out


def load_calibration(path: str | Path, model: Any) -> list[dict[str, np.ndarray]]:
    """The calibration batches for ``model`` from the ``.npz`` at ``path``; InputError naming the
    problem when the file does not fit the model."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"calibration file {str(path)!r} not found",
                         hint="pass an .npz written with numpy.savez(path, INPUT_NAME=samples)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InputError(f"{path.name} is not a readable .npz file ({exc})",
                         hint="write it with numpy.savez(path, INPUT_NAME=samples)") from None
    return calibration_batches(arrays, model, path.name)


def calibration_batches(arrays: Mapping[str, np.ndarray], model: Any,
                        source: str, hint: str | None = None) -> list[dict[str, np.ndarray]]:
    """The calibration batches for ``model`` from ``arrays`` (input name -> [N, ...] samples; a
    one-input model takes any single array); InputError naming ``source`` and the problem when
    they do not fit the model (``hint``: the fix for a name, dtype or shape that does not match,
    instead of the .npz one)."""
    arrays = dict(arrays)
    inputs = _graph_inputs(model)
    if not inputs:
        raise ModelError("the model has no graph inputs to calibrate",
                         hint="check that MODEL.onnx is the ONNX model (fractal inspect MODEL.onnx)")
    if len(inputs) == 1 and len(arrays) == 1 and inputs[0][0] not in arrays:
        arrays = {inputs[0][0]: next(iter(arrays.values()))}
    missing = [n for n, _ in inputs if n not in arrays]
    if missing:
        raise InputError(f"{source} has no samples for the model input(s) {', '.join(missing)}",
                         hint=hint or f"it has: {', '.join(arrays) or 'nothing'}; "
                                      "name each array as its input")
    counts = set()
    for name, dims in inputs:
        a = arrays[name]
        if a.dtype != np.float32:
            raise InputError(f"{source}: {name} is {a.dtype}, the model takes float32",
                             hint=hint or "save the samples as float32")
        if a.ndim != len(dims) or any(d > 0 and d != s for d, s in zip(dims[1:], a.shape[1:], strict=True)):
            raise InputError(f"{source}: {name} has shape {list(a.shape)}, the model takes "
                             f"[N, {', '.join(str(d) for d in dims[1:])}]",
                             hint=hint or "stack the samples along the first axis")
        if not np.isfinite(a).all():
            raise InputError(f"{source}: {name} holds NaN or infinite values",
                             hint="clean the samples")
        counts.add(a.shape[0])
    if len(counts) != 1:
        raise InputError(f"{source}: the inputs have different sample counts {sorted(counts)}",
                         hint="give every input the same number of samples")
    n = counts.pop()
    batch = max(1, inputs[0][1][0]) if inputs and inputs[0][1] else 1
    if n < batch:
        raise InputError(f"{source} holds {n} samples; the model's batch is {batch}",
                         hint=f"give at least {batch} samples (a few hundred calibrate well)")
    return [{name: np.ascontiguousarray(arrays[name][i:i + batch]) for name, _ in inputs}
            for i in range(0, n - batch + 1, batch)]


def quantize_int8(model_path: str | Path, calibration: Calibration, out_path: str | Path,
                  settings: QuantSettings | None = None, qoperator: bool = False) -> tuple[Path, int]:
    """Write the int8 QDQ model of ``model_path``, calibrated on ``calibration`` (an .npz path or
    a :class:`CalibrationSet`), to ``out_path``; ``settings``: the manifest's record of how
    (default: per-channel int8 weights, asymmetric int8 activations, MinMax). ``qoperator``: the
    same quantization in onnxruntime's QOperator format (QLinearConv, QGemm, ...; what
    :mod:`compiler.qoperator` takes back to QDQ), for the tests that compare the two.

    Returns (out_path, number of calibration samples)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    settings = settings or QuantSettings()
    types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}
    if settings.activation_type not in types or settings.weight_type not in types \
            or settings.calibrate_method not in methods:
        raise ModelError(f"unknown quantization settings {settings}",
                         hint=f"types: {', '.join(types)}; calibrate_method: {', '.join(methods)}")
    model_path, out_path = Path(model_path), Path(out_path)
    model = onnx.load(str(model_path), load_external_data=False)
    batches = (calibration_batches(calibration.arrays, model, calibration.source, calibration.hint)
               if isinstance(calibration, CalibrationSet) else load_calibration(calibration, model))

    class _Reader(CalibrationDataReader):  # type: ignore[misc]  # (untyped base class)
        def __init__(self) -> None:
            self._it = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    with tempfile.TemporaryDirectory(prefix="fractal-quant-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        try:
            quant_pre_process(str(model_path), str(pre), skip_symbolic_shape=True)
            quantize_static(str(pre), str(out_path), _Reader(),
                            quant_format=QuantFormat.QOperator if qoperator else QuantFormat.QDQ,
                            per_channel=settings.per_channel, activation_type=types[settings.activation_type],
                            weight_type=types[settings.weight_type],
                            calibrate_method=methods[settings.calibrate_method],
                            extra_options={"ActivationSymmetric": settings.activation_symmetric,
                                           "WeightSymmetric": settings.weight_symmetric})
        except (InputError, ModelError):
            raise
        except Exception as exc:
            raise ModelError(f"onnxruntime could not quantize {model_path.name}: "
                             f"{' '.join(str(exc).split())[:300]}",
                             hint="check the model runs in onnxruntime; compile without --quantize") from None
    n = sum(next(iter(b.values())).shape[0] for b in batches)
    return out_path, n


def calibration_count(calibration: Calibration, model_path: str | Path) -> int:
    """How many samples :func:`quantize_int8` calibrates ``model_path`` on (whole batches)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    batches = (calibration_batches(calibration.arrays, model, calibration.source, calibration.hint)
               if isinstance(calibration, CalibrationSet) else load_calibration(calibration, model))
    return sum(next(iter(b.values())).shape[0] for b in batches)


def _initializers(model_path: str | Path) -> tuple[object, dict[str, object]]:
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return model, {i.name: i for i in model.graph.initializer}


def check_params_map(model_path: str | Path, names: Sequence[str], params: Sequence[np.ndarray]) -> None:
    """Every parameter is an initializer of the float model with the same value: else trained
    parameters could not be written back into it, and a rebuilt int8 library would be wrong.
    ArtifactError naming the first parameter that does not map."""
    from onnx import numpy_helper

    _, inits = _initializers(model_path)
    for name, p in zip(names, params, strict=True):
        init = inits.get(name)
        value = None if init is None else numpy_helper.to_array(init)  # type: ignore[arg-type]
        if value is None or value.shape != p.shape or not np.array_equal(value.astype(np.float32), p):
            raise ArtifactError(f"parameter {name!r} is not an initializer of {Path(model_path).name} as "
                                "imported (the preparation stage changed it): trained parameters could "
                                "not be re-quantized",
                                hint="compile the int8 artifact and the training artifact separately "
                                     "(--quantize without --train)")


def float_model_with_params(model_path: str | Path, names: Sequence[str], params: Sequence[np.ndarray],
                            out_path: str | Path) -> Path:
    """Write the float model at ``model_path`` with ``params`` in place of its initializers of the
    same names (float32) to ``out_path``."""
    import onnx
    from onnx import numpy_helper

    model, inits = _initializers(model_path)
    for name, p in zip(names, params, strict=True):
        init = inits.get(name)
        if init is None or tuple(init.dims) != tuple(np.shape(p)):  # type: ignore[attr-defined]
            raise ArtifactError(f"parameter {name!r} {list(np.shape(p))} has no initializer of that shape in "
                                f"{Path(model_path).name}", hint="recompile the artifact")
        init.CopyFrom(numpy_helper.from_array(  # type: ignore[attr-defined]
            np.ascontiguousarray(p, dtype=np.float32), name))
    onnx.save(model, str(out_path))  # type: ignore[arg-type]
    return Path(out_path)
