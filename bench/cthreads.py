"""C-backend latency at several thread counts, same artifact, same process, interleaved rounds.

    python -m bench.cthreads [--models a,b] [--threads 1,2] [--seconds S] [--json]

Each zoo model (batch 1, seed 0, untuned default schedules) is compiled once for ``x86_64-c``;
the pool's thread count is switched with ``CLibrary.set_threads`` between rounds, so machine load
hits every count alike. Reports the median latency per count, the speed-up of each count over
the first, and checks the outputs are bit-identical across counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.cbackend import _median_us

__all__ = ["run", "main"]


def run(models: list[str], threads: list[int], seconds: float = 2.0, rounds: int = 5) -> list[dict[str, Any]]:
    from compiler import compile_model, load_artifact, zoo
    from compiler.clib import LIB_NAME, CLibrary

    rows = []
    with tempfile.TemporaryDirectory(prefix="fractal-cthreads-") as tmp:
        for name in models:
            onnx_path = zoo.save(name, Path(tmp) / f"{name}.onnx")
            out = compile_model(onnx_path, target="x86_64-c", out_dir=Path(tmp) / name, progress=False)
            art, lib = load_artifact(out), CLibrary(out / LIB_NAME)
            x = {"x": np.random.default_rng(0).standard_normal(zoo.input_shape(name)).astype(np.float32)}
            us: dict[int, list[float]] = {n: [] for n in threads}
            ref, identical = None, True
            for _ in range(rounds):
                for n in threads:
                    lib.set_threads(n)
                    y = art.infer(x)[art.outputs[0].name]
                    ref = y if ref is None else ref
                    identical &= y.tobytes() == ref.tobytes()
                    us[n].append(_median_us(lambda a=art, x=x: a.infer(x), seconds / rounds))
            med = {n: statistics.median(v) for n, v in us.items()}
            rows.append({"model": name, "us": {str(n): round(v, 1) for n, v in med.items()},
                         "speedup": {str(n): round(med[threads[0]] / v, 2) for n, v in med.items()},
                         "bit_identical": identical})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cthreads", description=__doc__)
    ap.add_argument("--models", default="ds-cnn-kws,resnet8-cifar10,mobilenet-v1-0.25-vww")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",") if t]
    rows = run([m for m in args.models.split(",") if m], threads, args.seconds)
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"threads": threads, "loadavg": load, "rows": rows}))
    else:
        for r in rows:
            print(r["model"], r["us"], r["speedup"], "bit-identical" if r["bit_identical"] else "DIFFERENT")
        print("load average", load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
