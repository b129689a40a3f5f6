"""MetaSchedule tuning of a Relax module, with tuning databases cached per target and workload.

Layout of a database directory (``db_dir``, default ``user_cache_dir("fractal-edge")/tuning``)::

    db_dir/<target key>/<workload hash>/database_workload.json       MetaSchedule JSON database
                                        database_tuning_record.json
                                        tune.json                      what was tuned, how long
                                        logs/                          MetaSchedule's own logs

``<target key>`` is readable (``llvm-x86_64-x86-64-<hash>``) and hashes the canonical target
dict without ``num-cores``; ``<workload hash>`` hashes the fused TIR module that tuning sees.
``num-cores`` (the host's core count in the x86_64 presets) only bounds how much parallelism
MetaSchedule's parallel rule tries while searching; a record is a schedule trace replayed on the
workload, whose parallel loops TVM's thread pool spreads over however many cores run it. So a
database tuned on 2 cores is valid (if not re-timed) on a 4-core machine of the same target,
and one key serves both.

Shipped databases: ``compiler/tuned/`` (:func:`shipped_db_dir`) holds databases for the zoo
models on the x86_64 presets, tuned by the project and pruned to the best record per task
(:func:`export_database`). Without an explicit ``db_dir`` (no ``--db``), :func:`tune` uses the
user database when it holds the budget, else the shipped one when it does (no trials run),
else tunes into the user database; :func:`apply` reads the chosen database first and the other
one for the tasks it lacks, so a user's own tuning wins over and adds to the shipped records.
An explicit ``db_dir`` is self-contained: the shipped databases are not consulted. Parameters are runtime
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

__all__ = ["TuneResult", "Remote", "tune", "apply", "default_db_dir", "database_path", "can_measure",
           "prepare", "check_remote", "shipped_db_dir", "export_database", "truncate_database",
           "scheduled_count", "apply_counted"]

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
    source: str = "user"  # "user" (db_dir / the user cache) or "shipped" (compiler/tuned)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Remote:
    """A board that times candidates itself, through TVM's RPC server (:mod:`compiler.rpc_server`).

    ``linker`` links each candidate for the board (the preset's cross C++ driver; None: host g++)."""

    host: str
    port: int
    linker: str | None = None
    link_options: tuple[str, ...] = ()
    timeout: float = 600.0  # seconds per RPC session (one candidate); boards and emulators are slow

    @classmethod
    def parse(cls, text: str, **kw: Any) -> Remote:
        """``HOST:PORT`` -> Remote; CompilerError on anything else."""
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise CompilerError(f"--rpc {text!r} is not HOST:PORT", hint="e.g. --rpc 192.168.1.20:9190")
        return cls(host.strip("[]"), int(port), **kw)


def default_db_dir() -> Path:
    """``platformdirs.user_cache_dir("fractal-edge")/tuning``."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("fractal-edge")) / "tuning"


def shipped_db_dir() -> Path:
    """The databases shipped with the project: ``compiler/tuned`` (package data)."""
    return Path(__file__).resolve().parent / "tuned"


def _use_shipped(db_dir: str | Path | None, shipped: bool | None) -> bool:
    return db_dir is None if shipped is None else shipped


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
    d.pop("num-cores", None)  # schedules stay valid on any core count (module docstring)
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


def _target_arch(target: Any) -> str:
    triple = str(_target_dict(_as_target(target)).get("mtriple") or "")
    return _ARCH_ALIASES.get(triple.split("-")[0], triple.split("-")[0]) if triple else _host_arch()


def can_measure(target: Any) -> tuple[bool, str]:
    """Whether candidates for ``target`` can be timed on this machine, and why not."""
    d = _target_dict(_as_target(target))
    if d.get("kind") != "llvm":
        return False, f"target kind {d.get('kind')!r} is not a CPU target"
    arch = _target_arch(target)
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


def _make_builder(timeout: float, remote: Remote | None = None) -> Any:
    """A LocalBuilder whose workers skip the slow intrinsics import (see above); for a ``remote``
    board, candidates are linked into shared libraries with the board's (cross) linker, ready
    for the board's RPC server to ``dlopen``."""
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

    if remote is None:
        return LocalBuilder(f_build=build, timeout_sec=timeout)
    linker, options = remote.linker, list(remote.link_options)

    def export(mod: Any) -> str:
        import os
        import tempfile

        from tvm.support import cc

        path = os.path.join(tempfile.mkdtemp(prefix="fractal-ms-"), "candidate.so")
        if linker is None:
            mod.export_library(path)
        else:
            mod.export_library(path, fcompile=cc.cross_compiler(linker, options=list(options)))
        return path

    return LocalBuilder(f_build=build, f_export=export, timeout_sec=timeout)


def _make_runner(remote: Remote | None) -> Any:
    """Time candidates here (LocalRunner) or on ``remote`` through its TVM RPC server."""
    from tvm.s_tir import meta_schedule as ms

    evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False)
    if remote is None:
        return ms.runner.LocalRunner(timeout_sec=_RUN_TIMEOUT, evaluator_config=evaluator)
    host, port, timeout = remote.host, remote.port, remote.timeout

    def create_session(_config: Any) -> Any:
        # a direct connection (MetaSchedule's default asks an RPC tracker for a device)
        from tvm import rpc

        return rpc.connect(host, port, session_timeout=timeout)

    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key="direct",
                                 session_timeout_sec=int(timeout))
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator, f_create_session=create_session,
                               max_workers=1)


