"""Firmware test helpers: keys, signed images of the shared ``digits_artifact``, the real CLI."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from api.cli import main; main()"]


def cli(
    *args: str | Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run the real `fractal` CLI in a subprocess (this worktree's code first on the path)."""
    e = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, env=e, timeout=timeout, cwd=REPO
    )


def cli_main(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`fractal ARGS` through ``api.cli.main`` in this process: the same parsing, work, exit code
    and one-line errors as :func:`cli`, without the ~1 s of imports every new process pays. For
    loops that drive many refusals of one verb; each such loop also sends one case through
    :func:`cli`, so the console script's process boundary stays proven."""
    import contextlib
    import io

    from api.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
    rc = code if isinstance(code, int) else (0 if code is None else 1)
    return subprocess.CompletedProcess(["fractal", *map(str, args)], rc, out.getvalue(), err.getvalue())


def flash_killed_at(point: str, image: Path, device: Path) -> subprocess.CompletedProcess[str]:
    """Flash as `fractal image flash` does, in a process that SIGKILLs itself at ``point``
    (``bytes:N`` or ``switch``; the plan enters through tests/firmware/flashkill.py)."""
    e = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "tests.firmware.flashkill", "--at", point, str(image),
         "--device", str(device)],
        capture_output=True, text=True, env=e, timeout=300, cwd=REPO,
    )


def assert_refused(r: subprocess.CompletedProcess[str], *words: str) -> None:
    """One-line error naming the cause, non-zero exit, no traceback."""
    assert r.returncode != 0, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def tree(path: Path) -> dict[str, str]:
    """{relative path: sha256 or 'dir'} of everything under ``path`` (what 'nothing written' compares)."""
    out = {}
    if not path.exists():
        return out
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="session")
def fw_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three key pairs k1, k2, k3 (private paths; the public key is PATH.pub)."""
    from firmware.keys import keygen

    d = tmp_path_factory.mktemp("fw-keys")
    return {name: keygen(d / name)[0] for name in ("k1", "k2", "k3")}


@pytest.fixture(scope="session")
def fw_image(
    tmp_path_factory: pytest.TempPathFactory, digits_artifact: Path, fw_keys: dict[str, Path]
) -> Callable[..., Path]:
    """``fw_image(version, key='k1', board=host, rollback_index=0, add_keys=(), broken=False) -> path``.

    ``broken=True`` stores a wrong expected output, so the slot fails its health check. Cached.
    """
    import numpy as np

    from compiler.targets import host_preset_name
    from firmware.image import build_image

    d = tmp_path_factory.mktemp("fw-images")
    cache: dict[tuple, Path] = {}
    ref: list = []

    def make(
        version: str,
        key: str = "k1",
        board: str | None = None,
        rollback_index: int = 0,
        add_keys: tuple[str, ...] = (),
        broken: bool = False,
    ) -> Path:
        board = board or host_preset_name()
        k = (version, key, board, rollback_index, add_keys, broken)
        if k not in cache:
            if not ref:
                from compiler.artifact import load_artifact

                x = {"x": np.random.default_rng(1).random((1, 64)).astype(np.float32)}
                ref.append((x, load_artifact(digits_artifact).infer(x)))
            x, y = ref[0]
            if broken:
                y = {n: v + 1.0 for n, v in y.items()}
            out = d / f"digits-{version}-{key}-{board}-{rollback_index}-{len(add_keys)}-{int(broken)}.img"
            cache[k] = build_image(
                digits_artifact,
                board=board,
                key=fw_keys[key],
                out=out,
                version=version,
                rollback_index=rollback_index,
                add_keys=[Path(f"{fw_keys[a]}.pub") for a in add_keys],
                reference=(x, y),
            )
        return cache[k]

    return make
