"""`fractal compile | tune | rpc-server | inspect | predict | verify | targets`: the compiler's verbs."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from api.cli import app

if TYPE_CHECKING:
    from compiler.quantize import CalibrationSet

__all__ = ["compile_cmd", "tune_cmd", "rpc_server_cmd", "inspect_cmd", "predict_cmd", "verify_cmd",
           "targets_cmd"]


@app.command("compile")
def compile_cmd(
    model: Path = typer.Argument(..., help="ONNX model file."),
    target: str = typer.Option(..., "--target", "-t", help="Target preset (see `fractal targets`), or "
                               "native (alias host): this machine's."),
    out: Path = typer.Option(..., "--out", "-o", help="Artifact directory to write."),
    name: str | None = typer.Option(None, "--name", help="Model name (default: the ONNX file's stem)."),
    tune: bool = typer.Option(False, "--tune", help="Autotune with MetaSchedule (host-runnable targets)."),
    trials: int | None = typer.Option(None, "--trials", help="MetaSchedule trials with --tune, in total: "
                                      "an equal share per task (default 64; none with --time-budget)."),
    time_budget: float | None = typer.Option(None, "--time-budget", help="Tune for about this many seconds "
                                             "(with --trials: whichever ends first)."),
    rpc: str | None = typer.Option(None, "--rpc", help="HOST:PORT of a board's `fractal rpc-server`: time "
                                   "candidates there (tunes any preset of the board's arch)."),
    no_prepack: bool = typer.Option(False, "--no-prepack", help="Keep BatchNorm and weight layouts in every "
                                    "inference call (for comparison)."),
    db: Path | None = typer.Option(None, "--db", help="Tuning database directory (default: the user cache, "
                                   "then the databases shipped for the zoo models; --db uses only DIR)."),
    train: bool = typer.Option(False, "--train", help="Also build the training module."),
    loss: str = typer.Option("ce", "--loss", help="Training loss: ce or mse."),
    optimizer: str = typer.Option("sgd", "--optimizer", help="Optimizer: sgd or adam."),
    lr: float = typer.Option(0.01, "--lr", help="Default learning rate (changeable per step)."),
    batch: int = typer.Option(32, "--batch", help="Training batch size."),
    shape: list[str] = typer.Option([], "--shape", help="Fix an input's dims: NAME=D0,D1,... (repeatable; "
                                    "? keeps the batch dynamic). See `fractal inspect`."),
    quantize: str | None = typer.Option(None, "--quantize", help="int8: quantize the float model first "
                                        "(static post-training, QDQ, per-channel weights; --calibration). "
                                        "With --train: the float training artifact plus an int8 inference "
                                        "library that a node rebuilds after each round."),
    calibration: Path | None = typer.Option(None, "--calibration", help="With --quantize: .npz of input "
                                            "samples, one [N, ...] float32 array per input, named so."),
    calibration_from: Path | None = typer.Option(None, "--calibration-from", help="With --quantize: "
                                                 "calibrate on a node's own stored samples (the data_dir "
                                                 "of its NODE.toml; the newest --calibration-samples)."),
    calibration_samples: int = typer.Option(1000, "--calibration-samples", help="With --calibration-from: "
                                            "how many of the newest stored samples."),
    integer: bool | None = typer.Option(None, "--integer-kernels/--float-kernels", help="A QDQ model's "
                                        "convolutions and matmuls on int8 -> int32 kernels, or dequantized "
                                        "to float ops. Default: integer where the preset has an int8 "
                                        "dot-product instruction (rpi5 dotprod, AVX-512 VNNI)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Compile an ONNX model for a board into an artifact directory (manifest + libraries)."""
    from compiler.build import compile_model
    from compiler.errors import CompilerError
    from compiler.trainbuild import TrainSettings

    shapes = parse_shapes(shape)
    cal = calibration if calibration_from is None else node_calibration(calibration, calibration_from,
                                                                        calibration_samples)

    settings = None
    if train:
        try:
            settings = TrainSettings(loss=loss, optimizer=optimizer, lr=lr, batch=batch)
        except ValueError as exc:
            raise CompilerError(f"bad training settings: {exc}",
                                hint="--loss ce|mse, --optimizer sgd|adam, --lr > 0, --batch >= 1") from None
    out_dir = compile_model(model, target=target, out_dir=out, name=name, tune=tune,
                            trials=default_trials(trials, time_budget), time_budget=time_budget, rpc=rpc,
                            db_dir=db, train=settings, progress=not quiet, input_shapes=shapes,
                            prepack=not no_prepack, quantize=quantize, calibration=cal,
                            integer=integer)
    typer.echo(str(out_dir))


def node_calibration(calibration: Path | None, data_dir: Path, limit: int) -> CalibrationSet:
    """``--calibration-from DIR``: the newest ``limit`` samples of the node's store in ``DIR``."""
    from compiler.errors import CompilerError
    from edgenode.calibration import open_store, store_calibration

    if calibration is not None:
        raise CompilerError("--calibration and --calibration-from both given",
                            hint="calibrate on an .npz or on a node's stored samples, not both")
    store = open_store(data_dir)
    try:
        return store_calibration(store, limit)
    finally:
        store.close()


def default_trials(trials: int | None, time_budget: float | None) -> int | None:
    """--trials as given; 64 when neither it nor --time-budget is."""
    return 64 if trials is None and time_budget is None else trials


