"""`fractal bench allreduce` input checks (the benchmark itself runs in tests/bench, `make bench`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.allreduce import ideal_bytes_per_node

ROOT = Path(__file__).resolve().parents[2]


def test_ideal_bytes():
    assert ideal_bytes_per_node(2, 1000) == 4000
    assert ideal_bytes_per_node(8, 10_000_000) == pytest.approx(70e6)
    assert ideal_bytes_per_node(4, 1000, algorithm="direct") == 12000  # every peer gets the whole vector


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "1", "--size", "10"], "--nodes"),
    (["--nodes", "2", "--size", "0"], "--size"),
    (["--nodes", "2", "--size", "10", "--compression", "zip"], "unknown compression"),
    (["--nodes", "2", "--size", "10", "--algorithm", "tree"], "unknown algorithm"),
    (["--nodes", "2", "--size", "10", "--algorithm", "direct", "-c", "int8"], "float32 only"),
    (["--nodes", "2", "--size", "10", "--broker", "http://x:1"], "bad broker URL"),
    (["--nodes", "2", "--size", "10", "--broker", "mqtt://127.0.0.1:1"], "cannot connect"),
])
def test_bad_input_is_one_line_and_exit_1(args, needle):
    cmd = [sys.executable, "-c", "from api.cli import main; main()", "bench", "allreduce", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith("error: ") and needle in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_signed_bench_reports_paired_overhead():
    """`--signed` times the authenticated ring beside the plain one in the same run and reports
    the per-repeat overhead with its interval (bench/paired.py); results stay bit-identical."""
    from bench.allreduce import run_allreduce_bench

    r = run_allreduce_bench(2, 4810, repeats=3, signed=True, timeout=60)
    assert r["bit_identical"] and r["max_abs_error"] < 1e-6
    assert len(r["ring_runs_s"]) == len(r["signed_runs_s"]) == 3
    pairs = [s / p - 1 for p, s in zip(r["ring_runs_s"], r["signed_runs_s"], strict=True)]
    assert r["signed_paired_overhead"] == pytest.approx(sorted(pairs)[1], abs=0.005)  # runs: us
    lo, hi = r["signed_paired_overhead_ci95"]
    assert lo <= r["signed_paired_overhead"] <= hi
