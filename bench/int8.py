"""int8 QDQ builds next to onnxruntime int8 and float32, same thread count on both sides.

    python -m bench.int8 [--models a,b] [--threads 1,2] [--target x86_64-avx2] [--seconds S] [--json]

Each zoo model is quantized with ``compiler.quantize.quantize_int8`` (64 seeded random-normal
calibration samples: the zoo's weights are random too), compiled for ``--target`` (untuned
default schedules) twice: on the integer kernels (``compiler.integer``: int8 x int8 -> int32
conv2d / matmul, requantized) and, for comparison, through TVM's own QDQ import (dequantize ->
float32 op -> quantize, ``integer=False``). Both are timed through ``Artifact.infer`` next to
onnxruntime (``ORT_ENABLE_ALL``, ``intra_op_num_threads`` = N) running the same QDQ model and the
float model. One process per
thread count (``TVM_NUM_THREADS`` is read when TVM starts), three interleaved rounds each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.cbackend import _median_us
from bench.host import print_rows

__all__ = ["main"]


def _prepare(models: list[str], target: str, work: Path) -> None:
    from compiler import compile_model, zoo
    from compiler.quantize import quantize_int8

    for name in models:
        f32 = zoo.save(name, work / f"{name}.onnx")
        cal = work / f"{name}-cal.npz"
        np.savez(cal, x=np.random.default_rng(0).standard_normal((64, *zoo.input_shape(name)[1:]))
                 .astype(np.float32))
        quantize_int8(f32, cal, work / f"{name}.int8.onnx")
        compile_model(work / f"{name}.int8.onnx", target=target, out_dir=work / f"{name}-int8",
                      progress=False, integer=True)
        compile_model(work / f"{name}.int8.onnx", target=target, out_dir=work / f"{name}-qdq",
                      progress=False, integer=False)


def _measure(models: list[str], work: Path, threads: int, seconds: float) -> list[dict[str, Any]]:
    import onnxruntime as ort

    from compiler import load_artifact, zoo

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    rows = []
    for name in models:
        x = {"x": np.random.default_rng(1).standard_normal(zoo.input_shape(name)).astype(np.float32)}
        f32 = ort.InferenceSession(str(work / f"{name}.onnx"), so, providers=["CPUExecutionProvider"])
        q8 = ort.InferenceSession(str(work / f"{name}.int8.onnx"), so, providers=["CPUExecutionProvider"])
        art = load_artifact(work / f"{name}-int8")
        qdq = load_artifact(work / f"{name}-qdq")
        fns = {"ort_f32_us": lambda s=f32, x=x: s.run(None, x),
               "ort_int8_us": lambda s=q8, x=x: s.run(None, x),
               "tvm_qdq_us": lambda a=qdq, x=x: a.infer(x),
               "tvm_int8_us": lambda a=art, x=x: a.infer(x)}
        us: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(3):
            for k, fn in fns.items():
                us[k].append(_median_us(fn, seconds / 3))
        row: dict[str, Any] = {"model": name, "threads": threads}
        row.update({k: round(statistics.median(v), 1) for k, v in us.items()})
        row["tvm_vs_ort_int8"] = round(row["tvm_int8_us"] / row["ort_int8_us"], 2)
        row["tvm_vs_ort_f32"] = round(row["tvm_int8_us"] / row["ort_f32_us"], 2)
        row["qdq_vs_ort_int8"] = round(row["tvm_qdq_us"] / row["ort_int8_us"], 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.int8", description=__doc__)
    ap.add_argument("--models", default="ds-cnn-kws")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--target", default="x86_64-avx2")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # internal: WORK_DIR of a prepared run
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.measure:
        print(json.dumps(_measure(models, Path(args.measure), int(args.threads), args.seconds)))
        return 0
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fractal-int8-") as tmp:
        _prepare(models, args.target, Path(tmp))
        for n in (int(t) for t in args.threads.split(",") if t):
            env = {**os.environ, "TVM_NUM_THREADS": str(n)}
            cmd = [sys.executable, "-m", "bench.int8", "--models", args.models, "--threads", str(n),
                   "--seconds", str(args.seconds), "--measure", tmp]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            rows += json.loads(p.stdout.strip().splitlines()[-1])
    print_rows(args.target, rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
