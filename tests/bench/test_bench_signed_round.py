"""`python -m bench.signed_round` (plain vs signed rounds, same run; marker bench: `make bench`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("members", "model", "compression"),
                         [("process", "digits-mlp", "none"), ("thread", "digits-mlp", "none"),
                          ("process", "sensor-mlp", "none"), ("process", "digits-mlp", "int8")])
def test_signed_round_bench_json(members, model, compression):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "bench.signed_round", "--nodes", "2", "--steps", "10",
                        "--repeats", "2", "--outlier-factor", "0", "--members", members, "--model", model,
                        "--compression", compression],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)  # stdout is exactly one JSON object (progress goes to stderr)
    assert (r["nodes"], r["steps"], r["repeats"], r["outlier_factor"]) == (2, 10, 2, 0.0)
    assert r["members"] == members and r["model"] == model and r["compression"] == compression
    assert len(r["plain_runs_s"]) == len(r["signed_runs_s"]) == 2
    assert all(t > 0 for t in r["plain_runs_s"] + r["signed_runs_s"])
    # (round times are rounded to 0.1 ms, the overhead is not)
    assert r["overhead"] == pytest.approx(r["signed_round_s"] / r["plain_round_s"] - 1, abs=0.01)
    assert r["paired_overhead"] == pytest.approx(  # the median of the 2 per-repeat overheads
        sum(s / p - 1 for p, s in zip(r["plain_runs_s"], r["signed_runs_s"], strict=True)) / 2, abs=0.01)
    assert r["paired_overhead_ci95"] is None  # 2 pairs: no interval
    assert r["plain_cpu_s"] > 0 and r["signed_cpu_s"] > 0 and len(r["load_average"]) == 3


def test_signed_round_bench_sets_and_control():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "bench.signed_round", "--nodes", "2", "--steps", "3",
                        "--repeats", "3", "--sets", "2", "--control", "--outlier-factor", "0",
                        "--members", "thread"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["sets"] == 2
    assert len(r["plain_runs_s"]) == len(r["signed_runs_s"]) == len(r["control_runs_s"]) == 6
    for key in ("paired_overhead", "control_overhead", "overhead_vs_both_unsigned"):
        assert len(r[f"{key}_per_set"]) == 2 and r[f"{key}_ci95"] is not None
    assert r["gmac"].startswith(("openssl-context", "cryptography"))
    bad = subprocess.run([sys.executable, "-m", "bench.signed_round", "--sets", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "sets and repeats must be at least 1" in bad.stderr
