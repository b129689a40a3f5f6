"""`fractal bench compile`: onnxruntime vs TVM untuned vs TVM tuned on the zoo models; `fractal bench
curve`: trials vs latency from one tuning run."""

from __future__ import annotations

import json
import sys

import typer

from api.cli.bench import bench_app

__all__ = ["bench_compile", "bench_curve"]


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
    model: str | None = typer.Option(None, "--model", help="Benchmark this ONNX file instead of the zoo "
                                     "(--trials 0: untuned only)."),
    shape: list[str] = typer.Option([], "--shape", help="With --model: fix an input's dims, NAME=D0,D1,..."),
    no_prepack: bool = typer.Option(False, "--no-prepack", help="Compile without weight pre-packing "
                                    "(BatchNorm and weight layouts recomputed per call), for comparison."),
) -> None:
    """Latency of each zoo model in onnxruntime, TVM untuned and TVM tuned; tuning and recompile time."""
    from bench.compile import run_compile_bench
    from compiler.errors import CompilerError

    if model is not None:
        _bench_user_model(model, shape, trials, threads, target, db, seconds, as_json)
        return

    names = [m.strip() for m in models.split(",") if m.strip()] or None
    overrides: dict[str, int] = {}
    for item in filter(None, (i.strip() for i in trials_for.split(","))):
        model, _, n = item.partition("=")
        if not n.strip().isdigit():
            raise CompilerError(f"bad --trials-for item {item!r}", hint="use MODEL=N[,MODEL=N...]")
        overrides[model.strip()] = int(n)
    result = run_compile_bench(names, trials=trials, trials_for=overrides, threads=threads, target=target,
                               db_dir=db,
                               min_seconds=seconds, prepack=not no_prepack,
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


def _bench_user_model(model: str, shape: list[str], trials: int, threads: int, target: str, db: str | None,
                      seconds: float, as_json: bool) -> None:
    """`bench compile --model FILE`: one user model (bench.model)."""
    from api.cli.compile import parse_shapes
    from bench.model import bench_user_model

    row = bench_user_model(model, shapes=parse_shapes(shape), trials=trials, threads=threads, target=target,
                           db_dir=db, min_seconds=seconds,
                           log=lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
    if as_json:
        typer.echo(json.dumps(row))
        return
    m = row["machine"]
    typer.echo(f"{m['cpu']} ({m['logical_cpus']} CPUs), {threads} thread(s), target {row['target']}")
    ort_us = row["onnxruntime"].get("median_us", "n/a")
    tuned = row.get("tvm_tuned", {}).get("median_us", "-")
    typer.echo(f"{'model':<28}{'inputs':<28}{'ort us':>10}{'untuned':>10}{'tuned':>10}{'trials':>7}")
    typer.echo(f"{row['model']:<28}{json.dumps(row['inputs']):<28}{ort_us:>10}"
               f"{row['tvm_untuned']['median_us']:>10}{tuned:>10}{row.get('trials', 0):>7}")


@bench_app.command("curve")
def bench_curve(
    model: str = typer.Argument(..., help="Zoo model whose tuning database to sample."),
    db: str = typer.Option(..., "--db", help="Tuning database dir holding one long run for the model."),
    points: str = typer.Option("64,256,1024", "--points", help="Trial counts, comma-separated."),
    target: str = typer.Option("native", "--target",
                               help="Preset the database was tuned for ('native': this CPU)."),
    threads: int = typer.Option(1, "--threads", help="Threads for both onnxruntime and TVM."),
    seconds: float = typer.Option(1.0, "--seconds", help="Minimum timing window per latency figure."),
) -> None:
    """Trials-vs-latency from one tuning run: compile with its first K records, time next to onnxruntime."""
    from bench.curve import run_trials_curve
    from compiler.errors import CompilerError
    from compiler.targets import best_host_preset_name

    try:
        ks = [int(p) for p in points.split(",") if p.strip()]
    except ValueError:
        raise CompilerError(f"bad --points {points!r}", hint="e.g. --points 64,256,1024") from None
    if not ks or min(ks) < 1 or threads < 1:
        raise CompilerError("--points and --threads must be >= 1",
                            hint="e.g. --points 64,256,1024 --threads 1")
    result = run_trials_curve(model, db, ks, target=best_host_preset_name() if target == "native" else target,
                              threads=threads, min_seconds=seconds,
                              log=lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
    typer.echo(json.dumps(result))
