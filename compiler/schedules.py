"""Default CPU schedules for untuned builds: no measurement, a few milliseconds per function.

TVM's default CPU pipeline lowers every operator to a naive loop nest: a convolution runs its
reduction loops innermost (kernel width, extent 1-3), so LLVM can neither vectorise nor keep
anything in registers, and untuned builds ran 9-54x slower than onnxruntime. :func:`apply`
gives each fused function a reasonable schedule before ``relax.build``:

- x86_64 targets first convert every conv2d to channels-last (NHWC activations, HWIO weights,
  :mod:`compiler.layout`; the weight transposes depend on parameters only, so pre-packing moves
  them out of inference) and :class:`ChannelsLast` register-tiles those convolutions with the
  output channels vectorised (what onnxruntime's blocked NCHWc kernels get from their layout:
  pointwise convolutions become GEMMs, depthwise ones read channel vectors, narrow rows do not
  matter any more);
- the dlight CPU rules where they apply (matrix-vector products, row reductions);
- :class:`SpatialReduction`, the project's rule for any function with one reduction block
  ``S+R+`` (convolutions, depthwise convolutions, pooling, batched matmul): reduction loops
  moved outside the two innermost spatial loops (so the innermost loop walks contiguous
  outputs and inputs and LLVM vectorises it), reduction init split off, outer spatial loops
  fused and run in parallel, the elementwise epilogue (BatchNorm, bias, ReLU, ...) computed
  per outer iteration while its data is in cache;
- :class:`Elementwise`: injective functions get their loops fused, parallel and vectorised.

Functions no rule fits keep the default (naive) schedule. Tuning (``compiler.tuning``) replaces
all of this with measured schedules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compiler.schedule_cache import Decisions

__all__ = ["TunedBuild", "apply", "apply_tuned", "schedule_prepared"]

_MIN_ROW = 8  # register tiling wants at least this many output columns per row
_MAX_COLS = 8  # channels-last register tile: at most this many output columns (x 1 vector)
_TILES = ((1, _MAX_COLS), (2, 6))  # channels-last tiles tried when measuring: (vectors, columns)
_MIN_PARALLEL = 4  # do not parallelise tiny outer loops (thread-pool launch costs ~1-2 us)
# elementwise functions: parallel from this many elements (a copy or cast of fewer takes a few us
# on one thread, about a thread-pool launch on a loaded 2-core machine: int8 glue between kernels)
_MIN_PARALLEL_ELEMENTS = 1 << 16
_QUICK_US = 1000.0  # untuned builds time calls longer than this twice, not 16 times (_time_all)


def _extent(sch: Any, loop: Any) -> int | None:
    try:
        return int(sch.get(loop).extent)
    except (TypeError, ValueError):
        return None


def _vector_lanes(target: Any, bits: int = 32) -> int:
    try:
        from tvm.target.codegen import llvm_get_vector_width

        width = int(llvm_get_vector_width(target))
    except Exception:  # pragma: no cover - a target LLVM does not know
        width = 128
    return max(2, (width if width > 0 else 128) // bits)


def _vectorize_inner(sch: Any, block: Any, lanes: int) -> None:
    """Vectorise the innermost loop of ``block`` by ``lanes`` when its extent divides evenly."""
    loops = sch.get_loops(block)
    if not loops:
        return
    ext = _extent(sch, loops[-1])
    if ext is None or ext < 2:
        return
    if ext <= lanes:
        sch.vectorize(loops[-1])
    elif ext % lanes == 0:
        _, inner = sch.split(loops[-1], factors=[None, lanes])
        sch.vectorize(inner)


def _rules(fuse: bool | None, min_row: int = _MIN_ROW, tile: tuple[int, int] | None = None) -> list[Any]:
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

    def _one_reduction(rule: Any, func: Any, target: Any,
                       pattern: str) -> tuple[Any, list[Any], int, Any, str] | None:
        """The function's single reduction block whose loop kinds match ``pattern`` (normalised:
        unit loops, e.g. a batch of 1, dropped), with the schedule and every block; else None."""
        if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        reds = [i for i, b in enumerate(infos or []) if not b.is_injective()]
        if len(reds) != 1:
            return None
        kind = infos[reds[0]].dom_kind()
        if not re.fullmatch(pattern, kind):
            return None
        return sch, infos, reds[0], infos[reds[0]], kind

    class SpatialReduction(CPUScheduleRule):
        """One reduction block ``S+R+`` (plus injective prologue/epilogue blocks). ``fuse``: fuse
        the two innermost spatial loops into one (good for 1x1 kernels, whose index arithmetic
        folds), else vectorise the innermost one (good for k x k kernels on wide rows)."""

        def __init__(self, fuse: bool) -> None:
            self.fuse = fuse

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            one = _one_reduction(self, func, target, "S+R+")
            if one is None:
                return None
            sch, infos, r, red, kind = one
            ns = kind.count("S")
            # The epilogue chain (injective blocks after the reduction): inline all but the last.
            for b in infos[r + 1:-1]:
                try:
                    sch.compute_inline(b.block_rv)
                except Exception:
                    return None
            last = infos[-1].block_rv if r < len(infos) - 1 else None
            loops = sch.get_loops(red.block_rv)
            spatial, reduce = loops[:ns], loops[ns:]
            keep = max(1, min(2, ns - 1))  # innermost spatial loops below the reduction
            outer, inner = spatial[:ns - keep], spatial[ns - keep:]
            sch.reorder(*outer, *reduce, *inner)
            par = (sch.fuse(*outer) if len(outer) > 1 else outer[0]) if outer else None
            ext = _extent(sch, par) if par is not None else None
            if ext is not None and ext >= _MIN_PARALLEL:
                sch.parallel(par)
            if last is not None and par is not None:
                sch.reverse_compute_at(last, par, preserve_unit_loops=True)
                ep = sch.get_loops(last)[1:]
                if len(ep) > 1:
                    sch.fuse(*ep)
                _vectorize_inner(sch, last, _vector_lanes(target))
            init = sch.decompose_reduction(red.block_rv, reduce[0])
            # one long innermost loop for LLVM's vectoriser (row-major inner dims: contiguous
            # for unit strides, index arithmetic folds when the kernel is 1x1)
            for block in (red.block_rv, init):
                tail = sch.get_loops(block)[-len(inner):]
                if self.fuse and len(tail) > 1:
                    sch.fuse(*tail)
                elif block != red.block_rv:  # (TVM refuses to vectorise a decomposed update;
                    _vectorize_inner(sch, block, _vector_lanes(target))  # LLVM does it there)
            return sch

    class RegisterTiled(CPUScheduleRule):
        """A 3- or 4-d ``[N]CHW x R+`` reduction (NCHW convolution, depthwise convolution, pooling):
        accumulators for ``cb`` channels x ``wb`` output columns kept in registers (a local
        cache, fully unrolled and vectorised) while the reduction loops run, the classic
        direct-convolution schedule. Channel and column blocks are divisors of the extents."""

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            one = _one_reduction(self, func, target, "S{3,4}R+")
            if one is None:
                return None
            sch, infos, r, red, kind = one
            ns = kind.count("S")
            for b in infos[r + 1:-1]:
                sch.compute_inline(b.block_rv)
            last = infos[-1].block_rv if r < len(infos) - 1 else None
            loops = sch.get_loops(red.block_rv)
            outer, (c, h, w), reduce = loops[:ns - 3], loops[ns - 3:ns], loops[ns:]
            lanes = _vector_lanes(target)
            ce, we = _extent(sch, c), _extent(sch, w)
            if ce is None or we is None or we < min_row:
                return None  # narrow rows: the spatial-reduction variants do better
            wb = max(d for d in range(1, min(we, lanes) + 1) if we % d == 0)
            cb = max(d for d in (1, 2, 4, 8) if ce % d == 0)
            co, ci = sch.split(c, factors=[None, cb])
            wo, wi = sch.split(w, factors=[None, wb])
            sch.reorder(*outer, co, h, wo, *reduce, ci, wi)
            par = sch.fuse(*outer, co) if outer else co
            ext = _extent(sch, par)
            if ext is not None and ext >= _MIN_PARALLEL:
                sch.parallel(par)
            acc = sch.cache_write(red.block_rv, 0, "local")
            sch.reverse_compute_at(acc, wo, preserve_unit_loops=True)
            if last is not None:
                sch.reverse_compute_at(last, par, preserve_unit_loops=True)
                ep = sch.get_loops(last)[1:]
                if len(ep) > 1:
                    sch.fuse(*ep)
                _vectorize_inner(sch, last, lanes)
            init = sch.decompose_reduction(red.block_rv, reduce[0])
            for block in (red.block_rv, init, acc):
                lp = sch.get_loops(block)
                if wb > 1:
                    # (TVM refuses to vectorise inside the update of a decomposed reduction:
                    # there the loop is unrolled and LLVM's SLP vectoriser packs it)
                    (sch.unroll if block == red.block_rv else sch.vectorize)(lp[-1])
                if cb > 1:
                    sch.unroll(lp[-2])
            return sch

    class ChannelsLast(CPUScheduleRule):
        """A channels-last convolution (``conv2d_nhwc``, ``group_conv2d_nhwc``: spatial loops
        ``[N] H W C``, reduction over the kernel window and input channels; weights ``HWIO``, so
        output channels are contiguous in the weights too): accumulators for ``wb`` output
        columns x one vector of output channels kept in registers while the reduction runs,
        the epilogue (bias, ReLU) applied on them before the store. A pointwise convolution is
        then a GEMM with the output channels vectorised (input pixel broadcast x weight vector),
        a depthwise one reads input and weights as channel vectors: no narrow-row problem.
        ``tile``: (channel vectors, at most this many columns); default 2 x 6 where there are 32
        vector registers (AVX-512), else 1 x 8; measured builds try both (:func:`apply`)."""

        def __init__(self, tile: tuple[int, int] | None = None) -> None:
            self.tile = tile

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            one = _one_reduction(self, func, target, "S{3,4}R+")
            if one is None:
                return None
            sch, infos, r, red, kind = one
            if "nhwc" not in sch.get(red.block_rv).name_hint:
                return None
            ns = kind.count("S")
            for b in infos[:r]:  # the padding prologue: computed per output row (below)
                if not b.is_injective():
                    return None
            for b in infos[r + 1:-1]:
                sch.compute_inline(b.block_rv)
            last = infos[-1].block_rv if r < len(infos) - 1 else None
            loops = sch.get_loops(red.block_rv)
            outer, (h, w, c), reduce = loops[:ns - 3], loops[ns - 3:ns], loops[ns:]
            lanes = _vector_lanes(target)
            ce, we = _extent(sch, c), _extent(sch, w)
            if ce is None or we is None:
                return None
            vecs, cols = self.tile or ((2, 6) if lanes >= 16 else (1, _MAX_COLS))
            cb = next((lanes * v for v in range(vecs, 0, -1) if ce % (lanes * v) == 0),
                      ce if ce < lanes else 0)
            if cb < 2:
                return None
            wb = max(d for d in range(1, min(we, cols) + 1) if we % d == 0)
            co, ci = sch.split(c, factors=[None, cb])
            wo, wi = sch.split(w, factors=[None, wb])
            sch.reorder(*outer, h, co, wo, *reduce, wi, ci)
            par = sch.fuse(*outer, h) if outer else h
            ext = _extent(sch, par)
            if ext is not None and ext >= _MIN_PARALLEL:
                sch.parallel(par)
            for b in infos[:r]:
                sch.compute_at(b.block_rv, par, preserve_unit_loops=True)
                _vectorize_inner(sch, b.block_rv, lanes)
            acc = sch.cache_write(red.block_rv, 0, "local")
            sch.reverse_compute_at(acc, wo, preserve_unit_loops=True)
            if last is not None:
                sch.reverse_compute_inline(last)
            init = sch.decompose_reduction(red.block_rv, reduce[0])
            for block in (init, acc):
                lp = sch.get_loops(block)
                sch.vectorize(lp[-1])
                if wb > 1:
                    sch.unroll(lp[-2])
            lp = sch.get_loops(red.block_rv)
            # (TVM refuses to vectorise inside the update of a decomposed reduction: unrolled,
            # LLVM's SLP vectoriser packs the channel lanes)
            sch.unroll(lp[-1])
            if wb > 1:
                sch.unroll(lp[-2])
            return sch

    class Elementwise(CPUScheduleRule):
        """Functions made only of injective blocks: fused, parallel, vectorised."""

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
                return None
            sch = s_tir.Schedule(func)
            infos = normalize_prim_func(sch)
            if not infos or not all(b.is_injective() for b in infos):
                return None
            for b in infos[:-1]:
                try:
                    sch.compute_inline(b.block_rv)
                except Exception:
                    return None
            block = infos[-1].block_rv
            loops = sch.get_loops(block)
            if not loops:
                return None
            fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            ext = _extent(sch, fused)
            if ext is None or ext < 2:
                return None
            lanes = _vector_lanes(target)
            if ext % lanes == 0 and ext > lanes:
                o, i = sch.split(fused, factors=[None, lanes])
                if ext >= _MIN_PARALLEL_ELEMENTS:
                    sch.parallel(o)
                sch.vectorize(i)
            return sch

    class Safe(CPUScheduleRule):
        """A rule whose schedule errors mean "does not apply" (the function keeps its default)."""

        def __init__(self, rule: Any) -> None:
            self.rule = rule

        def apply(self, func: Any, target: Any, tunable: bool) -> Any:
            try:
                return self.rule.apply(func, target, tunable)
            except Exception:  # a schedule primitive refused this function
                return None

    from tvm.s_tir import dlight as dl

    # fuse=None: register tiling where it applies, else the fused spatial reduction (unmeasured
    # default, e.g. for boards); True/False: only that spatial-reduction variant
    spatial = [RegisterTiled(), SpatialReduction(True)] if fuse is None else [SpatialReduction(fuse)]
    rules = [ChannelsLast(tile), dl.cpu.GEMV(), *spatial, dl.cpu.Reduction(), Elementwise()]
    return [Safe(r) for r in rules]


# an integer division or remainder whose divisor is read from a buffer (TVMScript prints integer
# Div/truncmod as calls, floor division as // and %; index arithmetic divides by constants)
_DATA_DIVISOR = re.compile(r"T\.(Div|truncdiv|truncmod)\(|(//|%)\s*\(*\s*(T\.Cast\([^,]*,\s*)?[A-Za-z_]\w*\[")


def _divides_by_data(func: Any) -> bool:
    """Whether ``func`` divides by a value it reads: timed on zero-filled integer inputs it would
    raise SIGFPE, so such functions keep their rule schedule untimed."""
    return bool(_DATA_DIVISOR.search(func.script()))


def _random(rng: Any, shape: list[int], dtype: str) -> Any:
    """Standard-normal values for a float argument (drawn in float32 when that is its type: half
    the time of float64 and a cast), zeros for any other."""
    import numpy as np

    if dtype in ("float32", "float64"):
        return rng.standard_normal(shape, dtype=dtype)
    return rng.standard_normal(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype)


def _time_all(funcs: dict[str, Any], target: Any, *, quick: bool = False,
              inputs: dict[Any, list[Any]] | None = None) -> dict[str, float]:
    """Best-of-5 time (us) of each PrimFunc on random inputs, built as one library (one
    LLVM run) and run in this process. Functions that fail to build or run are left out.
    ``quick``: a function whose first two timed calls each take over ``_QUICK_US`` keeps the
    faster of those two (the 24 convolutions of ResNet-50 take 5-60 ms per call: 16 calls each
    were ~40 s of its untuned compile here; noise on such calls is a few percent, far below
    the differences between variants that matter). ``inputs``: the argument tensors made so far,
    by kernel name and argument types, reused and added to (the variants of one kernel share
    them: VGG-19's first dense layer reads 411 MB of weights, whose random values took seconds
    to draw for each variant)."""
    import numpy as np
    import tvm
    from tvm import IRModule
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    try:
        # a tuned kernel's weight layout rewrite runs once per parameter set: not timed
        mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
        lib = tvm.tirx.build(mod, target=target)
    except Exception:
        return {}
    rng = np.random.default_rng(0)
    out: dict[str, float] = {}
    for name in funcs:
        func = mod[name]
        if _divides_by_data(func):  # zeros would divide by zero (SIGFPE kills the compiler)
            continue
        try:
            infos = [([int(d) for d in info.shape], str(info.dtype)) for info in ArgInfo.from_prim_func(func)]
            key = (name, tuple((tuple(shape), dtype) for shape, dtype in infos))
            args = inputs.get(key) if inputs is not None else None
            if args is None:
                args = [tvm.runtime.tensor(_random(rng, shape, dtype)) for shape, dtype in infos]
                if inputs is not None:
                    inputs[key] = args
            if quick:  # (a warm-up call, then two timed ones)
                first = min(lib.time_evaluator(name, tvm.cpu(), number=1, repeat=2)(*args).results) * 1e6
                if first > _QUICK_US:
                    out[name] = float(first)
                    continue
            # best of 5 repeats: on a shared machine the minimum is the stable statistic
            timer = lib.time_evaluator(name, tvm.cpu(), number=3, repeat=5, min_repeat_ms=1)
            out[name] = float(min(timer(*args).results)) * 1e6
        except Exception:  # e.g. a symbolic shape: not timed, the rule's schedule is kept
            continue
    return out



def apply(mod: Any, target: Any, *, measure: bool | None = None, cache_dir: str | Path | None = None) -> Any:
    """``mod`` (a Relax module) lowered to fused TIR with default CPU schedules (see above).

    With ``measure`` (default: when this machine runs ``target``) each rule-scheduled function
    is timed once against its naive schedule in this process and the faster one is kept, so a
    rule never makes a function slower (a fraction of a second per function). The choices are
    cached per machine by workload (:mod:`compiler.schedule_cache`; ``cache_dir`` overrides its
    root, default :func:`compiler.schedule_cache.cache_root`), so a kernel is timed once per
    machine, target and compiler version. The result goes to ``relax.build``; any function a
    rule fails on keeps its naive schedule.
    """
    from compiler import int8_arm, int8_rvv
    from compiler.schedule_cache import Decisions, cache_root
    from compiler.tuning import _as_target, can_measure, prepare

    target = _as_target(target)
    if target.kind.name != "llvm":
        return mod
    # int8 convolutions input channels innermost where a dot product / RVV can use that
    mod = int8_rvv.prepare(int8_arm.prepare(mod, target), target)
    if measure is None:
        measure = can_measure(target)[0]
    decisions = Decisions(target, cache_root() if cache_dir is None else Path(cache_dir)) if measure else None
    scheduled = schedule_prepared(prepare(mod, target, fold_in_numpy=True), target, measure=measure,
                                  decisions=decisions)
    if decisions is not None:
        decisions.save()
    return int8_rvv.serial_vectors(scheduled, target)


def schedule_prepared(prepared: Any, target: Any, *, measure: bool | None = None,
                      decisions: Decisions | None = None) -> Any:
    """:func:`apply` on a module :func:`compiler.tuning.prepare` already lowered (``prepared``
    itself is not modified). ``decisions``: choices measured before, by workload
    (:mod:`compiler.schedule_cache`): kernels found there get their variant without any timing,
    identical kernels are timed once, calls over a millisecond are timed twice
    (``_time_all(quick=True)``), and the new choices are added (the caller saves them). Without
    it every kernel is timed in full."""
    import tvm
    from tvm import IRModule, tirx
    from tvm.s_tir import dlight as dl

    from compiler import int8_arm, int8_rvv
    from compiler.tuning import can_measure

    # int8 kernels for dot-product targets first (the functions they schedule are marked
    # scheduled, so every rule below and every timed variant leaves them as they are)
    prepared = int8_rvv.schedule(int8_arm.schedule(prepared, target), target)
    if measure is None:
        measure = can_measure(target)[0]
    if not measure or decisions is None:
        return _schedule_measured(prepared, target, measure, None)
    from compiler.schedule_cache import workload_key

    keys = {gv.name_hint: workload_key(f) for gv, f in prepared.functions.items()
            if isinstance(f, tirx.PrimFunc)}
    by_label = _variant_rules()
    known: dict[str, str] = {}
    for n, k in keys.items():
        label = decisions.get(k)
        if label is not None and label in by_label:
            known[n] = label
    decisions.hits += len(known)
    rest = IRModule({gv: f for gv, f in prepared.functions.items()
                     if gv.name_hint in keys and gv.name_hint not in known})
    # parameter-only kernels run once per parameter set (pre-packed), not per inference: the
    # rules' pick, untimed and not recorded (the same workload may be an inference kernel elsewhere)
    untimed = _parameter_only(prepared)
    out = prepared.clone()
    if len(rest.functions):
        done = _schedule_measured(rest, target, True, decisions, untimed)
        for gv in rest.functions:
            out[gv.name_hint] = done[gv.name_hint]
            if gv.name_hint not in untimed and decisions.get(keys[gv.name_hint]) is None:
                # neither timed nor timeable: the rules' pick
                decisions.put(keys[gv.name_hint], _DEFAULT, {}, timed=False)
    # the kernels measured before: only the rules of their variant applied
    for label in set(known.values()):
        part = IRModule({gv: f for gv, f in prepared.functions.items() if known.get(gv.name_hint) == label})
        rules = by_label[label]
        if rules:
            with target, tvm.transform.PassContext(opt_level=3):
                part = dl.ApplyDefaultSchedule(*rules)(part)
        for gv in part.functions:
            out[gv.name_hint] = part[gv.name_hint]
    return out


_BIG_REDUCTION = 16  # a single reduction at least this long: the naive lowering is not timed


def _all_injective(func: Any) -> bool:
    """Whether every block of ``func`` is injective (what :class:`Elementwise` schedules)."""
    from tvm import s_tir
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    try:
        infos = normalize_prim_func(s_tir.Schedule(func))
    except Exception:
        return False
    return bool(infos) and all(b.is_injective() for b in infos)


def _whole_vectors(func: Any, lanes: int) -> bool:
    """Whether every argument of ``func`` has a static innermost extent that is a multiple of
    ``lanes`` (channels-last activations with 16k channels, their per-channel parameters)."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    try:
        shapes = [[int(d) for d in info.shape] for info in ArgInfo.from_prim_func(func)]
    except (TypeError, ValueError):  # a symbolic dimension
        return False
    return bool(shapes) and all(shape and shape[-1] % lanes == 0 for shape in shapes)


