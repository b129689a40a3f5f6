"""Board disk image fixtures: a release key and the zoo digits-mlp compiled for a board's C preset
(the route with no TVM on the board), built once per session and shared by the board tests."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def board_release_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release key pair for board images (private path; the public key is PATH.pub)."""
    from firmware.keys import keygen

    return keygen(tmp_path_factory.mktemp("board-keys") / "release")[0]


@pytest.fixture(scope="session")
def board_c_artifact(tmp_path_factory: pytest.TempPathFactory, digits_onnx: Path) -> Callable[[str], Path]:
    """``board_c_artifact(preset) -> artifact dir``: digits-mlp compiled for a C preset, cached."""
    from compiler import compile_model

    d = tmp_path_factory.mktemp("board-artifacts")
    cache: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in cache:
            cache[preset] = compile_model(digits_onnx, target=preset, out_dir=d / preset, progress=False)
        return cache[preset]

    return get


def image_try(img: Path, console: Path) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    """Start `fractal image try IMG` on a free port in a session of its own (kill the group to stop
    everything), the board's console into ``console``; returns the process and a queue of its
    stdout lines (the first is ``node: URL`` once the node answered ready)."""
    from tests.edgenode.test_cli_node import free_port
    from tests.firmware.conftest import CLI, REPO

    with open(console, "w") as log:
        proc = subprocess.Popen(
            [*CLI, "image", "try", str(img), "--port", str(free_port())],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
    return proc, lines


def stop_try(proc: subprocess.Popen[str]) -> None:
    """Stop `image try` on a failure path: SIGTERM, which stops its machine too (qemu runs in a
    session of its own, so killing `try`'s group would leave it running under emulation and slow
    every later test), then SIGKILL to the group if `try` does not end within a minute."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
