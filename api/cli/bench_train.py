"""`fractal bench train`: one TVM training step vs PyTorch CPU, and the loss after K steps."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from api.cli.bench import bench_app

__all__ = ["bench_train"]


@bench_app.command("train")
def bench_train(
    models: list[str] = typer.Option(["digits-mlp", "ds-cnn-kws"], "--model", "-m",
                                     help="Zoo model(s) (repeat the option)."),
    batch: int = typer.Option(32, "--batch", help="Training batch size (both engines)."),
    steps: int = typer.Option(50, "--steps", "-k", help="Timed steps K (after 5 warm-up steps)."),
    lr: float = typer.Option(0.1, "--lr", help="SGD learning rate (both engines)."),
    threads: int | None = typer.Option(None, "--threads", help="Threads for both (default: all cores)."),
    work_dir: Path | None = typer.Option(None, "--work-dir", help="Reuse compiled artifacts from here."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """TVM loss_and_grad + apply vs PyTorch forward/backward/SGD on the same model, weights and batches."""
    from bench import train
    from compiler import zoo

    for m in models:
        if m not in zoo.NAMES:
            raise typer.BadParameter(f"unknown model {m!r}; choose from {', '.join(zoo.NAMES)}")
    if batch < 1 or steps < 1 or lr <= 0 or (threads is not None and threads < 1):
        raise typer.BadParameter("--batch, --steps and --threads must be >= 1 and --lr > 0")
    result = train.run(tuple(models), batch=batch, steps=steps, lr=lr, threads=threads, work_dir=work_dir)
    print(json.dumps(result) if as_json else train.format_table(result))