def _one_big_reduction(func: Any) -> bool:
    """Whether ``func`` is one reduction block ``S+R+`` over at least ``_BIG_REDUCTION`` elements
    (plus elementwise blocks): a dense layer, a global or window pooling, a mean. The rules'
    schedules (GEMV, the spatial reductions) beat its naive lowering on every such kernel timed
    (the 9 `light` networks, 2026-11-28: 5-100x on the dense layers, whose naive lowering took up
    to 3.5 s a call, a third of VGG-19's untuned compile; 0.2 us slower on one 7x7 pooling), so
    only the rule variants are timed. Two reductions (softmax) are timed naive too: there the
    naive loop won by 1000x."""
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    try:
        infos = normalize_prim_func(s_tir.Schedule(func)) or []
    except Exception:
        return False
    reds = [b for b in infos if not b.is_injective()]
    if len(reds) != 1 or not re.fullmatch("S+R+", reds[0].dom_kind()):
        return False
    size = 1
    for it in reds[0].iters:
        if it.kind == "R":
            if not isinstance(it.dom, int):
                return False
            size *= it.dom
    return size >= _BIG_REDUCTION and isinstance(func, tirx.PrimFunc)


def _parameter_only(mod: Any) -> set[str]:
    """The kernels every call of which reads parameters and constants only (a Relax function's
    inputs past its ``num_input``, and what is computed from them alone): the weight layout
    transposes and the folded BatchNorm arithmetic, which pre-packing (:mod:`compiler.prepack`)
    moves out of inference into a function run once per parameter set."""
    from tvm import relax

    param_only: set[str] = set()
    data: set[str] = set()
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        n = func.attrs.get("num_input") if func.attrs is not None else None
        derived = {v for v in func.params[int(n):]} if n is not None else set()
        body = func.body
        blocks = body.blocks if isinstance(body, relax.SeqExpr) else []
        for block in blocks:
            for b in block.bindings:
                value = b.value
                const = all(v in derived for v in relax.analysis.free_vars(value))
                if const:
                    derived.add(b.var)
                for gv in relax.analysis.all_global_vars(value):
                    (param_only if const else data).add(gv.name_hint)
    return param_only - data


