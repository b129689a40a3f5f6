"""`fractal bench compile|allreduce|serve|train|scale`: each verb lives in ``bench_<verb>.py``."""

from __future__ import annotations

import importlib

import typer

from api.cli import app

__all__ = ["bench_app"]

bench_app = typer.Typer(help="Benchmarks against same-run baselines; --json prints one JSON object.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

for _verb in ("compile", "allreduce", "serve", "train", "scale"):
    try:
        importlib.import_module(f"api.cli.bench_{_verb}")
    except ModuleNotFoundError as _exc:  # verb not written yet
        if _exc.name != f"api.cli.bench_{_verb}":
            raise
