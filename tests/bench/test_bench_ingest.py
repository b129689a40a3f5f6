"""`python -m bench.ingest` (`make bench`): readings into stored windows, and --latency: what a
flowing stream costs inference on the same node (silent and streaming segments in one run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.mosquitto]

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "bench.ingest", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_ingest_stores_every_window(digits_artifact: Path) -> None:
    r = _bench(str(digits_artifact), "--packs", "64", "--per-pack", "50")
    assert r["readings"] == 3200 and r["windows_expected"] == 3200 // 32
    assert r["windows"] == r["windows_expected"] and r["readings_lost"] == 0


def test_stream_latency_pairs_silent_and_streaming(digits_artifact: Path) -> None:
    r = _bench(str(digits_artifact), "--latency", "--rate", "1000", "--duration", "3")
    assert r["model"] == "digits-mlp" and r["rate_asked"] == 1000.0
    for mode in ("silent", "streaming"):
        assert r[mode]["n"] > 0 and r[mode]["errors"] == 0
    assert r["readings_sent_per_s"] > 0  # the stream really flowed during its segments
    assert r["p99_ratio"] == pytest.approx(r["streaming"]["p99_ms"] / r["silent"]["p99_ms"], rel=1e-2)
