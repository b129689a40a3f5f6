"""``bench_user_model``: latency of a user's own ONNX file in onnxruntime and TVM (untuned, tuned).

Small and self-contained on purpose (``fractal bench compile --model FILE``): the zoo benchmark
lives in bench/compile.py; this reuses its timing (``measure``), thread setup (``set_threads``)
and onnxruntime session options, so both engines run on the same number of threads.
Latency here is ``Artifact.infer`` (the API a node serves through) on random inputs of the
compiled shapes; the max abs error against onnxruntime is reported too.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import CompilerError

__all__ = ["bench_user_model"]


def _random_inputs(specs: list[Any]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for s in specs:
        dt = np.dtype(s.dtype)
        if dt.kind == "f":
            out[s.name] = rng.standard_normal(s.shape).astype(dt)
        elif dt.kind in "iu":
            out[s.name] = rng.integers(0, 2, s.shape).astype(dt)
        elif dt.kind == "b":
            out[s.name] = rng.integers(0, 2, s.shape).astype(bool)
        else:
            raise CompilerError(f"input {s.name!r} has dtype {s.dtype}, which the benchmark cannot generate",
                                hint="benchmark a model with numeric inputs")
    return out


def bench_user_model(model: str | Path, *, shapes: dict[str, list[int]] | None = None, trials: int = 0,
                     threads: int = 1, target: str = "native", min_seconds: float = 1.0,
                     db_dir: str | Path | None = None,
                     log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """onnxruntime vs TVM untuned (and tuned when ``trials`` > 0) on ``model``; returns one row."""
    from bench.compile import NATIVE, _ort_session, measure, set_threads
    from bench.host import machine
    from compiler.artifact import load_artifact
    from compiler.build import compile_model
    from compiler.manifest import Manifest
    from compiler.targets import best_host_preset_name

    if threads < 1 or trials < 0:
        raise CompilerError("--threads must be >= 1 and --trials >= 0", hint="e.g. --threads 1 --trials 32")
    set_threads(threads)
    preset = best_host_preset_name() if target == NATIVE else target
    model = Path(model)
    row: dict[str, Any] = {"model": model.name, "threads": threads, "target": preset,
                           "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="fractal-bench-model-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        plain = compile_model(model, target=preset, out_dir=work / "untuned", input_shapes=shapes,
                              progress=False)
        row["compile_untuned_s"] = round(time.perf_counter() - t0, 2)
        art = load_artifact(plain)
        feeds = _random_inputs(art.inputs)
        row["inputs"] = {k: list(v.shape) for k, v in feeds.items()}
        row["prepared_steps"] = list(Manifest.read(plain).prepared_steps)
        try:
            sess = _ort_session(model, threads)
            ref = sess.run(None, feeds)
            row["onnxruntime"] = measure(lambda: sess.run(None, feeds), min_seconds=min_seconds)
            log(f"onnxruntime {row['onnxruntime']['median_us']} us")
        except Exception as exc:  # onnxruntime refuses some models TVM takes (old IR, ...)
            ref = None
            row["onnxruntime"] = {"error": " ".join(str(exc).split())[:200]}
            log(f"onnxruntime failed: {row['onnxruntime']['error']}")

        def run(directory: Path, key: str) -> None:
            a = load_artifact(directory)
            out = a.infer(feeds)
            row[key] = measure(lambda: a.infer(feeds), min_seconds=min_seconds)
            if ref is not None:
                row[f"{key}_max_abs_err"] = max(float(np.max(np.abs(out[o.name] - r)))
                                                for o, r in zip(a.outputs, ref, strict=True))
            log(f"{key} {row[key]['median_us']} us")

        run(plain, "tvm_untuned")
        if trials:
            t0 = time.perf_counter()
            tuned = compile_model(model, target=preset, out_dir=work / "tuned", input_shapes=shapes,
                                  tune=True, trials=trials, db_dir=db_dir, progress=False)
            row["compile_tuned_s"] = round(time.perf_counter() - t0, 2)
            row["trials"] = trials
            run(tuned, "tvm_tuned")
    ort_us = row["onnxruntime"].get("median_us")
    for key in ("tvm_untuned", "tvm_tuned"):
        if ort_us and key in row:
            row[f"ratio_{key.removeprefix('tvm_')}_vs_ort"] = round(row[key]["median_us"] / ort_us, 3)
    return row
