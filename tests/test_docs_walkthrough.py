"""The "Compile, verify, predict" block of docs/compile.md, run as a user pastes it: every line in
order, in a fresh directory, by bash (the README's tour quotes lines of it; tests/test_docs.py
checks that they are lines of this block). Two deliberate differences: the venv is the one
running this test (its bin directory goes first on PATH, as `. .venv/bin/activate` does), and
`--trials N` becomes `--trials 2` with a fresh tuning database (CI has 2 cores; the commands are
what is tested)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.emulate]


def walkthrough() -> list[str]:
    """The lines of the first ```sh block under "## Compile, verify, predict" in docs/compile.md."""
    text = (ROOT / "docs" / "compile.md").read_text()
    section = text.split("## Compile, verify, predict\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "no ```sh block in the walkthrough of docs/compile.md"
    return [ln for ln in block.group(1).splitlines() if ln.strip()]


def test_walkthrough_lines_are_the_documented_ones():
    lines = walkthrough()
    assert lines[0] == ". .venv/bin/activate"
    assert any("digits.onnx" in ln and "zoo.save" in ln for ln in lines)
    assert any("in.npz" in ln and "np.savez" in ln for ln in lines)
    assert any(ln.startswith("fractal predict out/digits --input in.npz") for ln in lines)


def test_readme_walkthrough_runs_in_order(tmp_path):
    bindir = Path(sys.executable).parent
    script = ["set -ex"]
    for ln in walkthrough():
        if ln == ". .venv/bin/activate":
            ln = f"export PATH={bindir}:$PATH"
        script.append(re.sub(r"--trials \d+", f"--trials 2 --db {tmp_path / 'tuning-db'}", ln))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's code, wherever the venv points
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = proc.stdout + proc.stderr
    assert "max_abs_error" in out
    logits = np.load(work / "out.npz")["logits"]
    assert logits.shape == (4, 10) and np.isfinite(logits).all()
    for d in ("out/kws-rpi4", "out/kws", "out/digits"):
        assert (work / d / "manifest.json").is_file(), d
