"""``fractal.__version__`` is read from the installed dist-info without importlib.metadata (which
imports email, zipfile and csv: 3.4 MB of every training worker's memory, BENCHMARKS "node memory")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *, pythonpath: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
        env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_version_is_the_installed_distributions_and_the_worker_skips_importlib_metadata() -> None:
    code = (
        "import sys, edgenode.trainworker, fractal\n"
        "loaded = 'importlib.metadata' in sys.modules\n"
        "from importlib import metadata\n"
        "print(fractal.__version__, metadata.version('fractal-edge'), loaded)\n"
    )
    ours, official, loaded = _run(code, pythonpath=str(ROOT)).split()
    assert ours == official and loaded == "False"


def test_a_source_tree_never_installed_says_so(tmp_path: Path) -> None:
    """As on a board image (/opt/fractal on PYTHONPATH, no dist-info anywhere): 0.0.0+source."""
    (tmp_path / "fractal").mkdir()
    (tmp_path / "fractal" / "__init__.py").write_text((ROOT / "fractal" / "__init__.py").read_text())
    code = f"import sys; sys.path[:] = [{str(tmp_path)!r}]; import fractal; print(fractal.__version__)"
    assert _run(code, pythonpath=str(tmp_path)) == "0.0.0+source"
