"""`fractal bench compile --json`: a small run (one tiny zoo model, 4 trials) through the real CLI
in a subprocess (TVM's thread count must be set before TVM starts its pool)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compiler.targets import best_host_preset_name

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from api.cli import main; main()", "bench", "compile", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_compile_bench_json(tmp_path):
    p = _bench(
        "--json",
        "--models",
        "sensor-mlp",
        "--trials",
        "4",
        "--seconds",
        "0.2",
        "--threads",
        "1",
        "--db",
        str(tmp_path / "db"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["bench"] == "compile" and r["threads"] == 1 and r["trials_per_model"] == {"sensor-mlp": 4}
    assert r["target"]["preset"] == best_host_preset_name() and r["target"]["tvm_target"]["mcpu"]
    assert r["machine"]["logical_cpus"] >= 1 and r["machine"]["tvm"].startswith("0.27")
    m = r["models"]["sensor-mlp"]
    # both TVM builds compute what onnxruntime computes
    assert m["untuned_max_abs_err"] < 1e-4 and m["tuned_max_abs_err"] < 1e-4
    # a real tuning run, then a recompile that reuses the warm database without trials
    assert m["tuning"]["reused"] is False and m["tuning"]["trials_run"] == 4
    assert m["recompile_reused"] is True
    assert m["recompile_warm_db_s"] < m["compile_tuned_s"]
    for engine in ("onnxruntime", "tvm_untuned", "tvm_tuned"):
        assert 0 < m[engine]["p10_us"] <= m[engine]["median_us"] <= m[engine]["p90_us"]
    assert m["ratio_tuned_vs_ort"] == pytest.approx(
        m["tvm_tuned"]["median_us"] / m["onnxruntime"]["median_us"], rel=1e-2
    )
    assert (tmp_path / "db").is_dir()  # --db was honoured
    # a second run on the same --db: tuning is a cache hit
    p2 = _bench(
        "--json", "--models", "sensor-mlp", "--trials", "4", "--seconds", "0.1", "--db", str(tmp_path / "db")
    )
    assert p2.returncode == 0, p2.stderr[-3000:]
    m2 = json.loads(p2.stdout)["models"]["sensor-mlp"]
    assert m2["tuning"]["reused"] is True and m2["tuning"]["trials_run"] == 0


def test_compile_bench_bad_model_is_one_line():
    p = _bench("--models", "nope", "--trials", "1")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("error: unknown zoo model 'nope'")


def test_compile_bench_bad_trials_for_is_one_line():
    p = _bench("--models", "sensor-mlp", "--trials-for", "sensor-mlp=lots")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("error: bad --trials-for item 'sensor-mlp=lots'")