@app.command("tune")
def tune_cmd(
    model: Path = typer.Argument(..., help="ONNX model file."),
    target: str = typer.Option(..., "--target", "-t", help="Target preset of the board (`fractal targets`)."),
    rpc: str | None = typer.Option(None, "--rpc", help="HOST:PORT of the board's `fractal rpc-server` "
                                   "(default: measure on this machine, for host presets)."),
    trials: int | None = typer.Option(None, "--trials", help="Trials in total, an equal share per task "
                                      "(default 64, or none with --time-budget)."),
    time_budget: float | None = typer.Option(None, "--time-budget", help="Seconds of tuning "
                                             "(with --trials: whichever ends first)."),
    db: Path | None = typer.Option(None, "--db", help="Tuning database directory (default: the user cache, "
                                   "then the databases shipped for the zoo models; --db uses only DIR)."),
    shape: list[str] = typer.Option([], "--shape", help="Fix an input's dims: NAME=D0,D1,..."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Tune a model for a board into the tuning database (no artifact); `fractal compile --tune`
    with the same --target, --db and budget then applies the records without running trials."""
    from compiler.build import TuneBudget, tune_model

    result = tune_model(model, target=target, db_dir=db, progress=not quiet, input_shapes=parse_shapes(shape),
                        budget=TuneBudget(default_trials(trials, time_budget), time_budget, rpc))
    typer.echo(result.path)


@app.command("rpc-server")
def rpc_server_cmd(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0: every interface; the "
                             "server runs any code a client sends: private networks only)."),
    port: int = typer.Option(9190, "--port", help="Port to listen on."),
) -> None:
    """Run TVM's RPC server on this board so a host can tune for it (`fractal tune --rpc`).
    Without the fractal CLI on the board: `python3 -m compiler.rpc_server --host H --port P`."""
    from compiler.rpc_server import serve

    try:
        serve(host, port)
    except OSError as exc:
        from compiler.errors import CompilerError

        raise CompilerError(f"cannot listen on {host}:{port}: {exc}", hint="choose another --port") from None


@app.command("inspect")
def inspect_cmd(
    model: Path = typer.Argument(..., help="ONNX model file."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Inputs/outputs (dynamic dims named), opsets, operator histogram and unsupported operators."""
    import json

    from compiler.inspect import format_report, inspect_model

    report = inspect_model(model)
    typer.echo(json.dumps(report.to_json(), indent=2) if as_json else format_report(report))


def parse_shapes(values: list[str]) -> dict[str, list[int]]:
    """Repeated ``--shape NAME=D0,D1,...`` -> {name: dims}; a name given twice is an error."""
    from compiler.errors import ModelError
    from compiler.prepare import parse_shape

    out: dict[str, list[int]] = {}
    for text in values:
        name, dims = parse_shape(text)
        if name in out:
            raise ModelError(f"--shape {name} given twice", hint="give each input once")
        out[name] = dims
    return out


def _read_npz(path: Path) -> dict:
    import numpy as np

    from compiler.errors import InputError

    if not path.is_file():
        raise InputError(f"input file {str(path)!r} not found", hint="pass an .npz written with numpy.savez")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InputError(f"{path.name} is not a readable .npz file ({exc})",
                         hint="write it with numpy.savez(path, **{input_name: array})") from None


@app.command("predict")
def predict_cmd(
    artifact: Path = typer.Argument(..., help="Artifact directory from `fractal compile`."),
    input: Path = typer.Option(..., "--input", "-i", help=".npz with one array per model input (by name)."),
    output: Path = typer.Option(..., "--output", "-o", help=".npz to write, one array per model output."),
) -> None:
    """Run inference on the inputs in an .npz file; write the outputs to another .npz."""
    import numpy as np

    from compiler.artifact import load_artifact

    art = load_artifact(artifact)
    outputs = art.infer(_read_npz(input))
    # strings as numpy str arrays, which np.load reads without allow_pickle
    outputs = {k: v.astype(str) if v.dtype == object else v for k, v in outputs.items()}
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "wb") as fh:  # a file object keeps numpy from appending ".npz"
        np.savez(fh, **outputs)  # type: ignore[arg-type]
    shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in outputs.items())
    typer.echo(f"wrote {output} ({shapes})")


@app.command("verify")
def verify_cmd(
    artifact: Path = typer.Argument(..., help="Artifact directory from `fractal compile`."),
    model: Path = typer.Option(..., "--model", "-m", help="The ONNX model the artifact was compiled from."),
    emulate: bool = typer.Option(False, "--emulate", help="Run a foreign-arch artifact under qemu-user."),
    tol: float = typer.Option(1e-4, "--tol", help="Largest acceptable max abs error."),
) -> None:
    """Compare the artifact with onnxruntime on random inputs; print the max abs error."""
    from compiler.verify import verify_artifact

    res = verify_artifact(artifact, model, emulate=emulate, tol=tol)
    typer.echo(f"max_abs_error={res.max_abs_error:.3e} samples={res.samples} "
               f"emulated={str(res.emulated).lower()} tol={tol:g} {'OK' if res.ok else 'FAIL'}")
    if not res.ok:
        raise typer.Exit(1)


@app.command("targets")
def targets_cmd() -> None:
    """List the target presets (TVM target + linker per board), and the one `--target native` picks here."""
    from compiler.errors import TargetError
    from compiler.targets import PRESETS, native_preset

    rows = [("preset", "arch", "mcpu", "linker", "description")]
    rows += [(p.name, p.arch, str(p.target.get("mcpu", "")), p.cross_compiler or "host g++", p.description)
             for p in PRESETS.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        typer.echo(" ".join(f"{c:<{w}}" for c, w in zip(r[:4], widths, strict=True)) + f" {r[4]}")
    try:
        name, why = native_preset()
    except TargetError:
        return  # an architecture with no preset: nothing is native here
    typer.echo(f"\nnative (this machine): {name} ({why})")
