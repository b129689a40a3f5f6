"""MetaSchedule tuning of a Relax module, with tuning databases cached per target and workload.

Layout of a database directory (``db_dir``, default ``user_cache_dir("fractal-edge")/tuning``)::

    db_dir/<target key>/<workload hash>/database_workload.json       MetaSchedule JSON database
                                        database_tuning_record.json
                                        tune.json                      what was tuned, how long
                                        logs/                          MetaSchedule's own logs

``<target key>`` is readable (``llvm-x86_64-x86-64-<hash>``) and hashes the canonical target
dict; ``<workload hash>`` hashes the fused TIR module that tuning sees. Parameters are runtime
inputs of the imported module (see ``compiler.importer``), so two models of the same
architecture with different weights share one database. :func:`tune` reuses a database that
already holds at least the requested number of trials and runs none; :func:`apply` rewrites the
module with the best schedules found, for ``relax.build`` to compile.

Cross-target tuning: MetaSchedule times every candidate by running it, so a target is tuned
only when it runs on this machine (same architecture; every ``+feature`` of ``mattr`` present
in the CPU). Tuning an aarch64 or riscv64 preset on an x86-64 host raises a :class:`TargetError`:
timings under qemu-user would rank schedules by emulation cost, not by the board's. A database
tuned on the board itself (copied into ``db_dir``) is still applied by :func:`apply`, which
never measures anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from compiler.errors import CompilerError, TargetError

__all__ = ["TuneResult", "tune", "apply", "default_db_dir", "database_path", "can_measure", "prepare"]

FORMAT = 1
_ARCH_ALIASES = {"amd64": "x86_64", "x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64",
                 "riscv64": "riscv64"}
# Only compute-heavy tasks are worth trials; the rest (reshape, mean, ...) keep the default
# schedule. With a budget of tens of trials this is where the time goes.
_ANCHOR_OPS = ("conv2d", "matmul", "dense", "batch_matmul")
_MIN_PER_ITER = 4
_MAX_PER_ITER = 64
# Rounds per task the budget is split into (measured on ds-cnn-kws, 64 trials, 1 thread: one
# round 224 us, four rounds 116 us): the gradient scheduler moves later rounds to the slow tasks.
_ROUNDS = 4
_MIN_POPULATION = 64
_BUILD_TIMEOUT = 120.0
_RUN_TIMEOUT = 60.0


@dataclass(frozen=True)
class TuneResult:
    """Outcome of :func:`tune`: ``db_id`` names the database (``<target key>/<workload hash>``)."""

    db_id: str
    reused: bool
    trials_run: int
    seconds: float
    tasks: int = 0
    path: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default_db_dir() -> Path:
    """``platformdirs.user_cache_dir("fractal-edge")/tuning``."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("fractal-edge")) / "tuning"


def _as_target(target: Any) -> Any:
    """A ``tvm.target.Target`` from a Target, a target dict, or a preset name."""
    import tvm

    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str):
        from compiler.targets import get_preset

        return get_preset(target).tvm_target()
    if isinstance(target, dict):
        return tvm.target.Target(dict(target))
    raise TargetError(f"cannot use {target!r} as a target", hint="pass a preset name or a TVM target dict")


def _target_dict(target: Any) -> dict[str, Any]:
    # str(Target) is its canonical JSON (export() returns FFI containers json cannot dump)
    return json.loads(str(target)) if not isinstance(target, dict) else json.loads(json.dumps(target))


def _target_key(target: Any) -> str:
    d = _target_dict(target)
    canon = json.dumps(d, sort_keys=True, separators=(",", ":"))
    triple = str(d.get("mtriple") or "host").split("-")[0]
    readable = "-".join(str(p) for p in (d.get("kind", "target"), triple, d.get("mcpu") or "generic"))
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in readable)
    return f"{readable}-{hashlib.sha256(canon.encode()).hexdigest()[:12]}"


