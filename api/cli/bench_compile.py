"""`fractal bench compile`: onnxruntime vs TVM untuned vs TVM tuned on the zoo models."""

from __future__ import annotations

import json
import sys

import typer

from api.cli.bench import bench_app

__all__ = ["bench_compile"]


@bench_app.command("compile")
def bench_compile(
    models: str = typer.Option("", "--models", "-m",
                               help="Comma-separated zoo models (default: all of them)."),
    trials: int = typer.Option(64, "--trials", "-t", help="MetaSchedule trials per model."),
    trials_for: str = typer.Option("", "--trials-for",
                                   help="Per-model overrides, e.g. 'sensor-mlp=16,resnet8-cifar10=96'."),
    threads: int = typer.Option(1, "--threads", help="Threads for both onnxruntime and TVM."),
    target: str = typer.Option("native", "--target",
                               help="Preset, or 'native' (this CPU, as onnxruntime picks its kernels)."),
    db: str | None = typer.Option(None, "--db", help="Tuning database dir (default: a fresh one)."),
    seconds: float = typer.Option(1.0, "--seconds", help="Minimum timing window per latency figure."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Latency of each zoo model in onnxruntime, TVM untuned and TVM tuned; tuning and recompile time."""
    from api.bench.compile import run_compile_bench
    from compiler.errors import CompilerError

    names = [m.strip() for m in models.split(",") if m.strip()] or None
    overrides: dict[str, int] = {}
    for item in filter(None, (i.strip() for i in trials_for.split(","))):
        model, _, n = item.partition("=")
        if not n.strip().isdigit():
            raise CompilerError(f"bad --trials-for item {item!r}", hint="use MODEL=N[,MODEL=N...]")
        overrides[model.strip()] = int(n)
    result = run_compile_bench(names, trials=trials, trials_for=overrides, threads=threads, target=target,
                               db_dir=db,
                               min_seconds=seconds,
                               log=lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
    if as_json:
        typer.echo(json.dumps(result))
        return
    m = result["machine"]
    typer.echo(f"{m['cpu']} ({m['logical_cpus']} CPUs), {result['threads']} thread(s), "
               f"target {result['target']['preset']} {json.dumps(result['target']['tvm_target'])}")
    typer.echo(f"{'model':<24}{'ort us':>10}{'untuned':>10}{'tuned':>10}{'tuned/ort':>10}"
               f"{'trials':>7}{'tune s':>9}{'recompile s':>13}")
    for r in result["models"].values():
        typer.echo(f"{r['model']:<24}{r['onnxruntime']['median_us']:>10}{r['tvm_untuned']['median_us']:>10}"
                   f"{r['tvm_tuned']['median_us']:>10}{r['ratio_tuned_vs_ort']:>10}{r['tuning']['trials']:>7}"
                   f"{r['tuning']['seconds']:>9}{r['recompile_warm_db_s']:>13}")
    s = result["summary"]
    typer.echo(f"tuned <= onnxruntime: {len(s['tuned_at_or_below_ort'])}/{len(result['models'])}; "
               f"<= half: {len(s['tuned_at_most_half_ort'])}; goal met: {s['goal_met']}")
