"""``compile_model``: ONNX file -> artifact directory (libraries, params, manifest).

import -> (optional) MetaSchedule tuning -> ``relax.build`` -> ``export_library`` with the preset's
linker -> (optional) training module -> params.npz -> manifest.json. The directory is assembled
in a temporary sibling and renamed into place, so a failed compile never leaves half an artifact.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from compiler import prepack as _prepack
from compiler.artifact import load_params, param_key
from compiler.errors import ArtifactError, CompilerError, TargetError
from compiler.hoststage import HOST_FILE
from compiler.manifest import (
    MANIFEST,
    HostInfo,
    Libs,
    Manifest,
    NonFinite,
    ParamsInfo,
    QuantizationInfo,
    QuantSettings,
    TargetInfo,
    TensorSpec,
    TrainingInfo,
    TuningInfo,
    file_sha256,
)
from compiler.targets import TargetPreset, get_preset, linker_for, resolve_target
from compiler.trainbuild import (
    ADJOINT_FUNC,
    OPTIMIZER_FUNC,
    TrainSettings,
    build_training_module,
    optimizer_state_shapes,
)

if TYPE_CHECKING:
    from compiler.hostsplit import HostSplit
    from compiler.quantize import Calibration

__all__ = ["compile_model", "tune_model", "TuneBudget", "TrainSettings", "build_library"]

INFER_LIB = "infer.so"
TRAIN_LIB = "train.so"
PARAMS_FILE = "params.npz"
QUANT_FILE = "model.int8.onnx"  # the QDQ model a --quantize compile built (onnxruntime's reference)
# --train --quantize: the float model (re-quantized after rounds) and the int8 inference artifact
FLOAT_FILE = "model.float.onnx"
INT8_DIR = "int8"
C_TRAIN_PREFIX = "train-"  # the C route's training library and runner: train-libmodel.so, train-fractal-run
INFER_FUNC = "main"


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[fractal] {msg}", file=sys.stderr, flush=True)


def _fcompile(preset: TargetPreset) -> Any:
    """The export_library linker for ``preset`` (None: TVM's default host g++)."""
    from tvm.support import cc

    linker = linker_for(preset)
    if linker is None:
        return None
    # A fresh closure per export: tvm's cross_compiler appends to its options list in place.
    return cc.cross_compiler(linker, options=list(preset.link_options))


def build_library(mod: Any, preset: TargetPreset, path: Path) -> Path:
    """Compile a Relax module for ``preset`` and link it to ``path``."""
    from tvm import relax

    target = preset.tvm_target()
    try:
        ex = relax.build(mod, target=target)
    except Exception as exc:
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise CompilerError(f"TVM failed to build for {preset.name}: {detail}",
                            hint="report the model; try another target preset") from None
    fcompile = _fcompile(preset)
    try:
        if fcompile is None:
            ex.export_library(str(path))
        else:
            ex.export_library(str(path), fcompile=fcompile)
    except Exception as exc:
        raise TargetError(f"linking {path.name} for {preset.name} failed: {' '.join(str(exc).split())[:300]}",
                          hint=f"check the cross toolchain {preset.cross_compiler or 'g++'}") from None
    return path


def _build_c(mod: Any, preset: TargetPreset, out: Path, funcs: list[str], name: str,
             prefix: str, checks: dict[str, tuple[Any, ...]] | None = None) -> list[str]:
    """The C route (preset.runtime == "c"): native library + runner, file names in ``out``."""
    from compiler.cbackend import compile_c

    build, _ = compile_c(mod, preset, out, funcs=funcs, model_name=name, prefix=prefix, checks=checks)
    return [build.lib.name, build.runner.name]


def _libs(c_route: bool, train: bool) -> Libs:
    """The manifest's ``libs``: which files hold inference and training, and how they run."""
    if not c_route:
        return Libs(INFER_LIB, TRAIN_LIB if train else None)
    from compiler.cbackend import LIB_NAME, RUNNER_NAME

    return Libs(LIB_NAME, f"{C_TRAIN_PREFIX}{LIB_NAME}" if train else None, "c", RUNNER_NAME,
                f"{C_TRAIN_PREFIX}{RUNNER_NAME}" if train else None)


@dataclass(frozen=True)
class TuneBudget:
    """How much tuning to do and where to measure: ``trials`` in total (an equal share per task)
    and/or ``time_budget`` seconds; ``rpc`` "HOST:PORT" of a board's RPC server that times the
    candidates (default: this machine)."""

    trials: int | None = 64
    time_budget: float | None = None
    rpc: str | None = None

    def describe(self) -> str:
        parts = ([f"{self.trials} trials"] if self.trials is not None else []) + \
                ([f"{self.time_budget:g} s"] if self.time_budget is not None else [])
        return " / ".join(parts) + (f", measured on {self.rpc}" if self.rpc else "")


def _remote(budget: TuneBudget, preset: TargetPreset) -> Any:
    if budget.rpc is None:
        return None
    from compiler import tuning

    return tuning.Remote.parse(budget.rpc, linker=linker_for(preset), link_options=tuple(preset.link_options))


def _tune(imported_mod: Any, preset: TargetPreset, budget: TuneBudget, db_dir: str | Path | None,
          progress: bool, prepack: bool = False, inference: bool = True) -> tuple[Any, TuningInfo]:
    try:
        from compiler import tuning
    except ImportError as exc:
        raise CompilerError(f"tuning is not available in this build ({exc})",
                            hint="compile without --tune") from None
    remote = _remote(budget, preset)
    # the training module keeps its layout (channels-last is measured for inference only)
    result = tuning.tune(imported_mod, preset.tvm_target(), trials=budget.trials,
                         time_budget=budget.time_budget, db_dir=db_dir, progress=progress, prepack=prepack,
                         remote=remote, channels_last=inference)
    from compiler import schedules

    built = schedules.apply_tuned(imported_mod, preset.tvm_target(), db_dir, prepack=prepack,
                                  prefer=result.source, channels_last=inference)
    if built.kept_default:
        _say(progress, f"{built.kept_default} kernel(s) kept the default schedule (timed faster than "
                       "the database's record here)")
    info = TuningInfo(tuned=True, db_id=result.db_id, reused=result.reused, trials=int(budget.trials or 0),
                      trials_run=result.trials_run, seconds=round(result.seconds, 3),
                      db_dir=str(db_dir) if db_dir is not None else None, schedule="tuned",
                      time_budget=budget.time_budget, measured_on=budget.rpc, database=result.source,
                      applied=built.applied, kept_default=built.kept_default)
    return built.mod, info


def tune_model(onnx_path: str | Path, *, target: str, budget: TuneBudget, db_dir: str | Path | None = None,
               progress: bool = True, prepack: bool = True,
               input_shapes: dict[str, list[int]] | None = None) -> Any:
    """Tune the inference module of ``onnx_path`` for ``target`` into its database, building no
    artifact (``fractal tune``); a later ``compile_model(..., tune=True)`` with the same database
    and budget runs no trials. Returns the :class:`compiler.tuning.TuneResult`."""
    from compiler import tuning
    from compiler.importer import import_model, load_onnx

    target, chose = resolve_target(target)
    if chose:
        _say(progress, chose)
    preset = get_preset(target)
    if preset.runtime == "c":
        raise TargetError(f"preset {preset.name!r} uses the C backend, which is not tuned",
                          hint="tune a VM preset of the same board (e.g. aarch64 or rpi4)")
    linker_for(preset)  # fail fast on a missing cross compiler
    remote = _remote(budget, preset)
    model = load_onnx(Path(onnx_path))
    split = _host_split(model, input_shapes, False, False, False)
    if split is not None:  # the compiled part only: string operators run on the host
        if split.numeric is None:
            raise CompilerError(f"{Path(onnx_path).name} is string operators only: nothing is compiled, "
                                "nothing to tune", hint="compile it without --tune")
        model = split.numeric
    mod = import_model(model, shapes=input_shapes).mod
    _say(progress, f"tuning {Path(onnx_path).name} for {preset.name} ({budget.describe()})")
    return tuning.tune(mod, preset.tvm_target(), trials=budget.trials, time_budget=budget.time_budget,
                       db_dir=db_dir, progress=progress, prepack=prepack, remote=remote)


def _prepare_out(out_dir: Path) -> Path:
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ArtifactError(f"--out {str(out_dir)!r} exists and is not a directory",
                                hint="choose another path")
        if any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
            raise ArtifactError(f"--out {str(out_dir)!r} is a non-empty directory that is not an artifact",
                                hint="choose an empty or new directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))


def _install(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{time.time_ns()}")
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_dir)


def integer_by_default(preset: TargetPreset) -> bool:
    """Whether a QDQ model goes onto integer kernels by default for ``preset``: where the CPU has
    an int8 dot-product instruction (Arm dotprod, x86 AVX-512 VNNI). On AVX2 the tensorized kernels
    (:mod:`compiler.int8_x86`) beat the float import on resnet8 (0.65-0.84x) but not on ds-cnn-kws
    (1.07-1.22x, its depthwise layers) or fc-autoencoder (0.97-1.05x) (BENCHMARKS.md "int8"), so
    AVX2 keeps the float import by default; both are within one quantization step of
    onnxruntime's reference."""
    mattr = set(preset.target.get("mattr", []))
    return bool(mattr & {"+dotprod", "+avx512vnni"})


def compile_model(onnx_path: str | Path, *, target: str, out_dir: str | Path, name: str | None = None,
                  tune: bool = False, trials: int | None = 64, db_dir: str | Path | None = None,
                  train: TrainSettings | None = None, progress: bool = True,
                  default_schedules: bool = True, input_shapes: dict[str, list[int]] | None = None,
                  prepack: bool = True, time_budget: float | None = None, rpc: str | None = None,
                  quantize: str | None = None, calibration: Calibration | None = None,
                  integer: bool | None = None, quant_settings: QuantSettings | None = None) -> Path:
    """Compile ``onnx_path`` for the preset ``target`` into the artifact directory ``out_dir``.

    Without ``tune`` the inference kernels get :mod:`compiler.schedules`' default CPU schedules
    (``default_schedules=False``: TVM's naive lowering, for comparison).
    ``prepack`` (VM targets, tuned or default-scheduled): BatchNorm folded into the convolutions
    and the parameter-only work (with tuning: the weight layout rewrites) lifted into a
    transform run once per parameter set (:mod:`compiler.prepack`); training is unaffected.
    ``input_shapes``: input name -> dims (``--shape``) fixing dynamic dimensions; -1 leaves one dynamic.
    Tuning budget: ``trials`` (total, an equal share per task) and/or ``time_budget`` seconds;
    ``rpc`` "HOST:PORT": measure on the board's RPC server (any preset of the board's arch).
    ``quantize="int8"`` with ``calibration`` (an .npz of input samples, or a
    :class:`compiler.quantize.CalibrationSet`, e.g. a node's stored samples): the float model is
    quantized first (static post-training, QDQ, :mod:`compiler.quantize`) and the QDQ model is
    compiled; it is kept in the artifact as ``QUANT_FILE`` (the reference onnxruntime runs).
    ``integer``: a QDQ model's quantized convolutions and matmuls on int8 -> int32 kernels
    (:mod:`compiler.integer`) or, False, TVM's dequantize -> float op -> quantize import; None
    (the default): :func:`integer_by_default` of the preset. ``quant_settings``: how to quantize
    (default: :class:`compiler.manifest.QuantSettings`).
    ``train`` with ``quantize``: training stays float. The artifact is the float one (inference
    and training libraries, float parameters) plus the int8 inference artifact in ``INT8_DIR``,
    the float model as ``FLOAT_FILE`` and the settings that built it (manifest ``quantization``):
    what a node needs to rebuild the int8 library from the parameters a round committed
    (:mod:`compiler.requantize`).

    Returns the artifact directory. Raises ModelError / TargetError / ArtifactError with a hint.
    """
    import tvm

    from compiler.importer import import_model, load_onnx

    t0 = time.perf_counter()
    target, chose = resolve_target(target)
    if chose:
        _say(progress, chose)
    preset = get_preset(target)
    if (rpc is not None or time_budget is not None) and not tune:
        raise CompilerError("--rpc and --time-budget apply to tuning", hint="add --tune")
    c_route = preset.runtime == "c"
    if c_route:
        from compiler.cbackend import c_compiler_for

        c_compiler_for(preset.arch)  # fail fast on a missing cross compiler, before minutes of work
    else:
        linker_for(preset)  # fail fast on a missing cross compiler, before minutes of work
    onnx_path = Path(onnx_path)
    out_dir = Path(out_dir)
    name = name or onnx_path.stem
    src_onnx = onnx_path  # the manifest names the model given, the artifact also keeps the QDQ one
    quant_dir, quant_steps = None, []
    if quantize is not None or calibration is not None:
        from compiler import quantize as _quant

        if quantize not in _quant.MODES:
            raise CompilerError(f"--quantize {quantize or '(not given)'} with calibration samples: the mode "
                                f"must be one of {', '.join(_quant.MODES)}",
                                hint="--quantize int8 --calibration SAMPLES.npz")
        if calibration is None:
            raise CompilerError(f"--quantize {quantize} needs calibration samples: --calibration SAMPLES.npz "
                                "or --calibration-from NODE_DATA_DIR",
                                hint="a few hundred samples of the data the model will see")
        if train is not None:  # training stays float: the int8 library is built beside it, below
            return _compile_float_and_int8(
                onnx_path, calibration, quant_settings or QuantSettings(), target=target, out_dir=out_dir,
                name=name, tune=tune, trials=trials, db_dir=db_dir, train=train, progress=progress,
                default_schedules=default_schedules, input_shapes=input_shapes, prepack=prepack,
                time_budget=time_budget, rpc=rpc, quantize=quantize, integer=integer)
        quant_dir = tempfile.TemporaryDirectory(prefix="fractal-quant-")
        src = calibration.source if isinstance(calibration, _quant.CalibrationSet) else Path(calibration).name
        _say(progress, f"quantizing {onnx_path.name} to int8 (calibration: {src})")
        qpath, n_cal = _quant.quantize_int8(onnx_path, calibration, Path(quant_dir.name) / QUANT_FILE,
                                            quant_settings)
        quant_steps = [f"quantize_int8(qdq, per-channel weights, {n_cal} calibration samples)"]
        onnx_path = qpath
    model = load_onnx(onnx_path)
    split = _host_split(model, input_shapes, train is not None, quant_dir is not None, c_route)
    if split is not None:
        host_ops = ", ".join(n.op for n in (*split.stage.head, *split.stage.tail))
        _say(progress, f"string operators on the host: {host_ops}")
        if split.numeric is None:
            return _compile_host_only(split, preset, out_dir, name, src_onnx, t0, progress)
        model = split.numeric
        names = {i.name for i in model.graph.input}
        input_shapes = {k: v for k, v in (input_shapes or {}).items() if k in names}
    _say(progress, f"importing {onnx_path.name} for {preset.name}")
    if integer is None:
        integer = integer_by_default(preset)
    imported = import_model(model, shapes=input_shapes, integer=integer, target=preset.tvm_target())
    host = None
    if split is not None:
        host = HostInfo(HOST_FILE, tuple(imported.inputs), tuple(imported.outputs))
        imported.inputs, imported.outputs = _user_specs(split, imported.batch if imported.batched else None)
    if imported.prepared_steps:
        _say(progress, f"prepared the graph: {', '.join(imported.prepared_steps)}")

    tuning_info = TuningInfo()
    mod = imported.mod
    prepack = prepack and not c_route and (tune or default_schedules)
    if prepack and not tune:
        mod = _prepack.fold_batchnorm(mod)  # (tuning folds it in tuning.prepare)
    budget = TuneBudget(trials, time_budget, rpc)
    if tune:
        _say(progress, f"tuning with MetaSchedule ({budget.describe()})")
        mod, tuning_info = _tune(mod, preset, budget, db_dir, progress, prepack)
    elif default_schedules:
        from compiler import schedules

        _say(progress, "scheduling kernels (default CPU schedules; --tune measures better ones)")
        mod = schedules.apply(mod, preset.tvm_target())
        if prepack:
            mod = _prepack.after_tuning()(mod)
        tuning_info = TuningInfo(schedule="default")
    transform = None
    if prepack and _prepack.has_transform(mod):
        transform = _prepack.TRANSFORM_FUNC
        _say(progress, "parameter-only work (BatchNorm folding, weight layouts) moved to "
                       f"{transform}, run once per parameter set")

    tmp = _prepare_out(out_dir)
    try:
        _say(progress, "building inference library" + (" (C backend)" if c_route else ""))
        if c_route:
            files = _build_c(mod, preset, tmp, [INFER_FUNC], name, "")
        else:
            build_library(mod, preset, tmp / INFER_LIB)
            files = [INFER_LIB]
        training = None
        if train is not None:
            _say(progress, f"building training module (loss={train.loss}, optimizer={train.optimizer}, "
                           f"batch={train.batch})")
            timported = import_model(model, batch=train.batch, shapes=input_shapes)
            tmod = build_training_module(timported.mod, num_inputs=len(timported.inputs),
                                         num_params=len(timported.params), settings=train)
            train_tuning = TuningInfo()
            if tune:
                # The backward and optimizer kernels are other workloads (other shapes and ops)
                # than inference: their own database (keyed by workload), the same trial budget.
                _say(progress, f"tuning the training module with MetaSchedule ({budget.describe()})")
                tmod, train_tuning = _tune(tmod, preset, budget, db_dir, progress, inference=False)
            out = timported.outputs[0]
            if c_route:
                from compiler.cbackend import InputCheck

                # the targets (the adjoint's last input) are checked inside the library itself
                classes = int(out.shape[-1]) if train.loss == "ce" else None
                checks = {ADJOINT_FUNC: (InputCheck(-1, "targets", classes),)}
                files += _build_c(tmod, preset, tmp, [ADJOINT_FUNC, OPTIMIZER_FUNC], name, C_TRAIN_PREFIX,
                                  checks)
            else:
                build_library(tmod, preset, tmp / TRAIN_LIB)
                files.append(TRAIN_LIB)
            targets = (TensorSpec("targets", (train.batch,), "int64") if train.loss == "ce"
                       else TensorSpec("targets", tuple(out.shape), out.dtype))
            shapes = [tuple(p.shape) for p in imported.params]
            training = TrainingInfo(
                loss=train.loss, optimizer=train.optimizer, lr=train.lr, batch=train.batch,
                inputs=tuple(timported.inputs), targets=targets,
                optimizer_state=tuple(optimizer_state_shapes(train.optimizer, shapes)),
                tuning=train_tuning)
        arrays = {param_key(i): p for i, p in enumerate(imported.params)}
        np.savez(tmp / PARAMS_FILE, **arrays)  # type: ignore[arg-type]  # (numpy stubs: **kwds vs allow_pickle)
        files.append(PARAMS_FILE)
        if quant_dir is not None:
            shutil.copy2(onnx_path, tmp / QUANT_FILE)
            files.append(QUANT_FILE)
        if split is not None:
            split.stage.write(tmp / HOST_FILE)
            files.append(HOST_FILE)
        manifest = Manifest(
            name=name,
            created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            onnx_file=src_onnx.name,
            onnx_sha256=file_sha256(src_onnx),
            tvm_version=tvm.__version__,
            target=TargetInfo(preset.name, preset.arch, dict(preset.target), preset.cross_compiler,
                              preset.description),
            batch=imported.batch,
            inputs=tuple(imported.inputs),
            outputs=tuple(imported.outputs),
            params=ParamsInfo(PARAMS_FILE, tuple(imported.param_names),
                              tuple(tuple(p.shape) for p in imported.params),
                              tuple(str(p.dtype) for p in imported.params)),
            libs=dataclasses.replace(_libs(c_route, train is not None), transform=transform),
            files={f: file_sha256(tmp / f) for f in files},
            tuning=tuning_info,
            training=training,
            compile_seconds=round(time.perf_counter() - t0, 3),
            compiled_shapes={s.name: tuple(s.shape) for s in imported.inputs},
            prepared_steps=(*quant_steps, *imported.prepared_steps),
            batched=imported.batched,
            nonfinite=imported.nonfinite,
            host=host,
        )
        manifest.write(tmp)
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if quant_dir is not None:
            quant_dir.cleanup()
    _say(progress, f"wrote {out_dir} in {time.perf_counter() - t0:.1f}s")
    return out_dir


def _host_split(model: Any, shapes: dict[str, list[int]] | None, train: bool, quantize: bool,
                c_route: bool) -> HostSplit | None:
    """The model's host stage and numeric rest (compiler/hostsplit.py), or None without strings."""
    from compiler.hostsplit import split_host_stage

    split = split_host_stage(model, shapes)
    if split is None:
        return None
    why = ("--train" if train else "--quantize" if quantize else
           "the C backend (its board runner takes numeric tensors only)" if c_route else None)
    if why is not None:
        raise CompilerError(f"the model has string tensors (run on the host), which {why} does not take",
                            hint="compile without it, or for a VM preset (e.g. --target x86_64)")
    return split


def _user_specs(split: HostSplit, batch: int | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The model's own inputs and outputs for the manifest: a dynamic leading dim becomes the
    library's ``batch`` (None: no batch dimension, every input dim must be fixed)."""
    from compiler.errors import ModelError

    def fix(spec: TensorSpec, is_input: bool) -> TensorSpec:
        dims = list(spec.shape)
        if dims and dims[0] < 0 and batch is not None:
            dims[0] = batch
        if is_input and any(d < 0 for d in dims):
            raise ModelError(f"input {spec.name!r} has a dynamic dimension and the model has no batch "
                             "dimension to give it", hint=f"fix it with --shape {spec.name}=D0,D1,...")
        return dataclasses.replace(spec, shape=tuple(dims))

    return [fix(s, True) for s in split.inputs], [fix(s, False) for s in split.outputs]


def _compile_host_only(split: HostSplit, preset: TargetPreset, out_dir: Path, name: str, src_onnx: Path,
                       t0: float, progress: bool) -> Path:
    """An artifact whose every output the host stage computes: host.json, no library."""
    import tvm

    inputs, outputs = _user_specs(split, None)
    tmp = _prepare_out(out_dir)
    try:
        split.stage.write(tmp / HOST_FILE)
        np.savez(tmp / PARAMS_FILE)
        files = [HOST_FILE, PARAMS_FILE]
        Manifest(
            name=name, created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            onnx_file=src_onnx.name, onnx_sha256=file_sha256(src_onnx), tvm_version=tvm.__version__,
            target=TargetInfo(preset.name, preset.arch, dict(preset.target), preset.cross_compiler,
                              preset.description),
            batch=1, inputs=tuple(inputs), outputs=tuple(outputs),
            params=ParamsInfo(PARAMS_FILE, (), (), ()), libs=Libs(None),
            files={f: file_sha256(tmp / f) for f in files},
            compile_seconds=round(time.perf_counter() - t0, 3),
            compiled_shapes={s.name: tuple(s.shape) for s in inputs},
            prepared_steps=("string operators on the host (no compiled library)",),
            batched=False, nonfinite=NonFinite("", ""), host=HostInfo(HOST_FILE),
        ).write(tmp)
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(progress, f"wrote {out_dir} in {time.perf_counter() - t0:.1f}s")
    return out_dir


def _compile_float_and_int8(onnx_path: Path, calibration: Calibration, settings: QuantSettings, *,
                            out_dir: Path, quantize: str, integer: bool | None, **kw: Any) -> Path:
    """``compile_model(..., train=..., quantize=...)``: the float training artifact, then the int8
    inference artifact inside it (``INT8_DIR``), the float model (``FLOAT_FILE``) and the manifest's
    ``quantization``, all listed with their sha256 in the outer manifest (one check covers both)."""
    from compiler import quantize as _quant
    from compiler.quantize import check_params_map

    float_dir = compile_model(onnx_path, out_dir=out_dir, **kw)
    man = Manifest.read(float_dir)
    art_names, art_params = load_params(float_dir, man)
    # the trained parameters must go back into the float model by name, or no rebuild is right
    check_params_map(onnx_path, art_names, art_params)
    preset = get_preset(man.preset)
    if integer is None:
        integer = integer_by_default(preset)
    tmp = _prepare_out(out_dir)  # a copy of the float artifact grows the int8 parts, then replaces it
    try:
        shutil.rmtree(tmp)
        shutil.copytree(float_dir, tmp)
        shapes = kw.get("input_shapes")
        compile_model(onnx_path, target=man.preset, out_dir=tmp / INT8_DIR, name=man.name,
                      tune=kw.get("tune", False), trials=kw.get("trials"), db_dir=kw.get("db_dir"),
                      progress=kw.get("progress", True), default_schedules=kw.get("default_schedules", True),
                      input_shapes=shapes, prepack=kw.get("prepack", True), time_budget=kw.get("time_budget"),
                      rpc=kw.get("rpc"), quantize=quantize, calibration=calibration, integer=integer,
                      quant_settings=settings)
        shutil.copy2(onnx_path, tmp / FLOAT_FILE)
        inner = Manifest.read(tmp / INT8_DIR)
        files = {**man.files, FLOAT_FILE: file_sha256(tmp / FLOAT_FILE), f"{INT8_DIR}/{MANIFEST}":
                 file_sha256(tmp / INT8_DIR / MANIFEST),
                 **{f"{INT8_DIR}/{f}": d for f, d in inner.files.items()}}
        n_cal = _quant.calibration_count(calibration, onnx_path)
        quant = QuantizationInfo(quantize, INT8_DIR, FLOAT_FILE, settings, n_cal, bool(integer))
        dataclasses.replace(man, files=files, quantization=quant,
                            prepared_steps=(f"int8 library in {INT8_DIR}/ ({n_cal} calibration samples)",
                                            *man.prepared_steps)).write(tmp)
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