def check_remote(remote: Remote) -> None:
    """Connect once to ``remote`` and fail fast with a clear error when it does not answer."""
    from tvm import rpc

    try:
        sess = rpc.connect(remote.host, remote.port, session_timeout=60)
        sess.cpu(0)
    except Exception as exc:  # noqa: BLE001 - any failure to reach the board is the same user error
        detail = " ".join(str(exc).split())[:160]
        raise TargetError(f"cannot reach the TVM RPC server at {remote.host}:{remote.port} ({detail})",
                          hint="start it on the board: `fractal rpc-server --host 0.0.0.0 --port PORT` "
                               "(or python3 -m compiler.rpc_server) and check the address") from None


def prepare(mod: Any, target: Any, *, prepack: bool = False, channels_last: bool = True,
            fold_in_numpy: bool = False) -> Any:
    """Lower a Relax module to fused TIR: the form MetaSchedule extracts tasks from and applies
    records to (same passes as ``relax.pipeline.static_shape_tuning_pipeline``). ``prepack``:
    BatchNorm folded into the convolutions and the weights marked layout-free, so tuned schedules
    may read them in a rewritten layout (:mod:`compiler.prepack`; another workload, hence
    another database). On x86_64 targets the convolutions are converted to channels-last first
    (:mod:`compiler.layout`), for untuned and tuned inference builds alike; ``channels_last=False``
    keeps the layout (the training module: its backward convolutions are unmeasured there).
    ``fold_in_numpy``: constant operators folded by :func:`compiler.constfold.fold_numpy` before
    FoldConstant (same kernels and values, much faster on CNNs whose weights are constants; the
    kernels' names differ, hence the module's workload hash: untuned builds only, so tuned builds
    keep the databases they were tuned and shipped with)."""
    from tvm import relax, transform

    from compiler import layout
    from compiler import prepack as _prepack
    from compiler.constfold import fold_numpy

    target = _as_target(target)
    if prepack:
        mod = _prepack.fold_batchnorm(mod)
    if channels_last and layout.wants_channels_last(target):
        mod = layout.channels_last(mod)
    # the weight transposes of the layout conversion and the decomposed BatchNorms' statistics
    # folded in numpy (FoldConstant, in the zero pipeline, builds each with LLVM: most of this
    # function's time on CNNs whose weights are constants)
    fold = [transform.module_pass(lambda m, _ctx: fold_numpy(m), opt_level=0, name="FoldNumpy")]
    with target:
        return transform.Sequential([
            relax.transform.DecomposeOpsForInference(),
            relax.transform.CanonicalizeBindings(),
            *(fold if fold_in_numpy else []),
            relax.pipeline.zero_pipeline(),
            *([_prepack.before_tuning()] if prepack else []),
        ])(mod)


