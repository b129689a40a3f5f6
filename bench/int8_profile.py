"""Where an int8 build's time goes: every compiled kernel of one call, timed alone, by kind.

    TVM_NUM_THREADS=1 python -m bench.int8_profile [--model mobilenet-v1-0.25-vww]
        [--target x86_64-avx2] [--calls 300] [--json]

The zoo model is quantized and compiled as ``bench.int8`` does (integer kernels, untuned), then
run ``--calls`` times through ``Artifact.infer`` (the call's median, as ``bench.int8`` times
it). One run with a VM instrument records every compiled kernel it calls and the arguments;
each kernel is then timed alone on those arguments (median of 7 batches, through the same
packed-function call the VM makes). What the kernels do not account for is the rest of
``infer()``: the VM's own work between them (its builtins: tensor and storage allocation, null
values; the interpreter loop) and the inputs' and outputs' way across (checks, conversion).
Groups: the int8 convolutions and matmuls, the depthwise kernels, padding copies, the other
compiled kernels (zero-point shifts, quantize / dequantize at the edges, the pooling head), and
the rest of ``infer()``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "group_of"]


def group_of(symbol: str) -> str:
    """The group a compiled kernel's symbol falls in (see the module's docstring)."""
    if "depthwise" in symbol:
        return "depthwise"
    if symbol.startswith("fractal_int8_") or symbol.startswith("fractal_matmul"):
        return "int8 conv / matmul"
    if symbol.startswith("pad"):
        return "padding"
    return "other kernels"


def profile(model: str, target: str, calls: int, work: Path) -> dict[str, Any]:
    from bench.int8 import _prepare

    _prepare([model], target, work)
    from compiler import load_artifact, zoo

    art = load_artifact(work / f"{model}-int8")
    x = {"x": np.random.default_rng(1).standard_normal(zoo.input_shape(model)).astype(np.float32)}
    for _ in range(100):
        art.infer(x)
    plain = []
    for _ in range(calls):
        t0 = time.perf_counter()
        art.infer(x)
        plain.append(time.perf_counter() - t0)
    vm = art._infer.vm()  # this thread's VM, the one art.infer runs (bench-only look inside)
    spent: dict[str, float] = collections.defaultdict(float)  # ns a run, per kernel symbol
    count: collections.Counter[str] = collections.Counter()  # calls a run, per symbol

    kernels: list[tuple[str, Any, tuple[Any, ...]]] = []  # every compiled kernel call of one run

    def instrument(func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
        if before:
            count[symbol] += 1
            if not symbol.startswith("vm.builtin"):
                kernels.append((symbol, func, args))
        return 0  # VMInstrumentReturnKind.NO_OP: run the call

    vm.set_instrument(instrument)
    art.infer(x)
    vm.set_instrument(lambda *a: 0)  # (the VM holds no way to unset it; this one does nothing)
    for symbol, func, args in kernels:  # each kernel alone, on the run's own arguments
        for _ in range(20):
            func(*args)
        runs = []
        for _ in range(7):
            t0 = time.perf_counter_ns()
            for _ in range(calls // 7 + 1):
                func(*args)
            runs.append((time.perf_counter_ns() - t0) / (calls // 7 + 1))
        spent[symbol] += statistics.median(runs)
    plain_us = statistics.median(plain) * 1e6
    groups: dict[str, dict[str, float]] = {}
    for symbol, ns in spent.items():
        g = groups.setdefault(group_of(symbol), {"us": 0.0, "calls": 0})
        g["us"] += ns / 1e3
        g["calls"] += count[symbol]
    kernel_us = sum(g["us"] for g in groups.values())
    builtins = sum(n for s, n in count.items() if s.startswith("vm.builtin"))
    groups["the rest of infer()"] = {"us": max(0.0, plain_us - kernel_us), "calls": builtins}
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:12]
    return {"model": model, "target": target, "plain_us": round(plain_us, 1),
            "groups": {k: {"us": round(v["us"], 1), "calls": int(v["calls"])} for k, v in groups.items()},
            "top": [{"symbol": s, "us": round(ns / 1e3, 2), "calls": count[s]} for s, ns in top]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.int8_profile", description=__doc__)
    ap.add_argument("--model", default="mobilenet-v1-0.25-vww")
    ap.add_argument("--target", default="x86_64-avx2")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.calls < 1:
        print("error: --calls must be at least 1", file=sys.stderr)
        return 2
    from compiler import zoo

    if args.model not in zoo.NAMES:
        print(f"error: unknown zoo model {args.model!r}; choose one of: {', '.join(zoo.NAMES)}",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fractal-int8-profile-") as tmp:
        out = profile(args.model, args.target, args.calls, Path(tmp))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']} on {out['target']}: {out['plain_us']} us a call (median)")
    total = sum(g["us"] for g in out["groups"].values())
    for name, g in sorted(out["groups"].items(), key=lambda kv: -kv[1]["us"]):
        print(f"  {name:20s} {g['us']:8.1f} us  {100 * g['us'] / total:5.1f}%  {g['calls']:3d} calls")
    print("  the most expensive kernels, alone:")
    for t in out["top"]:
        print(f"    {t['us']:8.2f} us  x{t['calls']}  {t['symbol']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
