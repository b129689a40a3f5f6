"""Per-operator profile of an untuned (default-schedule, pre-packed) TVM build vs onnxruntime.

    PYTHONPATH=. .venv/bin/python tests/compiler/profile_ops.py [--target x86_64-avx512] [--int8] [MODEL ...]

TVM side: every fused PrimFunc the inference ``main`` calls (the module ``compile_model`` builds
without ``--tune``; ``--nchw``: without the channels-last conversion), timed alone with
``time_evaluator`` on random inputs (best of 5 repeats, 1 thread), with its calls per inference.
onnxruntime side: ``SessionOptions.enable_profiling`` on the same model (1 thread, sequential), the
median per-node ``kernel_time`` over the profiled runs. Prints, per model, TVM's kernels sorted by
time and onnxruntime's nodes sorted by time (JSON lines). Not a test (no test_ prefix).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ["TVM_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402


def tvm_kernels(onnx_path: Path, target_name: str, nchw: bool = False,
                integer: bool = False) -> list[tuple[str, float, int, str]]:
    """(fused function, us per call, calls per inference, one-line shape summary) for every
    PrimFunc the default build's ``main`` calls (``nchw``: without the channels-last conversion,
    the previous default; ``integer``: a QDQ model on the integer kernels). Functions only the
    parameter transform calls are left out."""
    import re

    from tvm import tirx

    from compiler import layout, prepack, schedules
    from compiler.importer import import_model, load_onnx
    from compiler.schedules import _time_all
    from compiler.targets import get_preset

    preset = get_preset(target_name)
    target = preset.tvm_target()
    mod = import_model(load_onnx(onnx_path), integer=integer, target=target).mod
    mod = prepack.fold_batchnorm(mod)
    keep = layout.wants_channels_last
    if nchw:
        layout.wants_channels_last = lambda _t: False
    try:
        mod = schedules.apply(mod, target)
    finally:
        layout.wants_channels_last = keep
    mod = prepack.after_tuning()(mod)
    main_text = mod["main"].script()
    calls = {gv.name_hint: len(re.findall(rf"call_tir\((?:cls\.)?{re.escape(gv.name_hint)}\b", main_text))
             for gv in mod.functions}
    funcs = {gv.name_hint: f for gv, f in mod.functions.items()
             if isinstance(f, tirx.PrimFunc) and calls[gv.name_hint]}
    times = _time_all(funcs, target)

    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    def shapes(f: object) -> str:
        return " ".join("x".join(str(d) for d in a.shape) for a in ArgInfo.from_prim_func(f))

    return sorted(((n, t, calls[n], shapes(funcs[n])) for n, t in times.items()), key=lambda r: -r[1] * r[2])


def ort_nodes(onnx_path: Path, x: np.ndarray, runs: int = 200) -> list[tuple[str, str, float]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = str(onnx_path.with_suffix(""))
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    for _ in range(runs):
        sess.run(None, {name: x})
    trace = json.loads(Path(sess.end_profiling()).read_text())
    per: dict[tuple[str, str], list[float]] = defaultdict(list)
    for ev in trace:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            per[(ev["name"][: -len("_kernel_time")], ev["args"].get("op_name", ""))].append(float(ev["dur"]))
    return sorted(((n, op, statistics.median(v[runs // 4:])) for (n, op), v in per.items()),
                  key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--target", default="x86_64-avx512")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--nchw", action="store_true",
                    help="profile the build without the channels-last conversion")
    ap.add_argument("--int8", action="store_true",
                    help="the models quantized (compiler.quantize, as bench.int8), on integer kernels")
    args = ap.parse_args()

    from bench.compile import set_threads
    from compiler import zoo

    set_threads(1)
    work = Path(tempfile.mkdtemp(prefix="profile-ops-"))
    for name in args.models or ["ds-cnn-kws", "mobilenet-v1-0.25-vww"]:
        onnx_path = zoo.save(name, work / f"{name}.onnx")
        x = np.random.default_rng(0).standard_normal(zoo.input_shape(name)).astype(np.float32)
        if args.int8:
            from compiler.quantize import quantize_int8

            cal = work / f"{name}-cal.npz"
            np.savez(cal, x=np.random.default_rng(0).standard_normal((64, *zoo.input_shape(name)[1:]))
                     .astype(np.float32))
            onnx_path = quantize_int8(onnx_path, cal, work / f"{name}.int8.onnx")[0]
        tvm_rows = tvm_kernels(onnx_path, args.target, nchw=args.nchw, integer=args.int8)
        ort_rows = ort_nodes(onnx_path, x)
        print(json.dumps({"model": name, "target": args.target,
                          "layout": "NCHW" if args.nchw else "default", "int8": args.int8,
                          "tvm_total_us": round(sum(r[1] * r[2] for r in tvm_rows), 1),
                          "ort_total_us": round(sum(r[2] for r in ort_rows), 1),
                          "load1": round(os.getloadavg()[0], 2)}))
        for n, t, k, s in tvm_rows[: args.top]:
            print(json.dumps({"side": "tvm", "func": n, "us": round(t, 2), "calls": k, "buffers": s}))
        for n, op, t in ort_rows[: args.top]:
            print(json.dumps({"side": "ort", "node": n, "op": op, "us": round(t, 2)}))


if __name__ == "__main__":
    sys.exit(main())
