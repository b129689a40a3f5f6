"""`python -m bench.vibration` (swarm vs central AUC in the vibration scenario; `make bench`), small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_vibration_bench_json():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "bench.vibration", "--nodes", "2", "--steps", "30",
                        "--speed", "4", "--min-samples", "60", "--eval", "20", "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert (r["nodes"], r["steps"]) == (2, 30) and len(r["swarm_auc"]) == len(r["central_auc"]) == 2
    assert all(n >= 60 for n in r["windows_per_node"])
    assert 0.5 < r["swarm_auc_mean"] <= 1 and 0.5 < r["central_auc_mean"] <= 1
    assert r["gap"] == pytest.approx(r["central_auc_mean"] - r["swarm_auc_mean"], abs=1e-3)