def _host_arch() -> str:
    from compiler.targets import host_arch

    return host_arch()


def _cpu_flags() -> set[str]:
    from compiler.targets import cpu_flags

    return cpu_flags()


def can_measure(target: Any) -> tuple[bool, str]:
    """Whether candidates for ``target`` can be timed on this machine, and why not."""
    d = _target_dict(_as_target(target))
    if d.get("kind") != "llvm":
        return False, f"target kind {d.get('kind')!r} is not a CPU target"
    triple = str(d.get("mtriple") or "")
    arch = _ARCH_ALIASES.get(triple.split("-")[0], triple.split("-")[0]) if triple else _host_arch()
    if arch != _host_arch():
        return False, f"target architecture {arch} cannot run on this {_host_arch()} host"
    flags = _cpu_flags()
    # LLVM feature names mostly equal /proc/cpuinfo flags (avx2, fma, avx512f, ...)
    missing = [f[1:] for f in d.get("mattr", []) or [] if f.startswith("+") and flags and f[1:] not in flags]
    if missing:
        return False, f"this CPU lacks {', '.join(missing)}"
    return True, ""


def _cpu_intrinsics_only(arch: str) -> None:
    """Register only this CPU's tensor intrinsics instead of ``import tvm.s_tir.tensor_intrin``.

    MetaSchedule imports the whole package in every TuneContext and build worker; its
    ``__init__`` parses every CUDA/ROCm/Hexagon intrinsic too (60-90 s on this 2-core machine,
    per worker, and the build pool restarts each batch), which makes builds hit their timeout.
    CPU tuning needs at most the x86 (VNNI/AVX-512) or arm (dot product) intrinsics, so the
    package is registered without running its ``__init__`` and just that submodule is loaded.
    """
    import importlib
    import importlib.util
    import sys

    name = "tvm.s_tir.tensor_intrin"
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is None:  # pragma: no cover - a TVM without the package
            return
        sys.modules[name] = importlib.util.module_from_spec(spec)  # package, __init__ not run
    sub = {"x86_64": "x86", "aarch64": "arm_cpu", "riscv64": "riscv_cpu"}.get(arch)
    if sub:
        importlib.import_module(f"{name}.{sub}")


def _make_builder(timeout: float) -> Any:
    """A LocalBuilder whose workers skip the slow intrinsics import (see above)."""
    from tvm.s_tir.meta_schedule.builder import LocalBuilder

    def build(mod: Any, target: Any, _params: Any) -> Any:
        # runs in a fresh worker process: cloudpickle ships this closure by value
        import importlib
        import importlib.util
        import sys

        name = "tvm.s_tir.tensor_intrin"
        if name not in sys.modules:
            spec = importlib.util.find_spec(name)
            if spec is not None:
                sys.modules[name] = importlib.util.module_from_spec(spec)
        from tvm.driver import build as tvm_build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)

    return LocalBuilder(f_build=build, timeout_sec=timeout)


def prepare(mod: Any, target: Any, *, prepack: bool = False) -> Any:
    """Lower a Relax module to fused TIR: the form MetaSchedule extracts tasks from and applies
    records to (same passes as ``relax.pipeline.static_shape_tuning_pipeline``). ``prepack``:
    mark the weights layout-free, so tuned schedules may read them in a rewritten layout
    (:mod:`compiler.prepack`; another workload, hence another database)."""
    from tvm import relax, transform

    from compiler import prepack as _prepack

    target = _as_target(target)
    with target:
        return transform.Sequential([
            relax.transform.DecomposeOpsForInference(),
            relax.transform.CanonicalizeBindings(),
            relax.pipeline.zero_pipeline(),
            *([_prepack.before_tuning()] if prepack else []),
        ])(mod)


def _workload_hash(prepared: Any) -> str:
    # The printed TIR/Relax is deterministic across processes, unlike object addresses.
    return hashlib.sha256(prepared.script(show_meta=False).encode()).hexdigest()[:16]


