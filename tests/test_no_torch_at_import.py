"""torch is a dev-only dependency (the train benchmark's baseline): no runtime package may need it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULES = ["compiler", "federation", "edgenode", "api", "api.cli", "api.fleet_app", "api.node_app",
           "bench", "bench.host", "bench.compile", "bench.allreduce", "bench.serve",
           "bench.train", "api.cli.bench", "deploy.swarm"]


def test_importing_the_runtime_packages_does_not_import_torch() -> None:
    code = ("import importlib, sys\n"
            f"for m in {MODULES!r}:\n"
            "    importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print('torch modules:', bad[:5])\n"
            "sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
