"""`fractal bench compile|allreduce|serve|train|scale`: each verb lives in ``bench_<verb>.py``."""

from __future__ import annotations

import importlib
import json
from typing import Any

import typer

from api.cli import app

__all__ = ["bench_app", "echo_result"]

bench_app = typer.Typer(help="Benchmarks against same-run baselines; --json prints one JSON object.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def echo_result(result: dict[str, Any], as_json: bool) -> None:
    """A bench verb's result: one JSON object (``--json``) or one aligned ``key  value`` line each."""
    if as_json:
        typer.echo(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for k, v in result.items():
        typer.echo(f"{k:<{width}}  {v}")


for _verb in ("compile", "allreduce", "serve", "train", "scale"):
    try:
        importlib.import_module(f"api.cli.bench_{_verb}")
    except ModuleNotFoundError as _exc:  # verb not written yet
        if _exc.name != f"api.cli.bench_{_verb}":
            raise
