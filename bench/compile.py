"""The compile benchmark: for each zoo model, onnxruntime vs TVM untuned vs TVM tuned, in one run.

Per model (batch 1, seed 0): onnxruntime latency; TVM latency untuned; MetaSchedule tuning time
and TVM latency tuned (``trials`` measured candidates, a fresh database); recompile time with
that warm database (no trials); max abs error of the tuned artifact against onnxruntime.

Both engines run on the same number of threads (``threads``; onnxruntime
``intra_op_num_threads`` + sequential execution, TVM's thread pool via ``TVM_NUM_THREADS``,
which must be set before TVM starts its pool, so :func:`set_threads` runs first). Latency is the
median of timed calls after a warm-up, numpy in and numpy out on both sides:
``InferenceSession.run`` vs the artifact's Relax VM ``main`` called on zero-copy DLPack views.
Also reported: ``vm_us`` (the bare VM call on ready device tensors), ``artifact_infer_us``
(``Artifact.infer``: input checks, outputs owned by the caller; ~5 us over the bare call here)
and ``param_swap_us`` (``Artifact.prepare_params``: what a parameter swap costs, including the
pre-packing transform). ``prepack=False`` compiles without pre-packing, for comparison.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.host import machine
from compiler.errors import CompilerError
from compiler.manifest import Manifest

__all__ = ["run_compile_bench", "bench_model", "measure", "set_threads", "NATIVE"]

FORMAT = 1
NATIVE = "native"


def set_threads(threads: int) -> int:
    """Make TVM's runtime use ``threads`` threads (and MetaSchedule's runner workers, via the env)."""
    os.environ["TVM_NUM_THREADS"] = str(threads)
    import tvm  # noqa: F401 - loads the runtime that registers the thread-pool functions
    import tvm_ffi

    tvm_ffi.get_global_func("runtime.config_threadpool")(1, threads)
    got = int(tvm_ffi.get_global_func("runtime.NumThreads")())
    if got != threads:
        raise CompilerError(f"TVM runs {got} thread(s), the benchmark asked for {threads}",
                            hint=f"TVM's thread pool started earlier: run with TVM_NUM_THREADS={threads}")
    return got


def measure(fn: Callable[[], Any], *, min_seconds: float = 1.0, min_runs: int = 20, max_runs: int = 5000,
            warmup: int = 5) -> dict[str, float]:
    """Median / p10 / p90 latency of ``fn()`` in microseconds over at least ``min_seconds``."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    t_end = time.perf_counter() + min_seconds
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    q = statistics.quantiles(times, n=10) if len(times) >= 10 else [times[0]] * 9

    def us(v: float) -> float:
        return round(v * 1e6, 2)

    return {"median_us": us(statistics.median(times)), "p10_us": us(q[0]), "p90_us": us(q[-1]),
            "runs": len(times)}


def _ort_session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _tvm_latency(art_dir: Path, x: np.ndarray, min_seconds: float) -> tuple[dict[str, float],
                                                                               dict[str, np.ndarray]]:
    """TVM latency three ways: the VM call with numpy in/out (zero-copy DLPack both ways: the
    engine-level figure compared with onnxruntime), the bare VM call on ready device tensors, and
    ``Artifact.infer`` (the artifact API with its input checks)."""
    import tvm_ffi

    from compiler.artifact import aligned_copy, load_artifact

    art = load_artifact(art_dir)
    # TVM's kernels may assume 64-byte aligned buffers (a tuned resnet8-cifar10 segfaulted on a
    # numpy array's 16-byte alignment): the zero-copy call gets an aligned input, as infer() makes
    x = aligned_copy(x)
    inputs = {art.inputs[0].name: x}
    out = art.infer(inputs)
    runtime = art._infer  # benchmark internals on purpose: the VM under the artifact API
    assert runtime is not None and art._default is not None  # (a host-stage-only model has no library)
    params = art._default.tensors
    main = runtime.vm()["main"]
    from_dlpack = tvm_ffi.from_dlpack

    def numpy_call() -> np.ndarray:
        return np.from_dlpack(main(from_dlpack(x), *params))

    np.testing.assert_array_equal(numpy_call(), next(iter(out.values())))
    lat = measure(numpy_call, min_seconds=min_seconds)
    ready = [runtime.tensor(x), *params]
    lat["vm_us"] = measure(lambda: main(*ready), min_seconds=min_seconds / 2)["median_us"]
    lat["artifact_infer_us"] = measure(lambda: art.infer(inputs), min_seconds=min_seconds / 2)["median_us"]
    # what a parameter swap (a committed round) costs: checks, aligned copies, and with pre-packing
    # main_transform_params (BatchNorm folding, weight layout rewrites)
    lat["param_swap_us"] = measure(lambda: art.prepare_params(art.params), min_seconds=min_seconds / 4,
                                   min_runs=10)["median_us"]
    return lat, out


