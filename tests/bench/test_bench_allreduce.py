"""`fractal bench allreduce` end to end at small sizes (marker bench: `make bench`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.allreduce import ideal_bytes_per_node, run_allreduce_bench

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def _fractal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from api.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_cli_json_object(mosquitto):
    p = _fractal("bench", "allreduce", "--nodes", "3", "--size", "100003", "--broker", mosquitto.url,
                 "--repeats", "2", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for key in ("nodes", "elements", "seconds", "star_seconds", "bytes_sent_per_node", "ideal_bytes_per_node",
                "max_abs_error", "broker_mb_per_s"):
        assert key in r, key
    assert (r["nodes"], r["elements"]) == (3, 100003)
    assert r["ideal_bytes_per_node"] == int(ideal_bytes_per_node(3, 100003))
    assert abs(r["bytes_sent_per_node"] / r["ideal_bytes_per_node"] - 1) < 0.05
    assert r["max_abs_error"] < 1e-5 and r["bit_identical"]
    assert r["seconds"] > 0 and r["broker_mb_per_s"] > 0


def test_starts_its_own_broker_and_compression():
    r = run_allreduce_bench(2, 50_000, compression="fp16", repeats=1)
    assert r["broker"].startswith("mosquitto") and r["bit_identical"]
    assert r["ring_broker_cpu_s"] >= 0 and r["star_broker_cpu_s"] >= 0  # its own broker: CPU measured
    assert r["bytes_sent_per_node"] < 0.6 * r["ideal_bytes_per_node"]  # fp16: half the bytes
    assert r["max_abs_error"] < 1e-2


def test_small_vectors_take_the_direct_path_unless_told_otherwise(mosquitto):
    auto = run_allreduce_bench(3, 4810, broker_url=mosquitto.url, repeats=1)
    ring = run_allreduce_bench(3, 4810, broker_url=mosquitto.url, repeats=1, algorithm="ring")
    assert (auto["algorithm"], ring["algorithm"]) == ("direct", "ring")
    assert auto["ideal_bytes_per_node"] == int(ideal_bytes_per_node(3, 4810, algorithm="direct"))
    for r in (auto, ring):
        assert r["bit_identical"] and r["max_abs_error"] < 1e-5
        assert abs(r["bytes_sent_per_node"] / r["ideal_bytes_per_node"] - 1) < 0.05


def test_bad_input_is_one_line():
    p = _fractal("bench", "allreduce", "--nodes", "2", "--size", "10", "--compression", "zip")
    assert p.returncode == 1 and p.stderr.startswith("error: unknown compression")
    assert p.stderr.count("\n") == 1
    p = _fractal("bench", "allreduce", "--nodes", "1", "--size", "10")
    assert p.returncode == 1 and "--nodes" in p.stderr