def _variant_rules() -> dict[str, list[Any]]:
    """The rules of each variant label :func:`_schedule_measured` chooses among (``naive``: none;
    ``default``: the unmeasured pick)."""
    return {"naive": [], "fused": _rules(fuse=True), "rows": _rules(fuse=False),
            "narrow": _rules(fuse=None, min_row=2), _DEFAULT: _rules(fuse=None),
            **{f"tile{v}x{c}": _rules(fuse=None, tile=(v, c))[:1] for v, c in _TILES}}


def _schedule_measured(prepared: Any, target: Any, measure: bool, decisions: Decisions | None,
                       untimed: set[str] | frozenset[str] = frozenset()) -> Any:
    """``prepared`` scheduled by the rules; with ``measure``, each kernel's variants timed and the
    fastest kept (see :func:`schedule_prepared`); the kernels in ``untimed`` keep the rules' pick."""
    import tvm
    from tvm import IRModule, tirx
    from tvm.s_tir import dlight as dl

    from compiler.schedule_cache import workload_key

    def apply_rules(rules: list[Any], names: Any = None) -> Any:
        """The kernels ``names`` (default all) of ``prepared`` scheduled by ``rules``, a new module
        (ApplyDefaultSchedule writes into the module it is given; kernels no rule fits are the
        very functions of ``prepared``)."""
        part = prepared.clone() if names is None else IRModule(
            {gv: f for gv, f in prepared.functions.items() if gv.name_hint in names})
        with target, tvm.transform.PassContext(opt_level=3):
            return dl.ApplyDefaultSchedule(*rules)(part)

    if not measure:
        return apply_rules(_rules(fuse=None))
    # Register-tiled convolutions are trusted (10-60x faster than naive in every case measured);
    # the other functions try both spatial-reduction variants and the naive lowering, timed.
    # Each variant's rules are applied to the kernels it is timed on only (applying a rule set
    # to every kernel cost more than timing them: ~3 s of SqueezeNet's ~4 s schedule step).
    funcs = [(gv.name_hint, f) for gv, f in prepared.functions.items() if isinstance(f, tirx.PrimFunc)]
    tiled = apply_rules(_rules(fuse=None)[:3:2])
    names = [n for n, f in funcs if tiled[n].same_as(f) and n not in untimed]
    chosen: dict[str, Any] = {}
    if names:
        # elementwise kernels (concatenations, transposes, BatchNorm + ReLU, ...): every rule set
        # gives them the one Elementwise schedule, made once (filed as ``fused``) and raced
        # against the naive lowering; the rule sets' other rules are tried on the rest only
        inj = {n for n in names if _all_injective(prepared[n])}
        if decisions is not None:
            # untuned builds: an elementwise kernel whose every argument's rows are whole vectors
            # gets the Elementwise schedule untimed (the 9 `light` networks, 2026-11-28: it won
            # on 72 of the 82 such kernels; the naive loop won 10 by 570 us in all, mostly one
            # ZFNet-512 kernel, 0.3% of its inference; DenseNet-121's 119 timed kernels were
            # nearly all such, their variant libraries' LLVM 98 of its 114 s schedule step)
            lanes = _vector_lanes(target)
            aligned = [n for n in names if n in inj and _whole_vectors(prepared[n], lanes)]
            if aligned:
                elementwise = apply_rules(_rules(fuse=True)[-1:], aligned)
                for n in aligned:
                    chosen[n] = elementwise[n]
                    decisions.put(workload_key(prepared[n]), "fused", {}, timed=False)
                inj -= set(aligned)
                names = [n for n in names if n not in aligned]
        other = [n for n in names if n not in inj]
        fused = apply_rules(_rules(fuse=True), other)
        if inj:
            elementwise = apply_rules(_rules(fuse=True)[-1:], inj)
            for n in inj:
                fused[n] = elementwise[n]
        variants = {"naive": prepared, "fused": fused,
                    "rows": apply_rules(_rules(fuse=False), other),
                    "narrow": apply_rules(_rules(fuse=None, min_row=2), other)}
        skip = {"rows": inj, "narrow": inj}
        if decisions is not None:  # (untuned builds: the naive lowering of one big reduction is not timed)
            skip["naive"] = {n for n in names if _one_big_reduction(prepared[n])}
        for n, label in _choose(names, variants, prepared, target, decisions, changed_only=True,
                                skip=skip).items():
            chosen[n] = variants[label][n]
    # channels-last convolutions (among the kernels register tiling changed): each register tile
    # timed, the fastest kept. Not in untuned builds (``decisions``) for x86 without AVX-512 (16
    # vector registers): measured on AVX2 (ResNet-50, 2026-11-28), the 1 x 8 tile was 28% faster
    # in total than 2 x 6, which beat it on 4 of 24 convolutions by 0.6% of their total time, and
    # timing both was an LLVM build and runs of every convolution twice (~40% of the schedule
    # step): they get 1 x 8, unmeasured
    tiled_names = [n for n, f in funcs if not tiled[n].same_as(f) and n not in untimed]
    race = not (decisions is not None and _sixteen_vector_registers(target))
    tiles = {f"tile{v}x{c}": apply_rules(_rules(fuse=None, tile=(v, c))[:1], tiled_names)
             for v, c in _TILES if race or f"tile{v}x{c}" == _UNTIMED_TILE} if tiled_names else {}
    conv = [n for n in tiled_names if not tiles[_UNTIMED_TILE][n].same_as(prepared[n])]
    if not race:
        assert decisions is not None
        for n in conv:
            chosen[n] = tiles[_UNTIMED_TILE][n]
            decisions.put(workload_key(prepared[n]), _UNTIMED_TILE, {}, timed=False)
    else:
        for n, label in _choose(conv, tiles, prepared, target, decisions, changed_only=False).items():
            chosen[n] = tiles[label][n]
    # the rest (not timed, or no variant could be timed): the rules' pick
    scheduled = prepared.clone()
    rest = [n for n, _ in funcs if n not in chosen]
    if rest:
        picked = apply_rules(_rules(fuse=None), rest)
        for n in rest:
            scheduled[n] = picked[n]
    for n, f in chosen.items():
        scheduled[n] = f
    return scheduled