def _prescheduled(task: Any) -> bool:
    """Whether an extracted MetaSchedule task's function was scheduled before tuning."""
    from tvm import tirx

    return any(isinstance(f, tirx.PrimFunc) and f.attrs is not None
               and bool(f.attrs.get("tirx.is_scheduled", 0))
               for mod in task.dispatched for f in mod.functions.values())


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


class _TimeUp(Exception):
    """Raised by the progress callback to stop MetaSchedule once the time budget is spent."""


@dataclass
class _Progress:
    """What the measure callback saw: trials per task, best time per task, whether time ran out."""

    names: list[str]
    trials: list[int]
    best_us: list[float]
    total: int = 0
    timed_out: bool = False


def _progress_callback(names: list[str], total: int | None, deadline: float | None,
                       progress: bool) -> tuple[Any, Any, _Progress]:
    """A MeasureCallback counting measured candidates per task, printing one line per measured
    round on stderr (task, its trials, its best time) under a rich bar, and raising
    :class:`_TimeUp` after the first round that ends past ``deadline`` (time.monotonic())."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    state = _Progress(list(names), [0] * len(names), [float("inf")] * len(names))
    t0 = time.monotonic()
    bar: Any = None
    bar_id: Any = None
    console: Any = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        columns = [TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TextColumn("trials"),
                   TimeElapsedColumn(), TextColumn("{task.description}")]
        bar = Progress(*columns, console=console, transient=False)
        bar_id = bar.add_task("", total=total)

    @derived_object
    class _Count(PyMeasureCallback):
        def apply(self, task_scheduler, task_id_, measure_candidates, builder_results, runner_results):
            i = int(task_id_)
            n = len(runner_results)
            state.total += n
            state.trials[i] += n
            for r in runner_results:
                if r.error_msg is None and r.run_secs:
                    secs = [float(x.value if hasattr(x, "value") else x) for x in r.run_secs]
                    state.best_us[i] = min(state.best_us[i], 1e6 * sum(secs) / len(secs))
            if bar is not None:
                best = f"{state.best_us[i]:.1f} us" if state.best_us[i] < float("inf") else "no valid run"
                name = state.names[i] if i < len(state.names) else f"task {i}"
                bar.console.print(f"tuning: task {i + 1}/{len(state.names)} {name}: {state.trials[i]} "
                                  f"trials, best {best} ({state.total} in {time.monotonic() - t0:.0f}s)",
                                  highlight=False)
                bar.update(bar_id, completed=state.total if total is None else min(state.total, total),
                           description=name[:40])
            if deadline is not None and time.monotonic() >= deadline:
                state.timed_out = True
                raise _TimeUp()

    return _Count(), bar, state


# Without a trial budget (--time-budget alone) MetaSchedule gets this ceiling and small rounds,
# so the budget is checked often.
_UNLIMITED = 1_000_000
_TIMED_PER_ITER = 8


def _plan(todo: int | None, n: int) -> tuple[int, int, int | None]:
    """(max_trials_global, num_trials_per_iter, max_trials_per_task) for ``todo`` trials on ``n`` tasks.

    Every task's share is capped at ceil(todo / n): MetaSchedule's gradient scheduler otherwise
    spends a small budget on the first tasks it likes and leaves others with the naive schedule.
    Several rounds per task when the budget allows: the first round samples blindly (the cost
    model has no data yet), later ones are guided by the model trained on the measurements.
    """
    if todo is None:
        return _UNLIMITED, _TIMED_PER_ITER, None
    share = -(-todo // n)
    per_iter = max(todo // (_ROUNDS * n), min(_MIN_PER_ITER, max(1, todo // n)))
    return todo, min(_MAX_PER_ITER, per_iter, share), share


def _reusable(meta: dict[str, Any] | None, trials: int | None, time_budget: float | None) -> bool:
    """Whether a database already holds the requested budget: as many trials, or (time budget
    alone) as many seconds of tuning."""
    if meta is None:
        return False
    if trials is not None:
        return int(meta.get("trials", 0)) >= trials
    return float(meta.get("seconds", 0.0)) >= float(time_budget or 0.0)


def tune(mod: Any, target: Any, *, trials: int | None = 64, db_dir: str | Path | None = None,
         progress: bool = True, seed: int = 0, prepack: bool = False, time_budget: float | None = None,
         remote: Remote | None = None, shipped: bool | None = None, channels_last: bool = True) -> TuneResult:
    """Tune ``mod`` (a Relax IRModule, params as inputs) for ``target`` and store the records in
    its database (keyed by target and workload); reuse the database when it already holds the
    budget.

    Budget: ``trials`` measured candidates in total, each task getting an equal share; or
    ``time_budget`` seconds (``trials=None``), stopping after the first measured round past it;
    with both, whichever ends first. ``remote``: time the candidates on a board through its RPC
    server instead of on this machine (then any target of the board's architecture can be tuned).
    ``shipped`` (default: only without ``db_dir``): a shipped database (:func:`shipped_db_dir`)
    holding the budget is used as it is (``source="shipped"``, no trials) when the user
    database does not hold it.
    """
    import tvm
    from tvm.s_tir import meta_schedule as ms

    if trials is None and time_budget is None:
        raise CompilerError("tuning needs a budget", hint="pass --trials N or --time-budget SECONDS")
    if trials is not None and trials < 1:
        raise CompilerError(f"--trials must be >= 1, got {trials}", hint="e.g. --trials 64")
    if time_budget is not None and not time_budget > 0:
        raise CompilerError(f"--time-budget must be > 0 seconds, got {time_budget}",
                            hint="e.g. --time-budget 600")
    target = _as_target(target)
    t0 = time.perf_counter()
    prepared = prepare(mod, target, prepack=prepack, channels_last=channels_last)
    path = _db_path(prepared, target, db_dir)
    db_id = f"{path.parent.name}/{path.name}"
    meta = _read_meta(path)
    ok, why = (True, "") if remote is not None else can_measure(target)
    # a database tuned on the board (fractal tune --rpc) is applied as it is when this machine
    # cannot measure for more
    if _reusable(meta, trials, time_budget) or (meta is not None and not ok):
        assert meta is not None
        if progress:
            print(f"tuning: reusing database {db_id} ({meta.get('trials')} trials recorded, none run)",
                  file=sys.stderr, flush=True)
        return TuneResult(db_id, True, 0, time.perf_counter() - t0, meta.get("tasks", 0), str(path))
    if _use_shipped(db_dir, shipped):
        spath = _db_path(prepared, target, shipped_db_dir())
        smeta = _read_meta(spath)
        if _reusable(smeta, trials, time_budget) or (smeta is not None and meta is None and not ok):
            assert smeta is not None
            if progress:
                print(f"tuning: using the shipped database {db_id} ({smeta.get('trials')} trials "
                      f"recorded on {smeta.get('cpu', 'the project machine')}, none run)",
                      file=sys.stderr, flush=True)
            return TuneResult(db_id, True, 0, time.perf_counter() - t0, smeta.get("tasks", 0), str(spath),
                              source="shipped")
    if not ok:
        raise TargetError(f"cannot tune for this target here: {why}",
                          hint="tune on the board: run `fractal rpc-server` there and pass --rpc "
                               "HOST:PORT (MetaSchedule must time candidates on the target itself), or "
                               "pass --db with a database tuned on the board")
    if remote is not None:
        check_remote(remote)

    done = int((meta or {}).get("trials", 0))
    todo = None if trials is None else trials - done  # a database with fewer trials is extended
    # (kernels scheduled when they were built, e.g. compiler.int8_x86's tensorized ones, are not tasks)
    tasks = [t for t in ms.relax_integration.extract_tasks(prepared, target) if not _prescheduled(t)]
    anchors = [t for t in tasks if any(op in t.task_name for op in _ANCHOR_OPS)] or list(tasks)
    if not anchors:
        raise CompilerError("nothing to tune: the model has no TIR tasks", hint="compile without --tune")
    path.mkdir(parents=True, exist_ok=True)
    _cpu_intrinsics_only(_target_arch(target))
    max_global, per_iter, per_task = _plan(todo, len(anchors))
    # a small budget gets a small population: sampling and evolving 512 candidates per task
    # costs more than measuring a handful of them on 2 cores
    strategy = ms.search_strategy.EvolutionarySearch(
        population_size=min(512, max(_MIN_POPULATION, 16 * per_iter)))
    deadline = None if time_budget is None else time.monotonic() + float(time_budget)
    callback, bar, state = _progress_callback([t.task_name for t in anchors], todo, deadline, progress)
    callbacks = [*ms.measure_callback.MeasureCallback.create("default"), callback]
    # generous timeouts: the machine is shared and a loaded core makes builds slow
    builder = _make_builder(timeout=_BUILD_TIMEOUT, remote=remote)
    runner = _make_runner(remote)
    mslog = logging.getLogger("tvm.s_tir.meta_schedule")
    old_level = mslog.level
    mslog.setLevel(logging.WARNING)  # the per-iteration tables go to db/logs, not the terminal
    # MetaSchedule's logger setup lists the logger's handlers by name and crashes on an unnamed
    # one (e.g. pytest's LogCaptureHandler lands there after a first tuning run in a process):
    # detach those for the run.
    unnamed = [h for h in mslog.handlers if h.get_name() is None]
    for h in unnamed:
        mslog.removeHandler(h)
    if progress:
        budget = " and ".join(([f"{todo} trials ({per_task} per task)"] if todo is not None else [])
                              + ([f"{time_budget:g} s"] if time_budget is not None else []))
        where = f" on {remote.host}:{remote.port}" if remote is not None else ""
        print(f"tuning: {len(anchors)} tasks, budget {budget}{where}", file=sys.stderr, flush=True)
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
                max_trials_global=max_global, max_trials_per_task=per_task, num_trials_per_iter=per_iter,
                builder=builder, runner=runner, measure_callbacks=callbacks,
                database=ms.database.JSONDatabase(work_dir=str(path)),
            )
    except Exception as exc:  # (TVM errors are RuntimeError subclasses; tvm.error.TVMError is gone)
        if not state.timed_out:  # the time budget stops MetaSchedule by raising from the callback
            if not isinstance(exc, RuntimeError):
                raise
            raise CompilerError(f"MetaSchedule tuning failed: {' '.join(str(exc).split())[:300]}",
                                hint=f"see the logs in {path / 'logs'}; retry without --tune") from None
    finally:
        mslog.setLevel(old_level)
        for h in unnamed:
            mslog.addHandler(h)
    seconds = time.perf_counter() - t0
    if progress and state.timed_out:
        print(f"tuning: time budget of {time_budget:g} s spent after {state.total} trials",
              file=sys.stderr, flush=True)
    # the trial count a later run compares against: the budget asked for, or (stopped by the
    # clock, or a time budget alone) the trials really measured
    reached = done + (todo if todo is not None and not state.timed_out else state.total)
    meta = {"format": FORMAT, "target": _target_dict(target), "trials": reached,
            "trials_run": state.total + int((meta or {}).get("trials_run", 0)), "tasks": len(anchors),
            "per_task": {n: c for n, c in zip(state.names, state.trials, strict=True)},
            "seconds": round(seconds + float((meta or {}).get("seconds", 0.0)), 3),
            "measured_on": f"rpc://{remote.host}:{remote.port}" if remote is not None else "local",
            "tvm": tvm.__version__, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (path / "tune.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return TuneResult(db_id, False, state.total, seconds, len(anchors), str(path))


def apply(mod: Any, target: Any, db_dir: str | Path | None = None, *, prepack: bool = False,
          shipped: bool | None = None, prefer: str = "user") -> Any:
    """:func:`apply_counted` without the count."""
    return apply_counted(mod, target, db_dir, prepack=prepack, shipped=shipped, prefer=prefer)[0]


def apply_counted(mod: Any, target: Any, db_dir: str | Path | None = None, *, prepack: bool = False,
                  shipped: bool | None = None, prefer: str = "user") -> tuple[Any, int]:
    """``mod`` lowered to fused TIR with the best tuned schedules of its database(s) applied.

    The result goes straight to ``relax.build(result, target)``; functions without a record keep
    TVM's naive lowering (the compiler builds with :func:`compiler.schedules.apply_tuned`, which
    gives those the default schedules and races the records against them). ``prepack`` (the
    database must be tuned with it): the weight layout rewrites the schedules need are lifted
    into ``main_transform_params`` (see :mod:`compiler.prepack`). ``shipped`` (default: only
    without ``db_dir``): the shipped database of the model joins the user one; ``prefer``
    ("user" or "shipped", what :func:`tune` returned as ``source``) is read first, the other
    fills the tasks it lacks. Returns the module and how many of its functions got a tuned
    schedule from a record. Raises CompilerError if neither database exists."""
    import tvm

    from compiler import prepack as _prepack

    _, tuned, applied = apply_records(mod, target, db_dir, prepack=prepack, shipped=shipped, prefer=prefer)
    with _as_target(target), tvm.transform.PassContext(opt_level=3):
        return (_prepack.after_tuning()(tuned) if prepack else tuned), applied


def apply_records(mod: Any, target: Any, db_dir: str | Path | None = None, *, prepack: bool = False,
                  shipped: bool | None = None, prefer: str = "user",
                  channels_last: bool = True) -> tuple[Any, Any, int]:
    """(prepared module, the same with the database records applied, how many functions got one):
    what :func:`apply_counted` builds on, before default schedules and the layout-rewrite split.
    Raises CompilerError if no database exists."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    target = _as_target(target)
    prepared = prepare(mod, target, prepack=prepack, channels_last=channels_last)
    paths = {"user": _db_path(prepared, target, db_dir)}
    if _use_shipped(db_dir, shipped):
        paths["shipped"] = _db_path(prepared, target, shipped_db_dir())
    order = sorted(paths, key=lambda k: k != prefer)
    found = [paths[k] for k in order if (paths[k] / "database_tuning_record.json").is_file()]
    if not found:
        raise CompilerError(f"no tuning database for this model and target in {paths['user'].parent.parent}",
                            hint="tune first (fractal compile --tune) or point --db at the right directory")
    dbs = [ms.database.JSONDatabase(work_dir=str(p), allow_missing=False) for p in found]
    database = dbs[0] if len(dbs) == 1 else ms.database.OrderedUnionDatabase(*dbs)
    with target, database, tvm.transform.PassContext(opt_level=3):
        tuned = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(prepared.clone())
    return prepared, tuned, scheduled_count(tuned)


