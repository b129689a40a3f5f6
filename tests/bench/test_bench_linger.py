"""`python -m bench.linger` (direct allreduce, lingering vs draining calls, same run; `make bench`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_linger_bench_json():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "bench.linger", "--nodes", "3", "--calls", "5",
                        "--delay-ms", "10", "--repeats", "2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert (r["nodes"], r["calls"], r["delay_ms"], r["repeats"], r["elements"]) == (3, 5, 10.0, 2, 4810)
    assert len(r["linger_runs_s"]) == len(r["drain_runs_s"]) == 2
    assert r["same_bits"] is True  # lingering changes when a call returns, never its result
    # a call cannot beat one message's latency
    assert min(r["linger_runs_s"] + r["drain_runs_s"]) >= r["ideal_s_per_call"] == 0.01
    assert r["linger_over_drain"] == pytest.approx(r["linger_s_per_call"] / r["drain_s_per_call"], abs=1e-3)


def test_linger_bench_refuses_bad_arguments():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "bench.linger", "--nodes", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--nodes >= 2" in p.stderr.strip().splitlines()[-1]