_DEFAULT = "default"  # the recorded choice for a kernel no variant could be timed of: the rule's pick
_UNTIMED_TILE = f"tile1x{_MAX_COLS}"  # untuned builds' convolutions on 16 vector registers


def _sixteen_vector_registers(target: Any) -> bool:
    """x86 without AVX-512: 16 vector registers (``_vector_lanes`` says 16 float lanes for the
    haswell preset on this AVX2 host, so the rules' unmeasured pick there is the 2 x 6 tile)."""
    mattr = [str(a) for a in (target.attrs.get("mattr") or [])]
    return "x86_64" in str(target.attrs.get("mtriple", "")) and "+avx512f" not in mattr


def _choose(names: list[str], variants: dict[str, Any], prepared: Any, target: Any,
            decisions: Decisions | None, *, changed_only: bool,
            skip: dict[str, set[str]] | None = None) -> dict[str, str]:
    """The fastest variant label of each kernel in ``names`` (kernels none could be timed of are
    left out: they keep the rules' pick). ``changed_only``: a variant is timed only on the kernels
    it schedules differently from ``prepared`` (the naive lowering, itself a variant, is timed
    on all); ``skip``: the kernels a variant label is not timed on. Ties go to the first label.
    With ``decisions``: identical kernels (one workload) are timed once, in quick mode, a variant
    scheduling a kernel as an earlier one did is not timed again, and every choice is recorded
    there."""
    from tvm_ffi import structural_equal

    if not names:
        return {}
    keys: dict[str, str] = {}
    todo: list[str] = names  # one kernel per workload
    if decisions is not None:
        from compiler.schedule_cache import workload_key

        keys = {n: workload_key(prepared[n]) for n in names}
        first: dict[str, str] = {}
        todo = [n for n in names if first.setdefault(keys[n], n) == n]
    times: dict[str, dict[str, float]] = {}
    seen: dict[str, list[Any]] = {n: [] for n in todo}  # each kernel's variants timed so far
    inputs: dict[Any, list[Any]] = {}  # each kernel's arguments, made once for all its variants
    for label, mod in variants.items():
        funcs = {}
        for n in todo:
            if skip and n in skip.get(label, ()):
                continue
            f = mod[n]
            if changed_only and mod is not prepared and f.same_as(prepared[n]):
                continue
            # a variant scheduling the kernel as an earlier one did (every rule set gives an
            # elementwise kernel the same schedule) is not timed again: ties go to the first
            if decisions is not None and any(structural_equal(f, g) for g in seen[n]):
                continue
            seen[n].append(f)
            funcs[n] = f
        times[label] = _time_all(funcs, target, quick=decisions is not None, inputs=inputs) if funcs else {}
    best: dict[str, str] = {}
    for n in todo:
        timed = {label: t[n] for label, t in times.items() if n in t}
        order = list(variants)
        best[n] = min(timed, key=lambda label: (timed[label], order.index(label))) if timed else _DEFAULT
        if decisions is not None:
            decisions.put(keys[n], best[n], timed)
    if decisions is not None:  # identical kernels: the choice of the one timed
        by_key = {keys[n]: best[n] for n in todo}
        best = {n: by_key[keys[n]] for n in names}
    return {n: label for n, label in best.items() if label != _DEFAULT}


