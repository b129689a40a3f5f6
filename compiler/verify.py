"""Verification: run an artifact and onnxruntime on the same random inputs and compare.

``emulate=True`` runs the artifact through ``compiler.emulate.run_emulated`` (qemu-user in an
aarch64 sysroot) instead of in this process, so foreign-arch artifacts can be checked here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compiler.artifact import load_artifact
from compiler.errors import ArtifactError, EmulationError, InputError
from compiler.manifest import Manifest, TensorSpec, file_sha256

__all__ = ["VerifyResult", "verify_artifact", "random_inputs", "onnxruntime_reference", "DEFAULT_TOL"]

DEFAULT_TOL = 1e-4


@dataclass
class VerifyResult:
    """Max abs error overall and per output, and whether it is within ``tol``."""

    max_abs_error: float
    per_output: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    emulated: bool = False
    tol: float = DEFAULT_TOL

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_abs_error) and self.max_abs_error <= self.tol)


def random_inputs(specs: list[TensorSpec], n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random inputs with a leading batch of ``n`` for every input spec."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for s in specs:
        shape = (n, *s.shape[1:])
        dt = np.dtype(s.dtype)
        if dt.kind == "f":
            out[s.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            out[s.name] = rng.integers(0, 2, shape).astype(dt)
        elif dt.kind in "iu":
            lo, hi = (0, 100) if dt.kind == "u" else (-100, 100)
            out[s.name] = rng.integers(max(lo, np.iinfo(dt).min), min(hi, np.iinfo(dt).max), shape).astype(dt)
        else:
            raise InputError(f"cannot make random data for input {s.name!r} of dtype {s.dtype}",
                             hint="verify with your own inputs via `fractal predict`")
    return out


def onnxruntime_reference(onnx_path: str | Path, inputs: dict[str, np.ndarray],
                          batch: int | None) -> dict[str, np.ndarray]:
    """onnxruntime outputs, run in chunks of the compiled ``batch`` (the ONNX model may fix it);
    ``batch`` None: one run on the inputs as they are (a model without a batch dimension)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    if batch is None:
        return {k: np.asarray(v) for k, v in zip(names, sess.run(names, inputs), strict=True)}
    n = next(iter(inputs.values())).shape[0]
    parts: dict[str, list[np.ndarray]] = {k: [] for k in names}
    for start in range(0, n, batch):
        feed = {k: v[start:start + batch] for k, v in inputs.items()}
        for k, v in zip(names, sess.run(names, feed), strict=True):
            parts[k].append(np.asarray(v))
    return {k: np.concatenate(v) for k, v in parts.items()}


def verify_artifact(artifact_dir: str | Path, onnx_path: str | Path, *, emulate: bool = False,
                    batches: int = 2, seed: int = 0, tol: float = DEFAULT_TOL) -> VerifyResult:
    """Compare the artifact with onnxruntime on ``batches`` x compiled-batch random samples."""
    from compiler.importer import load_onnx

    artifact_dir = Path(artifact_dir)
    manifest = Manifest.read(artifact_dir)
    load_onnx(onnx_path)  # a clear ModelError for a bad file before anything runs
    if file_sha256(onnx_path) != manifest.onnx_sha256:
        raise ArtifactError(f"{Path(onnx_path).name} is not the model {manifest.name!r} was compiled "
                            "from (onnx sha256 differs)",
                            hint="pass the same ONNX file given to `fractal compile`")
    specs = list(manifest.inputs)
    b = manifest.batch
    n = b * max(1, batches)
    if manifest.batched:
        inputs = random_inputs(specs, n, seed)
    else:  # no batch dimension: one set of inputs of exactly the compiled shapes
        inputs = {k: v[0] for k, v in random_inputs([TensorSpec(s.name, (1, *s.shape), s.dtype)
                                                     for s in specs], 1, seed).items()}
    if emulate:
        try:
            from compiler.emulate import run_emulated
        except ImportError as exc:
            raise EmulationError(f"emulation is not available in this build ({exc})",
                                 hint="verify natively on a matching machine") from None
        got: dict[str, Any] = run_emulated(artifact_dir, inputs)
    else:
        got = load_artifact(artifact_dir).infer(inputs)
    ref = onnxruntime_reference(onnx_path, inputs, b if manifest.batched else None)
    per = {}
    for name, want in ref.items():
        if name not in got:
            raise ArtifactError(f"the artifact produced no output {name!r}", hint="recompile the artifact")
        have = np.asarray(got[name])
        if have.shape != want.shape:
            raise ArtifactError(f"output {name!r} has shape {list(have.shape)}, onnxruntime gives "
                                f"{list(want.shape)}",
                                hint="recompile the artifact")
        diff = np.abs(have.astype(np.float64) - want.astype(np.float64))
        per[name] = float(np.nanmax(diff)) if diff.size else 0.0
        if not np.isfinite(diff).all():
            per[name] = float("inf")
    worst = max(per.values()) if per else 0.0
    return VerifyResult(max_abs_error=worst, per_output=per, samples=n, emulated=emulate, tol=tol)
