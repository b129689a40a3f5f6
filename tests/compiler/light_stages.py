"""Untuned compile of ONNX's `light` networks stage by stage, and their latency vs onnxruntime.

    PYTHONPATH=. .venv/bin/python tests/compiler/light_stages.py [NETWORK ...]   (e.g. resnet50)

Per network (``light_<name>.onnx`` from the onnx wheel's backend data, issue 29), seconds spent in
each step of ``compile_model`` without ``--tune`` on this machine's preset (wall clock; the total
also in CPU seconds, ``compile_cpu_s``, steadier on a shared machine, and each step's in ``cpu``):
import, the channels-last conversion (``nhwc``: whether it ran), ``tuning.prepare``
(legalization and fusion; it converts the layout again), ``schedules.schedule_prepared`` (the
default schedules, measured when this machine runs the target), pre-packing, ``relax.build``
(TVM's lowering, LLVM's optimisation) and ``export_library`` (LLVM's machine code and the link,
as ``compile_model`` does); ``cached`` / ``timed``: kernels whose schedule choice came from the
per-machine cache (``$FRACTAL_SCHEDULE_CACHE``, :mod:`compiler.schedule_cache`) / workloads
timed in this run. Then the median latency of the exported library's ``main`` (1 thread)
against onnxruntime's (1 thread, sequential) on the conformance test's dummy input, their
ratio, the max abs difference and the load average. One JSON line per network. ``THREADS`` sets
the thread count of both. ``--profile`` adds where the CPU seconds of the schedule and build
steps go (``prof``: the variant libraries' LLVM (optimisation and machine code) and TVM
lowering, the timing runs, the rest of the schedule step (applying the rules); the final
build's TVM passes and LLVM, the export). ``--no-latency`` skips the latency measurement.
Not a test (no test_ prefix).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("import", "prepare", "schedule", "prepack", "build", "export")  # compile_s: their sum
NAMES = ("squeezenet", "bvlc_alexnet", "zfnet512", "shufflenet", "inception_v1", "vgg19", "resnet50",
         "inception_v2", "densenet121")


class _Profile:
    """CPU seconds by kind of work (``--profile``): wraps TVM's LLVM code generation and the
    schedule step's variant timing (:func:`compiler.schedules._time_all`)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.phase = "other"

    def add(self, key: str, seconds: float) -> None:
        self.cpu[key] = self.cpu.get(key, 0.0) + seconds

    def install(self) -> None:
        import tvm
        import tvm.tirx  # noqa: F401

        from compiler import schedules

        build_mod = sys.modules["tvm.tirx.build"]
        codegen, build, time_all = build_mod.tir_to_runtime, tvm.tirx.build, schedules._time_all
        prof = self

        def timed(key: str, fn: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t = time.process_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    prof.add(key(), time.process_time() - t)
            return wrapper

        def build_and_load(mod: Any, *args: Any, **kwargs: Any) -> Any:
            lib = build(mod, *args, **kwargs)
            if prof.phase == "variants":  # LLVM's machine code: made when a function is first looked up
                t = time.process_time()
                lib.get_function(next(iter(mod.functions)).name_hint, query_imports=True)
                prof.add("variants_jit", time.process_time() - t)
            return lib

        build_mod.tir_to_runtime = timed(lambda: f"{prof.phase}_llvm", codegen)
        tvm.tirx.build = timed(lambda: f"{prof.phase}_tir+llvm", build_and_load)
        schedules._time_all = timed(lambda: "variants_all", time_all)

    def row(self) -> dict[str, float]:
        c = self.cpu
        jit = c.get("variants_jit", 0.0)
        out = {"variant_llvm": c.get("variants_llvm", 0.0) + jit,
               "variant_tvm": c.get("variants_tir+llvm", 0.0) - c.get("variants_llvm", 0.0) - jit,
               "timing_runs": c.get("variants_all", 0.0) - c.get("variants_tir+llvm", 0.0),
               "build_llvm": c.get("build_llvm", 0.0),
               "build_tvm": c.get("build_step", 0.0) - c.get("build_llvm", 0.0)}
        out["schedule_rest"] = c.get("schedule_step", 0.0) - c.get("variants_all", 0.0)
        out["export"] = c.get("export_step", 0.0)  # LLVM's machine code and the link (CPU of
        # this process: the linker's own is not counted)
        return {k: round(v, 1) for k, v in out.items()}


PROFILE: _Profile | None = None


def stages(name: str, target: Any, latency: bool = True) -> dict[str, Any]:
    import tvm
    from tvm import relax, tirx

    from bench.compile import _ort_session, measure
    from compiler import layout, schedules
    from compiler import prepack as _prepack
    from compiler.importer import import_model, load_onnx
    from compiler.runtime import _flatten
    from compiler.schedule_cache import Decisions, cache_root
    from compiler.tuning import prepare
    from tests.compiler.conformance import data_root

    path = data_root() / "light" / f"light_{name}.onnx"
    row: dict[str, Any] = {"model": name}
    t = time.perf_counter()
    cpu0 = time.process_time()

    cpu_laps: dict[str, float] = {}
    c = cpu0

    def lap(key: str) -> None:
        nonlocal t, c
        row[key] = round(time.perf_counter() - t, 2)
        cpu_laps[key] = round(time.process_time() - c, 1)
        t, c = time.perf_counter(), time.process_time()

    imp = import_model(load_onnx(path))
    lap("import")
    mod = _prepack.fold_batchnorm(imp.mod)
    layout_cpu = time.process_time()
    row["nhwc"] = layout.channels_last(mod) is not mod
    layout_cpu = time.process_time() - layout_cpu
    lap("layout")
    prep = prepare(mod, target, fold_in_numpy=True)  # as schedules.apply (untuned builds)
    lap("prepare")
    row["primfuncs"] = sum(1 for f in prep.functions.values() if isinstance(f, tirx.PrimFunc))
    decisions = Decisions(target, cache_root())  # as compile_model: choices cached per machine
    prof = PROFILE
    if prof is not None:
        prof.cpu.clear()
        prof.phase, c0 = "variants", time.process_time()
    sch = schedules.schedule_prepared(prep, target, decisions=decisions)
    decisions.save()
    if prof is not None:
        prof.add("schedule_step", time.process_time() - c0)
    row["cached"], row["timed"] = decisions.hits, decisions.timed
    lap("schedule")
    with target, tvm.transform.PassContext(opt_level=3):
        sch = _prepack.after_tuning()(sch)
    lap("prepack")
    if prof is not None:
        prof.phase, c0 = "build", time.process_time()
    ex = relax.build(sch, target=target)
    if prof is not None:
        prof.add("build_step", time.process_time() - c0)
    lap("build")
    with tempfile.TemporaryDirectory(prefix="light-stages-") as tmp:
        lib_path = os.path.join(tmp, "lib.so")
        if prof is not None:
            prof.phase, c0 = "export", time.process_time()
        ex.export_library(lib_path)  # as compile_model: LLVM's machine code, then the linker
        if prof is not None:
            prof.add("export_step", time.process_time() - c0)
            row["prof"] = prof.row()
        lap("export")
        loaded = tvm.runtime.load_module(lib_path)
    row["compile_s"] = round(sum(row[k] for k in STEPS), 1)
    # CPU seconds of this process (1 thread): what the compile costs whatever else the machine
    # runs (the layout step apart: compile_model converts the layout in prepare only)
    row["compile_cpu_s"] = round(time.process_time() - cpu0 - layout_cpu, 1)
    row["cpu"] = cpu_laps  # CPU seconds of each step
    if not latency:
        return row

    dev = tvm.cpu()
    vm = relax.VirtualMachine(loaded, dev)
    params = [tvm.runtime.tensor(p, dev) for p in imp.params]
    if _prepack.has_transform(sch):
        params = _flatten(vm[_prepack.TRANSFORM_FUNC](params), [])
    spec = imp.inputs[0]
    n = int(np.prod(spec.shape))
    x = (np.arange(n).reshape(spec.shape) / n).astype(np.float32)  # the conformance test's input
    xt = tvm.runtime.tensor(x, dev)
    main = vm["main"]
    out = main(xt, *params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    sess = _ort_session(path, int(os.environ.get("THREADS", "1")))
    want = sess.run(None, {spec.name: x})[0]
    row["max_abs_err"] = float(np.abs(got - want).max())
    row["tvm_us"] = measure(lambda: main(xt, *params), min_seconds=3, min_runs=5)["median_us"]
    row["ort_us"] = measure(lambda: sess.run(None, {spec.name: x}), min_seconds=3, min_runs=5)["median_us"]
    row["ratio"] = round(row["tvm_us"] / row["ort_us"], 3)
    row["load"] = round(os.getloadavg()[0], 1)
    return row


def main(argv: list[str]) -> None:
    sys.path.insert(0, ROOT)
    from bench.compile import set_threads
    from compiler.targets import best_host_preset_name, get_preset

    set_threads(int(os.environ.get("THREADS", "1")))
    target = get_preset(best_host_preset_name()).tvm_target()
    global PROFILE
    if "--profile" in argv:
        PROFILE = _Profile()
        PROFILE.install()
    latency = "--no-latency" not in argv
    for name in [a for a in argv if not a.startswith("--")] or NAMES:
        print(json.dumps(stages(name, target, latency)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