@dataclass(frozen=True)
class TunedBuild:
    """What :func:`apply_tuned` made: the module for ``relax.build``, how many kernels run a
    database record, and how many had a record but kept the default schedule (timed faster)."""

    mod: Any
    applied: int
    kept_default: int


def apply_tuned(mod: Any, target: Any, db_dir: Any = None, *, prepack: bool = False,
                shipped: bool | None = None, prefer: str = "user", measure: bool | None = None,
                channels_last: bool = True) -> TunedBuild:
    """``mod`` lowered with its tuning database(s) applied (:func:`compiler.tuning.apply_records`),
    not slower than the untuned build's kernels: kernels without a record get the default
    schedules of :func:`schedule_prepared`, and (``measure``, default: when this machine runs
    ``target``) each kernel with a record is timed against its default schedule in this process
    and the faster one is kept. (Against the *measured* defaults: racing the rules' unmeasured
    picks left tuned resnet8 and mobilenet 1.2x slower than their untuned builds.) A small
    budget's records can lose to the register-tiled defaults (measured: 64-250 trials on the zoo
    CNNs), and a database tuned on another CPU of the same preset may fit this one worse.
    ``prepack``: the layout rewrites tuned kernels need are then lifted into the
    per-parameter-set transform (:mod:`compiler.prepack`). ``channels_last``: as for
    :func:`compiler.tuning.prepare`."""
    import tvm
    from tvm import tirx

    from compiler import prepack as _prepack
    from compiler.tuning import _as_target, apply_records, can_measure

    target = _as_target(target)
    prepared, tuned, applied = apply_records(mod, target, db_dir, prepack=prepack, shipped=shipped,
                                             prefer=prefer, channels_last=channels_last)
    if measure is None:
        measure = can_measure(target)[0]
    # the defaults an untuned build would get (measured: each variant timed when this machine
    # runs the target), so the race is against what the untuned build really runs. Every
    # kernel's variants, not just the recorded ones': the kernels tuning does not cover
    # (elementwise, pooling, layout transposes) with the rules' unmeasured picks left tuned
    # resnet8 1.26x and mobilenet 1.22x onnxruntime instead of 1.00x (2026-11-23)
    default = schedule_prepared(prepared, target, measure=measure)

    recorded = [gv.name_hint for gv, f in tuned.functions.items()
                if isinstance(f, tirx.PrimFunc) and f.attrs is not None
                and bool(f.attrs.get("tirx.is_scheduled", 0))]
    out = tuned.clone()
    for gv, f in default.functions.items():
        if isinstance(f, tirx.PrimFunc) and gv.name_hint not in recorded:
            out[gv.name_hint] = f
    kept = 0
    if measure and recorded:
        # timed alike: the weight layout rewrite MetaSchedule put into a tuned kernel is left
        # out (it runs once per parameter set, not per call), as MetaSchedule's builder does
        t_tuned = _time_all({n: tuned[n] for n in recorded}, target)
        t_default = _time_all({n: default[n] for n in recorded}, target)
        for n in recorded:
            if n in t_default and t_default[n] < t_tuned.get(n, float("inf")):
                out[n] = default[n]
                kept += 1
    with target, tvm.transform.PassContext(opt_level=3):
        built = _prepack.after_tuning()(out) if prepack else out
    return TunedBuild(built, applied - kept, kept)
