"""`python -m bench.ota` (a real board directory under `fractal boot`, fleet roll-out and rollback;
marker bench: `make bench`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_ota_bench_json(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "bench.ota", "--runs", "1", "--json", "--work",
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["model"] == "digits-mlp" and len(r["runs"]) == 1
    run = r["runs"][0]
    assert run["version"] == "1.1.0" and run["size"] > 0
    # phases in the order the board goes through them, each after the POST
    assert 0 < run["staged_s"] <= run["trial_s"] <= run["rollout_s"]
    assert run["rollback_s"] > 0