def bench_model(name: str, work: Path, *, trials: int, threads: int, target: str, db_dir: Path,
                min_seconds: float = 1.0, log: Callable[[str], None] = lambda s: None,
                prepack: bool = True) -> dict[str, Any]:
    """Benchmark one zoo model (see the module docstring); returns its row."""
    from compiler import zoo
    from compiler.build import compile_model

    onnx_path = zoo.save(name, work / f"{name}.onnx")
    x = np.random.default_rng(0).standard_normal(zoo.input_shape(name)).astype(np.float32)
    row: dict[str, Any] = {"model": name, "input_shape": list(x.shape)}

    sess = _ort_session(onnx_path, threads)
    ref = sess.run(None, {"x": x})[0]
    row["onnxruntime"] = measure(lambda: sess.run(None, {"x": x}), min_seconds=min_seconds)
    log(f"{name}: onnxruntime {row['onnxruntime']['median_us']} us")

    t0 = time.perf_counter()
    plain = compile_model(onnx_path, target=target, out_dir=work / f"{name}-untuned", progress=False,
                          prepack=prepack)
    row["compile_untuned_s"] = round(time.perf_counter() - t0, 2)
    lat, out = _tvm_latency(plain, x, min_seconds)
    row["tvm_untuned"] = lat
    row["untuned_max_abs_err"] = float(np.abs(next(iter(out.values())) - ref).max())
    log(f"{name}: TVM untuned {lat['median_us']} us")

    t0 = time.perf_counter()
    tuned = compile_model(onnx_path, target=target, out_dir=work / f"{name}-tuned", tune=True, trials=trials,
                          db_dir=db_dir, progress=False, prepack=prepack)
    row["compile_tuned_s"] = round(time.perf_counter() - t0, 2)
    tuning = Manifest.read(tuned).tuning
    row["tuning"] = {"trials": trials, "trials_run": tuning.trials_run, "seconds": tuning.seconds,
                     "reused": tuning.reused, "db_id": tuning.db_id}
    lat, out = _tvm_latency(tuned, x, min_seconds)
    row["tvm_tuned"] = lat
    row["tuned_max_abs_err"] = float(np.abs(next(iter(out.values())) - ref).max())
    log(f"{name}: tuned in {row['tuning']['seconds']} s, TVM tuned {lat['median_us']} us")

    t0 = time.perf_counter()
    again = compile_model(onnx_path, target=target, out_dir=work / f"{name}-recompiled", tune=True,
                          trials=trials, db_dir=db_dir, progress=False, prepack=prepack)
    row["recompile_warm_db_s"] = round(time.perf_counter() - t0, 2)
    row["recompile_reused"] = Manifest.read(again).tuning.reused

    ort_us = row["onnxruntime"]["median_us"]
    row["ratio_untuned_vs_ort"] = round(row["tvm_untuned"]["median_us"] / ort_us, 3)
    row["ratio_tuned_vs_ort"] = round(row["tvm_tuned"]["median_us"] / ort_us, 3)
    log(f"{name}: tuned/ort {row['ratio_tuned_vs_ort']}, recompile {row['recompile_warm_db_s']} s")
    return row


def run_compile_bench(models: Sequence[str] | None = None, *, trials: int = 64,
                      trials_for: Mapping[str, int] | None = None, threads: int = 1, target: str = NATIVE,
                      db_dir: str | Path | None = None, min_seconds: float = 1.0,
                      work_dir: str | Path | None = None,
                      log: Callable[[str], None] = lambda s: None, prepack: bool = True) -> dict[str, Any]:
    """Run the benchmark over ``models`` (default: every zoo model); one JSON-able dict.

    ``trials`` per model unless ``trials_for`` names the model; ``target`` a preset name or
    ``"native"``: the most specific preset this CPU runs (``x86_64-avx512`` on an AVX-512 host),
    since onnxruntime picks its kernels for the CPU it runs on and comparing with a generic
    preset would measure the ISA, not the compilers. ``db_dir`` None: a fresh database
    directory (so the tuning time is real, never a cache hit)."""
    from compiler import zoo
    from compiler.targets import best_host_preset_name, get_preset

    names = list(models or zoo.NAMES)
    per_model = {n: int((trials_for or {}).get(n, trials)) for n in names}
    for n in [*names, *(trials_for or {})]:
        if n not in zoo.NAMES:
            raise CompilerError(f"unknown zoo model {n!r}", hint=f"choose from: {', '.join(zoo.NAMES)}")
    if min(per_model.values(), default=1) < 1 or threads < 1:
        raise CompilerError("--trials and --threads must be >= 1", hint="e.g. --trials 32 --threads 1")
    set_threads(threads)
    if target == NATIVE:
        target = best_host_preset_name()
    preset = get_preset(target)
    result = _run(names, per_model, threads, target, db_dir, min_seconds, work_dir, log, prepack)
    result["target"] = {"preset": target, "tvm_target": dict(preset.target)}
    result["prepack"] = prepack
    return result


def _run(names: list[str], per_model: dict[str, int], threads: int, target: str, db_dir: str | Path | None,
         min_seconds: float, work_dir: str | Path | None, log: Callable[[str], None],
         prepack: bool = True) -> dict[str, Any]:
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="fractal-bench-compile-")) if work_dir is None else Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    db = Path(db_dir) if db_dir is not None else work / "tuning-db"
    t0 = time.perf_counter()
    try:
        rows = [bench_model(n, work, trials=per_model[n], threads=threads, target=target, db_dir=db,
                            min_seconds=min_seconds, log=log, prepack=prepack) for n in names]
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    at_or_below = [r["model"] for r in rows if r["ratio_tuned_vs_ort"] <= 1.0]
    half = [r["model"] for r in rows if r["ratio_tuned_vs_ort"] <= 0.5]
    return {
        "format": FORMAT,
        "bench": "compile",
        "machine": machine(),
        "target": target,
        "threads": threads,
        "trials_per_model": per_model,
        "latency": ("median us per call, batch 1, numpy in and out: InferenceSession.run vs the TVM VM "
                    "call via DLPack; vm_us = bare VM call, artifact_infer_us = Artifact.infer"),
        "models": {r["model"]: r for r in rows},
        "summary": {
            "tuned_at_or_below_ort": at_or_below,
            "tuned_at_most_half_ort": half,
            "goal_met": len(at_or_below) == len(rows) and len(half) >= 2,
            "total_seconds": round(time.perf_counter() - t0, 1),
        },
    }
