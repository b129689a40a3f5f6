"""The trials-vs-latency curve of one zoo model, from ONE long tuning run.

MetaSchedule appends records to ``database_tuning_record.json`` in the order it measures them,
so the database a K-trial run would have left is (up to the budget split) the first K records
of a longer run: :func:`compiler.tuning.truncate_database`. For each K the model is compiled
against that truncated database (no trials run) and timed next to onnxruntime, in the same
process, on the same threads (bench.compile's measurement). The full database also gives the
cold tuning time (``tune.json``) and the warm-database recompile time, timed here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.compile import _ort_session, _tvm_latency, measure, set_threads
from bench.host import machine
from compiler.errors import CompilerError

__all__ = ["run_trials_curve"]


def run_trials_curve(name: str, db_dir: str | Path, points: Sequence[int], *, target: str, threads: int = 1,
                     min_seconds: float = 1.0, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Latency at each K in ``points`` trials (first K records of the database of ``name`` for
    ``target`` in ``db_dir``), with onnxruntime timed at every point; one JSON-able dict."""
    from compiler import tuning, zoo
    from compiler.build import compile_model
    from compiler.importer import import_model
    from compiler.targets import get_preset

    set_threads(threads)
    preset = get_preset(target)
    src = tuning.database_path(import_model(zoo.build(name)).mod, preset.tvm_target(), db_dir, prepack=True)
    records = len((src / "database_tuning_record.json").read_text().splitlines()) if src.is_dir() else 0
    if not records:
        raise CompilerError(f"no tuning records for {name} / {target} in {db_dir}", hint="tune it first")
    meta = json.loads((src / "tune.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="fractal-bench-curve-"))
    rows: list[dict[str, Any]] = []
    try:
        onnx_path = zoo.save(name, work / f"{name}.onnx")
        x = np.random.default_rng(0).standard_normal(zoo.input_shape(name)).astype(np.float32)
        sess = _ort_session(onnx_path, threads)
        ref = sess.run(None, {"x": x})[0]
        for k in sorted({min(int(p), records) for p in points}):
            db_k = work / f"db-{k}"
            tuning.truncate_database(src, db_k / src.parent.name / src.name, k)
            art = compile_model(onnx_path, target=target, out_dir=work / f"art-{k}", tune=True, trials=k,
                                db_dir=db_k, progress=False)
            info = json.loads((art / "manifest.json").read_text())["tuning"]
            if info["trials_run"]:
                raise CompilerError(f"the truncated database ran {info['trials_run']} trials", hint="a bug")
            ort_us = measure(lambda: sess.run(None, {"x": x}), min_seconds=min_seconds)["median_us"]
            lat, out = _tvm_latency(art, x, min_seconds)
            row = {"trials": k, "onnxruntime_us": ort_us, "tvm_us": lat["median_us"],
                   "ratio": round(lat["median_us"] / ort_us, 3), "applied": info.get("applied"),
                   "max_abs_err": float(np.abs(next(iter(out.values())) - ref).max())}
            log(f"{name}: {k} trials: TVM {row['tvm_us']} us, onnxruntime {ort_us} us, x{row['ratio']}")
            rows.append(row)
        # the warm-database recompile of the full run, against its cold tuning time
        t0 = time.perf_counter()
        again = compile_model(onnx_path, target=target, out_dir=work / "recompiled", tune=True,
                              trials=int(meta["trials"]), db_dir=db_dir, progress=False)
        recompile_s = round(time.perf_counter() - t0, 2)
        assert json.loads((again / "manifest.json").read_text())["tuning"]["trials_run"] == 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"bench": "trials_curve", "model": name, "target": target, "threads": threads,
            "machine": machine(), "records": records, "tuning_seconds": meta.get("seconds"),
            "tuning_trials": meta.get("trials"), "recompile_warm_db_s": recompile_s,
            "recompile_share_of_tuning": round(recompile_s / float(meta.get("seconds") or 1), 4),
            "method": "first K records of one tuning run (records are appended in measurement order)",
            "points": rows}
