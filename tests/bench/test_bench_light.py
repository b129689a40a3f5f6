"""The untuned-compile figures of the `light` networks (issue 29; marker bench: `make bench`):
`tests/compiler/light_stages.py` on SqueezeNet 1.0, the smallest, against onnxruntime in the
same run, first with an empty schedule cache (the first compile a user gets), then again with the
cache it filled. Asserts that the harness measures and agrees with itself, not the timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("import", "prepare", "schedule", "prepack", "build", "export")


def _stages(cache: Path, *args: str) -> dict:
    env = {**os.environ, "FRACTAL_SCHEDULE_CACHE": str(cache), "PYTHONPATH": str(ROOT), "THREADS": "1"}
    p = subprocess.run([sys.executable, "tests/compiler/light_stages.py", *args, "squeezenet"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["model"] == "squeezenet", p.stdout
    return rows[0]


def test_untuned_compile_stages_and_latency_against_onnxruntime(tmp_path):
    cache = tmp_path / "schedules"
    cold = _stages(cache, "--profile")
    assert cold["nhwc"] is True and cold["primfuncs"] > 20
    # an empty cache: every choice was made here, by timing
    assert cold["cached"] == 0 and cold["timed"] > 0
    assert cold["compile_s"] == pytest.approx(sum(cold[k] for k in STEPS), abs=0.2)
    assert set(STEPS) <= set(cold["cpu"]) and 0 < cold["compile_cpu_s"]
    assert cold["compile_cpu_s"] == pytest.approx(sum(cold["cpu"][k] for k in STEPS), abs=0.5)
    prof = cold["prof"]
    # the variants' libraries were built and timed; the final build ran LLVM
    assert prof["variant_llvm"] > 0 and prof["timing_runs"] > 0 and prof["build_llvm"] > 0, prof
    assert prof["variant_llvm"] + prof["variant_tvm"] + prof["timing_runs"] + prof["schedule_rest"] \
        <= cold["cpu"]["schedule"] + 0.5, (prof, cold["cpu"])
    # the compiled network against onnxruntime, both timed in this run
    assert cold["max_abs_err"] < 1e-3
    assert cold["tvm_us"] > 0 and cold["ort_us"] > 0
    assert cold["ratio"] == pytest.approx(cold["tvm_us"] / cold["ort_us"], abs=0.002)
    assert cold["load"] >= 0
    assert list(cache.rglob("*.json")), "the first compile saved its choices"

    warm = _stages(cache, "--no-latency")  # the same network again: every choice from the cache
    assert warm["timed"] == 0 and warm["cached"] >= cold["timed"], (cold, warm)
    assert "tvm_us" not in warm and "prof" not in warm
