"""Latency of the C backend next to the Relax VM, same machine, same run, same threads.

    TVM_NUM_THREADS=1 python -m bench.cbackend [--models a,b] [--seconds S] [--json]

Each zoo model (batch 1, seed 0, untuned) is compiled twice for this machine: the generic host
preset (Relax VM, ``infer.so``) and its ``-c`` twin (C backend, ``libmodel.so`` via ctypes). Both
are timed through the same ``Artifact.infer`` (same input checks), median of calls for
``seconds`` after warm-up, interleaved in rounds so machine load hits both alike. Also reports
the native build time (cc + link, cache disabled) of the C backend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["run", "main"]


def _median_us(fn: Any, seconds: float) -> float:
    for _ in range(20):
        fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 50:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run(models: list[str], seconds: float = 2.0) -> list[dict[str, Any]]:
    """One row per model: VM and C latency (us), C native build seconds, max abs difference."""
    from compiler import compile_model, load_artifact, zoo
    from compiler.targets import host_preset_name

    host = host_preset_name()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fractal-cbench-") as tmp:
        os.environ["FRACTAL_CBACKEND_CACHE"] = str(Path(tmp) / "cache")  # time a cold native build
        for name in models:
            onnx_path = zoo.save(name, Path(tmp) / f"{name}.onnx")
            vm = load_artifact(compile_model(onnx_path, target=host, out_dir=Path(tmp) / f"{name}-vm",
                                             progress=False))
            t0 = time.perf_counter()
            c_dir = compile_model(onnx_path, target=f"{host}-c", out_dir=Path(tmp) / f"{name}-c",
                                  progress=False)
            c_compile = time.perf_counter() - t0
            c = load_artifact(c_dir)
            x = {"x": np.random.default_rng(0).standard_normal(zoo.input_shape(name)).astype(np.float32)}
            diff = float(np.abs(vm.infer(x)[vm.outputs[0].name] - c.infer(x)[c.outputs[0].name]).max())
            vm_us, c_us = [], []
            for _ in range(3):  # interleaved rounds
                vm_us.append(_median_us(lambda a=vm, x=x: a.infer(x), seconds / 3))
                c_us.append(_median_us(lambda a=c, x=x: a.infer(x), seconds / 3))
            rows.append({"model": name, "vm_us": round(statistics.median(vm_us), 1),
                         "c_us": round(statistics.median(c_us), 1),
                         "c_compile_s": round(c_compile, 2), "max_abs_diff": diff})
    return rows


def main(argv: list[str] | None = None) -> int:
    from compiler import zoo

    ap = argparse.ArgumentParser(prog="python -m bench.cbackend", description=__doc__)
    ap.add_argument("--models", default=",".join(zoo.NAMES))
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = run([m for m in args.models.split(",") if m], args.seconds)
    if args.json:
        print(json.dumps({"threads": os.environ.get("TVM_NUM_THREADS"), "rows": rows}))
    else:
        print(f"{'model':24} {'relax-vm us':>12} {'c us':>10} {'c compile s':>12} {'max diff':>10}")
        for r in rows:
            print(f"{r['model']:24} {r['vm_us']:>12} {r['c_us']:>10} {r['c_compile_s']:>12} "
                  f"{r['max_abs_diff']:>10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
