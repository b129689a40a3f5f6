"""Board disk image fixtures: a release key and the zoo digits-mlp compiled for a board's C preset
(the route with no TVM on the board), built once per session and shared by the board tests."""

from __future__ import annotations

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
