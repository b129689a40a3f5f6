"""`python -m bench.cbackend --json` on the MLPs (marker bench: `make bench`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_cbackend_bench_json():
    env = {**os.environ, "TVM_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "bench.cbackend", "--json", "--seconds", "0.6",
                        "--models", "sensor-mlp,digits-mlp"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["threads"] == "1" and [row["model"] for row in r["rows"]] == ["sensor-mlp", "digits-mlp"]
    for row in r["rows"]:
        assert row["vm_us"] > 0 and row["c_us"] > 0 and row["c_compile_s"] > 0
        assert row["max_abs_diff"] == 0.0  # the same kernels behind both runtimes
