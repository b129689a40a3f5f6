"""`fractal bench allreduce` input checks (the benchmark itself runs in tests/bench, `make bench`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from api.bench.allreduce import ideal_bytes_per_node

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
