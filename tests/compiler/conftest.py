"""Compiler-test fixtures: an in-process CLI runner and artifacts only these tests need."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from api.cli import main


class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    @property
    def error_line(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1, f"expected exactly one error line, got stderr={self.err!r}"
        return lines[0]


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run `fractal ARGS...` in-process through api.cli.main (the real error formatting)."""

    def run(*args: str | Path) -> CliResult:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        cap = capsys.readouterr()
        return CliResult(code, cap.out, cap.err)

    return run


@pytest.fixture(scope="session")
def mlp_onnx(compiler_build_dir: Path) -> Path:
    """A tiny 8-16-4 MLP with batch 1."""
    from tests.compiler.models import mlp, save

    return save(mlp()[0], compiler_build_dir / "mlp.onnx")


@pytest.fixture(scope="session")
def mse_adam_artifact(compiler_build_dir: Path, mlp_onnx: Path) -> Path:
    """The tiny MLP with training (mse, adam, batch 6, lr 0.01)."""
    from compiler import TrainSettings, compile_model, host_preset_name

    return compile_model(
        mlp_onnx,
        target=host_preset_name(),
        out_dir=compiler_build_dir / "mlp-mse-adam",
        train=TrainSettings(loss="mse", optimizer="adam", lr=0.01, batch=6),
        progress=False,
    )
