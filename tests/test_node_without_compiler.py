"""A node install has no compiler (issue 25): ``pip install fractal-edge`` serves and trains a C-backend
artifact, and nothing of the ``[compiler]`` extra (TVM, onnx, onnxruntime, xgboost, ...) is installed.

* a real ``fractal node`` on the x86_64-c digits artifact, in a process (and a training worker)
  whose Python cannot import any ``[compiler]`` module (tests/nocompiler/sitecustomize.py), answers
  an OIP inference like onnxruntime, trains a round over Mosquitto and serves the new parameters;
  no process even tried to import one of them, and the two stay small (VmRSS; no pydantic in the
  worker);
* the package metadata: no ``[compiler]`` distribution among the base requirements, the extra holds
  them all, ``[dev]`` includes it, ``make install`` (what ``make demo`` needs) installs it;
* ``fractal compile`` on such an install is one line naming the fix, exit 1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from bench.noderss import infer, rss_mb, run_round, start_node
from compiler.verify import onnxruntime_reference
from fractal.extras import COMPILER_INSTALL, COMPILER_MODULES

ROOT = Path(__file__).resolve().parents[1]
GUARD = ROOT / "tests" / "nocompiler"
BLOCKED = sorted(COMPILER_MODULES)


def _node_install_env(log: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{GUARD}{os.pathsep}{ROOT}", FRACTAL_TEST_BLOCK=",".join(BLOCKED),
               FRACTAL_TEST_BLOCK_LOG=str(log))
    return env


def _requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()


@pytest.mark.mosquitto
def test_node_serves_and_trains_a_c_artifact_without_the_compiler(
        tmp_path, mosquitto, swarm_id, digits_c_artifact, digits_onnx, digits_data):
    log = tmp_path / "guard.log"
    x, y = digits_data
    node = start_node(digits_c_artifact, tmp_path / "node", broker_url=mosquitto.url, swarm=swarm_id,
                      node_id=f"{swarm_id}-nc", env=_node_install_env(log))
    try:
        want = onnxruntime_reference(digits_onnx, {"x": x[:5]}, 1)["logits"]
        np.testing.assert_allclose(infer(node, "digits-mlp", "x", x[:5]), want, rtol=1e-4, atol=1e-4)
        done = run_round(node, mosquitto.url, x[:256], y[:256], steps=10, round_id=f"{swarm_id}-r1")
        assert done.model_version == 1
        worker = node.worker_pid()
        assert worker is not None, "the node trained without its training worker"
        rss = rss_mb(node.proc.pid) + rss_mb(worker)
        # ~126 MB here; a TVM node + worker ~860 MB (BENCHMARKS.md "node memory")
        assert rss < 150, f"node + training worker use {rss:.0f} MB"
        # the worker computes rounds without pydantic (federation/modes.py, federation/limits.py)
        assert "pydantic_core" not in Path(f"/proc/{worker}/maps").read_text()
        after = infer(node, "digits-mlp", "x", x[:5])
        assert not np.allclose(after, want, atol=1e-4)  # the round's parameters are served
    finally:
        out = node.stop()
    text = log.read_text()
    loaded = set(re.findall(r"^loaded (\d+)$", text, re.M))
    assert {str(node.proc.pid), str(worker)} <= loaded, (loaded, out[-2000:])
    assert "blocked" not in text, text[:4000]


def test_base_requirements_hold_no_compiler_package():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_requirement_name(r) for r in meta["dependencies"]}
    extras = meta["optional-dependencies"]
    compiler = {_requirement_name(r) for r in extras["compiler"]}
    dists = set(COMPILER_MODULES.values()) - {"torch"}  # torch: a dev extra (the train benchmark)
    assert not base & set(COMPILER_MODULES.values()), base & set(COMPILER_MODULES.values())
    assert dists == compiler, dists ^ compiler
    assert "apache-tvm==0.27.0.post1" in extras["compiler"]
    assert "apache-tvm-ffi==0.1.14.post0" in extras["compiler"]
    assert "fractal-edge[compiler]" in extras["dev"]
    assert "torch" in {_requirement_name(r) for r in extras["dev"]}
    make = (ROOT / "Makefile").read_text()
    assert "pip install -q -e '.[compiler]'" in make and "pip install -q -e '.[dev]'" in make


def test_compile_on_a_node_install_is_one_line_naming_the_extra(tmp_path, digits_onnx):
    log = tmp_path / "guard.log"
    proc = subprocess.run([sys.executable, "-c", "from api.cli import main; main()", "compile",
                           str(digits_onnx), "--target", "x86_64-c", "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=_node_install_env(log), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and COMPILER_INSTALL in lines[0], proc.stderr
    assert "blocked" in log.read_text()  # it did reach for the compiler, and the guard refused it
    assert not (tmp_path / "out").exists()
