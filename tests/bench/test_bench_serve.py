"""`fractal bench serve --json` end to end on the sensor MLP (marker bench: `make bench`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_serve_bench_json(tmp_path):
    p = subprocess.run([sys.executable, "-c", "from api.cli import main; main()", "bench", "serve", "--json",
                        "-m", "sensor-mlp", "--duration", "1.5", "--work-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)  # exactly one JSON object on stdout
    m = r["models"]["sensor-mlp"]
    for mode in ("direct", "http_idle", "http_training"):
        for c in ("c1", "c8"):
            s = m[mode][c]
            assert s["errors"] == 0 and s["n"] > 50, (mode, c, s)
            assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
    # HTTP can only add to the in-process call; the overhead figure is what BENCHMARKS.md reports
    assert m["http_idle"]["c1"]["p50_ms"] > m["direct"]["c1"]["p50_ms"]
    g = r["goals"]["sensor-mlp"]
    assert {"http_overhead_p50_ms", "p99_c8_ms", "training_p99_ratio_c1", "training_p99_ratio_c8"} <= set(g)
    assert r["machine"]["cores"] >= 1


def test_serve_bench_rejects_unknown_model():
    p = subprocess.run([sys.executable, "-c", "from api.cli import main; main()", "bench", "serve",
                        "-m", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "unknown model" in p.stderr
