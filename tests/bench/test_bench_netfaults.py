"""`python -m harness.netswarm bench` (round time under delay and drops, a fleet grace for Last
Wills; BENCHMARKS.md "network faults"; `make bench`). Needs root (network namespaces)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_netswarm_bench_drops_only_with_the_offline_grace():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "harness.netswarm", "bench", "--nodes", "3", "--steps", "100",
                        "--rounds", "4", "--drop-every", "0.5", "--faults", "drop", "--offline-grace", "5"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert (r["nodes"], r["steps"], r["drop_every_s"], r["offline_grace_s"]) == (3, 100, 0.5, 5.0)
    assert list(r["results"]) == ["drop-every-0.5s"]  # --faults drop: the one row
    row = r["results"]["drop-every-0.5s"]
    assert row["rounds"] == 4 and 0 <= row["committed"] <= 4
    assert row["committed"] + sum(row["failed"].values()) >= 4
    assert "PARAMETERS DIVERGED" not in row["failed"]  # every node holds the same parameters after each
    assert row["offline_statuses"] >= 1  # a cut per node every 0.5 s: Last Wills did fire
    if row["committed"]:
        assert 0 < row["min_s"] <= row["median_s"] <= row["max_s"]