def database_path(mod: Any, target: Any, db_dir: str | Path | None = None, *, prepack: bool = False) -> Path:
    """The directory holding the database of ``mod`` (a Relax module) for ``target``."""
    target = _as_target(target)
    return _db_path(prepare(mod, target, prepack=prepack), target, db_dir)


def _db_path(prepared: Any, target: Any, db_dir: str | Path | None) -> Path:
    root = Path(db_dir) if db_dir is not None else default_db_dir()
    return root / _target_key(target) / _workload_hash(prepared)


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / "tune.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if meta.get("format") == FORMAT else None


def _progress_callback(total: int, progress: bool) -> tuple[Any, Any, list[int]]:
    """A MeasureCallback counting measured candidates (and driving a rich bar on stderr)."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    count = [0]
    bar: Any = None
    task_id: Any = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TextColumn("trials"),
                       TimeElapsedColumn(), TextColumn("{task.description}"),
                       console=Console(stderr=True), transient=False)
        task_id = bar.add_task("", total=total)

    @derived_object
    class _Count(PyMeasureCallback):
        def apply(self, task_scheduler, task_id_, measure_candidates, builder_results, runner_results):
            count[0] += len(runner_results)
            if bar is not None:
                name = task_scheduler.tasks_[task_id_].ctx.task_name if hasattr(
                    task_scheduler, "tasks_") else ""
                bar.update(task_id, completed=min(count[0], total), description=str(name)[:40])

    return _Count(), bar, count


def tune(mod: Any, target: Any, *, trials: int, db_dir: str | Path | None = None,
         progress: bool = True, seed: int = 0, prepack: bool = False) -> TuneResult:
    """Tune ``mod`` (a Relax IRModule, params as inputs) for ``target`` with up to ``trials``
    measured candidates, or reuse the cached database when it already holds as many."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    if trials < 1:
        raise CompilerError(f"--trials must be >= 1, got {trials}", hint="e.g. --trials 64")
    target = _as_target(target)
    ok, why = can_measure(target)
    if not ok:
        raise TargetError(f"cannot tune for this target here: {why}",
                          hint="compile without --tune (MetaSchedule must time candidates on the "
                               "target itself), or pass --db with a database tuned on the board")
    t0 = time.perf_counter()
    prepared = prepare(mod, target, prepack=prepack)
    path = _db_path(prepared, target, db_dir)
    db_id = f"{path.parent.name}/{path.name}"
    meta = _read_meta(path)
    if meta is not None and meta.get("trials", 0) >= trials:
        if progress:
            print(f"tuning: reusing database {db_id} ({meta.get('trials')} trials recorded, none run)",
                  file=sys.stderr, flush=True)
        return TuneResult(db_id, True, 0, time.perf_counter() - t0, meta.get("tasks", 0), str(path))

    done = int((meta or {}).get("trials", 0))
    todo = trials - done  # a database with fewer trials is extended, not restarted
    tasks = ms.relax_integration.extract_tasks(prepared, target)
    anchors = [t for t in tasks if any(op in t.task_name for op in _ANCHOR_OPS)] or list(tasks)
    if not anchors:
        raise CompilerError("nothing to tune: the model has no TIR tasks", hint="compile without --tune")
    path.mkdir(parents=True, exist_ok=True)
    _cpu_intrinsics_only(_host_arch())
    # several rounds per task when the budget allows: the first round samples blindly (the cost
    # model has no data yet), later ones are guided by the model trained on the measurements
    # ... but never so large that some task gets no round at all: the gradient scheduler starts
    # round-robin, and a task left out keeps the naive schedule (10x slower on a conv). With 64
    # trials a 20-task MobileNet gets rounds of 3, not 16 rounds of 4 for 16 of its 20 tasks.
    n = len(anchors)
    per_iter = max(todo // (_ROUNDS * n), min(_MIN_PER_ITER, max(1, todo // n)))
    per_iter = min(_MAX_PER_ITER, per_iter)
    # a small budget gets a small population: sampling and evolving 512 candidates per task
    # costs more than measuring a handful of them on 2 cores
    strategy = ms.search_strategy.EvolutionarySearch(
        population_size=min(512, max(_MIN_POPULATION, 16 * per_iter)))
    callback, bar, count = _progress_callback(todo, progress)
    callbacks = [*ms.measure_callback.MeasureCallback.create("default"), callback]
    # generous timeouts: the machine is shared and a loaded core makes builds slow
    builder = _make_builder(timeout=_BUILD_TIMEOUT)
    runner = ms.runner.LocalRunner(timeout_sec=_RUN_TIMEOUT, evaluator_config=ms.runner.EvaluatorConfig(
        number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False))
    mslog = logging.getLogger("tvm.s_tir.meta_schedule")
    old_level = mslog.level
    mslog.setLevel(logging.WARNING)  # the per-iteration tables go to db/logs, not the terminal
    # MetaSchedule's logger setup lists the logger's handlers by name and crashes on an unnamed
    # one (e.g. pytest's LogCaptureHandler lands there after a first tuning run in a process):
    # detach those for the run.
    unnamed = [h for h in mslog.handlers if h.get_name() is None]
    for h in unnamed:
        mslog.removeHandler(h)
    try:
        with contextlib.ExitStack() as stack:
            # MetaSchedule binds a console handler to sys.stdout when it configures its loggers
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
                anchors, work_dir=str(path), strategy=strategy, seed=seed, num_threads="physical")
            if bar is not None:
                stack.enter_context(bar)
            ms.tune.tune_tasks(
                tasks=contexts, task_weights=weights, work_dir=str(path),
                max_trials_global=todo, num_trials_per_iter=per_iter,
                builder=builder, runner=runner, measure_callbacks=callbacks,
                database=ms.database.JSONDatabase(work_dir=str(path)),
            )
    except RuntimeError as exc:  # (TVM errors are RuntimeError subclasses; tvm.error.TVMError is gone)
        raise CompilerError(f"MetaSchedule tuning failed: {' '.join(str(exc).split())[:300]}",
                            hint=f"see the logs in {path / 'logs'}; retry without --tune") from None
    finally:
        mslog.setLevel(old_level)
        for h in unnamed:
            mslog.addHandler(h)
    seconds = time.perf_counter() - t0
    meta = {"format": FORMAT, "target": _target_dict(target), "trials": done + todo,
            "trials_run": count[0] + int((meta or {}).get("trials_run", 0)), "tasks": len(anchors),
            "seconds": round(seconds + float((meta or {}).get("seconds", 0.0)), 3),
            "tvm": tvm.__version__, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (path / "tune.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return TuneResult(db_id, False, count[0], seconds, len(anchors), str(path))


def apply(mod: Any, target: Any, db_dir: str | Path | None = None, *, prepack: bool = False) -> Any:
    """``mod`` lowered to fused TIR with the best tuned schedules of its database applied.

    The result goes straight to ``relax.build(result, target)``; functions without a record keep
    the default schedule. ``prepack`` (the database must be tuned with it): the weight layout
    rewrites the schedules need are lifted into ``main_transform_params`` (see
    :mod:`compiler.prepack`). Raises CompilerError if the database was never built."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from compiler import prepack as _prepack

    target = _as_target(target)
    prepared = prepare(mod, target, prepack=prepack)
    path = _db_path(prepared, target, db_dir)
    if not (path / "database_tuning_record.json").is_file():
        raise CompilerError(f"no tuning database for this model and target in {path.parent.parent}",
                            hint="tune first (fractal compile --tune) or point --db at the right directory")
    database = ms.database.JSONDatabase(work_dir=str(path), allow_missing=False)
    with target, database, tvm.transform.PassContext(opt_level=3):
        tuned = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(prepared)
        return _prepack.after_tuning()(tuned) if prepack else tuned

