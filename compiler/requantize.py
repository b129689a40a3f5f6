"""Rebuild the int8 inference library of a ``--train --quantize int8`` artifact from new float
parameters (what a node does after a committed round; ``edgenode/requantize.py`` runs it in a
child process, since it imports TVM and onnxruntime).

Training stays float: the swarm averages float parameters, and the int8 library is a function of
them (its weights are the float weights quantized per channel; its activation ranges come from
calibration). So after a round the artifact's float model (``quantization.float_onnx``) gets the
committed parameters in place of its initializers, by name (the compile checked that each
parameter is an initializer of that model, with its value, :func:`check_params_map`), is
quantized with the artifact's settings on fresh calibration samples and compiled for the
artifact's preset with its integer-kernel choice, untuned (default schedules: a node has no
tuning database and no minutes to spare). The result is an inference-only int8 artifact
directory, like the artifact's own ``quantization.library``, keeping the QDQ model it compiled
(``QUANT_FILE``, onnxruntime's reference).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from compiler.errors import ArtifactError
from compiler.manifest import Manifest
from compiler.quantize import Calibration, check_params_map, float_model_with_params

__all__ = ["check_params_map", "float_model_with_params", "requantize"]  # (the first two: compiler.quantize)


def requantize(artifact_dir: str | Path, params: Sequence[np.ndarray], calibration: Calibration,
               out_dir: str | Path, *, progress: bool = False) -> Path:
    """The int8 inference artifact of ``artifact_dir``'s model with the float ``params`` (manifest
    order), calibrated on ``calibration`` (a :class:`compiler.quantize.CalibrationSet` or an
    .npz path), compiled into ``out_dir`` (atomically, as every compile). ArtifactError when the
    artifact carries no float model to re-quantize."""
    from compiler.build import compile_model

    artifact_dir = Path(artifact_dir)
    man = Manifest.read(artifact_dir)
    q = man.quantization
    if q is None:
        raise ArtifactError(f"artifact {man.name!r} carries no int8 library to rebuild",
                            hint="compile it with --train --quantize int8 --calibration DATA.npz")
    with tempfile.TemporaryDirectory(prefix="fractal-requant-") as tmp:
        f32 = float_model_with_params(artifact_dir / q.float_onnx, man.params.names, params,
                                      Path(tmp) / f"{man.name}.onnx")
        return compile_model(f32, target=man.preset, out_dir=out_dir, name=man.name, progress=progress,
                             input_shapes={k: list(v) for k, v in man.compiled_shapes.items()},
                             quantize=q.mode, calibration=calibration, integer=q.integer,
                             quant_settings=q.settings)