def scheduled_count(mod: Any) -> int:
    """How many TIR functions of ``mod`` carry a schedule (``tirx.is_scheduled``): after
    :func:`apply`, the kernels a database record was applied to."""
    import tvm

    return sum(1 for f in mod.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
               and bool(f.attrs.get("tirx.is_scheduled", 0)))


def _best_per_workload(lines: list[str]) -> dict[int, tuple[float, str]]:
    best: dict[int, tuple[float, str]] = {}
    for line in lines:
        if not line.strip():
            continue
        idx, rec = json.loads(line)
        secs = [float(x) for x in (rec[1] or [])]
        if not secs or any(x >= 1e9 for x in secs):  # no valid run (MetaSchedule stores 1e10 on error)
            continue
        mean = sum(secs) / len(secs)
        if idx not in best or mean < best[idx][0]:
            best[idx] = (mean, json.dumps(rec, separators=(",", ":")))
    return best


def export_database(src: str | Path, dst_root: str | Path, **extra: Any) -> Path:
    """Copy the database directory ``src`` (``<target key>/<workload hash>``) into ``dst_root``
    (e.g. :func:`shipped_db_dir`) pruned to the best valid record per task, under the target
    key of its ``tune.json`` (so older keys are re-keyed); ``extra`` goes into the copied
    ``tune.json`` (model, preset, cpu). Returns the new directory."""
    src = Path(src)
    meta = _read_meta(src)
    if meta is None:
        raise CompilerError(f"{src} is not a tuning database (no tune.json)",
                            hint="pass a <target key>/<workload hash> directory")
    workloads = (src / "database_workload.json").read_text().splitlines()
    best = _best_per_workload((src / "database_tuning_record.json").read_text().splitlines())
    dst = Path(dst_root) / _target_key(meta["target"]) / src.name
    dst.mkdir(parents=True, exist_ok=True)
    keep = sorted(best)
    (dst / "database_workload.json").write_text("".join(f"{workloads[i]}\n" for i in keep))
    (dst / "database_tuning_record.json").write_text(
        "".join(f"[{n},{best[i][1]}]\n" for n, i in enumerate(keep)))
    meta = {**meta, **extra, "records": len(keep),
            "best_us": [round(1e6 * best[i][0], 2) for i in keep]}
    meta.pop("per_task", None)
    (dst / "tune.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return dst


def truncate_database(src: str | Path, dst: str | Path, records: int) -> Path:
    """A copy of the database ``src`` holding only its first ``records`` tuning records (they
    are appended in the order they were measured: the database a ``records``-trial run would
    have left, up to the budget split). For the trials-vs-latency curve."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "database_workload.json").write_text((src / "database_workload.json").read_text())
    lines = (src / "database_tuning_record.json").read_text().splitlines(keepends=True)
    (dst / "database_tuning_record.json").write_text("".join(lines[:records]))
    meta = _read_meta(src) or {"format": FORMAT}
    (dst / "tune.json").write_text(json.dumps({**meta, "trials": min(records, len(lines))}, indent=1))
    return dst


def export_zoo_databases(src_root: str | Path, dst_root: str | Path | None = None,
                         presets: tuple[str, ...] = ("x86_64", "x86_64-avx2", "x86_64-avx512"),
                         min_trials: int = 64, models: tuple[str, ...] | None = None) -> list[Path]:
    """Export (:func:`export_database`) every database in ``src_root`` that belongs to a zoo
    model (pre-packed, batch 1) on one of ``presets`` into ``dst_root`` (default: the shipped
    databases), naming the model, the preset and this CPU in ``tune.json``. How the shipped
    databases are made: ``fractal tune`` each zoo model ``--db SRC``, then this. Databases
    with fewer than ``min_trials`` (the default ``--trials`` of ``fractal compile --tune``,
    which must find them sufficient) are left out; ``models``: only these zoo models. Ship a
    database only when its build beats the untuned one (``fractal bench compile --db``)."""
    from compiler import zoo
    from compiler.importer import import_model
    from compiler.targets import cpu_model, get_preset

    out = []
    for name in models or zoo.NAMES:
        mod = import_model(zoo.build(name)).mod
        for preset in presets:
            target = get_preset(preset).tvm_target()
            prepared = prepare(mod, target, prepack=True)
            wl = _workload_hash(prepared)
            # any target key of the same target minus num-cores (older keys included it)
            for src in sorted(Path(src_root).glob(f"*/{wl}")):
                meta = _read_meta(src)
                if (meta is None or _target_key(meta["target"]) != _target_key(target)
                        or int(meta.get("trials", 0)) < min_trials):
                    continue
                out.append(export_database(src, dst_root if dst_root is not None else shipped_db_dir(),
                                           model=name, preset=preset, cpu=cpu_model()))
    return out
