"""`fractal bench serve`: /infer latency and throughput over HTTP vs a direct call, idle and training."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from api.cli.bench import bench_app

__all__ = ["bench_serve"]


@bench_app.command("serve")
def bench_serve(
    models: list[str] = typer.Option(["sensor-mlp", "ds-cnn-kws"], "--model", "-m",
                                     help="Zoo model(s) to serve (repeat the option)."),
    duration: float = typer.Option(3.0, "--duration", help="Seconds measured per point (after warm-up)."),
    clients: list[int] = typer.Option([1, 8], "--clients", "-c", help="Concurrent clients (repeatable)."),
    work_dir: Path | None = typer.Option(None, "--work-dir", help="Reuse compiled artifacts from here."),
    tvm_threads: int | None = typer.Option(None, "--tvm-threads", help="TVM_NUM_THREADS for the node."),
    train_nice: int | None = typer.Option(None, "--train-nice",
                                          help="[training] nice of the node (default: the node's default)."),
    switch_ms: float | None = typer.Option(None, "--switch-interval-ms",
                                           help="Experiment: sys.setswitchinterval of the node process."),
    isolation: list[str] = typer.Option(["process", "thread"], "--isolation",
                                        help="[training] isolation of the node, measured in this order "
                                             "(repeatable; default both: process = node default, "
                                             "thread = the same-run baseline)."),
    worker_priority: str | None = typer.Option(None, "--worker-priority",
                                               help="[training] worker_priority (nice|idle) of the node "
                                                    "(default: the node's default)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """p50/p99 and req/s of /v2/models/NAME/infer at 1 and 8 clients: direct, HTTP idle, HTTP training."""
    from bench import serve
    from compiler import zoo

    for m in models:
        if m not in zoo.NAMES:
            raise typer.BadParameter(f"unknown model {m!r}; choose from {', '.join(zoo.NAMES)}")
    bad = [i for i in isolation if i not in ("process", "thread")]
    if bad:
        raise typer.BadParameter(f"unknown --isolation {bad[0]!r}; choose process or thread")
    if worker_priority not in (None, "nice", "idle"):
        raise typer.BadParameter(f"unknown --worker-priority {worker_priority!r}; choose nice or idle")
    if duration <= 0 or any(c < 1 for c in clients):
        raise typer.BadParameter("--duration must be > 0 and --clients >= 1")
    result = serve.run(tuple(models), duration=duration, clients=tuple(clients), work_dir=work_dir,
                       tvm_threads=tvm_threads, train_nice=train_nice, switch_interval_ms=switch_ms,
                       isolations=tuple(isolation), worker_priority=worker_priority,
                       progress=True)
    if as_json:
        print(json.dumps(result))
        return
    print(serve.format_table(result))
