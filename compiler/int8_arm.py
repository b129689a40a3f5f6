"""Int8 kernels on Arm with the dot-product extension (``+dotprod``: ``sdot``, Cortex-A76 / rpi5).

``sdot`` multiplies four int8 pairs and adds them to one int32 lane, so it wants the *reduction*
axis contiguous in both operands. The integer kernels of :mod:`compiler.integer` are NCHW / OIHW
convolutions, whose reduction (input channels) is strided by a whole feature map: LLVM 22 (TVM
0.27's) then emits widening multiply-accumulates (``smlal``/``smlal2``) and no ``sdot`` in the
convolutions; only the matmul, whose reduction is contiguous, got ``sdot`` (measured: ds-cnn-kws
for rpi5, 24 ``sdot`` in the matmul, 0 in the nine convolutions).

So on such targets, before lowering, :func:`prepare` puts the int8 convolutions in NHWC
activations and OHWI weights (``relax.transform.ConvertLayout``; input channels innermost in both)
and :func:`rules` gives the regular (non-grouped) ones a schedule with a register tile of output
columns x output channels as ``local`` accumulators and the reduction loops around it, input
channels innermost. LLVM's loop vectoriser turns that input-channel loop into partial reductions,
which the AArch64 backend lowers to ``sdot`` (``tests/compiler/test_int8_boards.py`` asserts it
from the disassembly of every zoo model's pointwise and k x k convolutions). That is the same
instruction TVM's tensor intrinsic ``dot_4x4_i8i8s32_sdot`` (``tvm.s_tir.tensor_intrin.arm_cpu``)
emits; tensorizing with it would additionally need weights packed as ``[O/4, KH, KW, I/4, 4, 4]``
(its ``B`` operand is a compact 4x4 block), which LLVM does not need to find the instruction.

Depthwise convolutions (reduction over a 3x3 window per channel: no four contiguous products to
pair) run the fused channels-last kernel of :mod:`compiler.int8_depthwise` (:func:`kernels`:
channels in the vector lanes, widening multiply-accumulates, requantization in registers).
Targets without ``+dotprod`` (``rpi4``, generic ``aarch64``) are left as they are. Anything here
that fails falls back to the default path: the layouts and schedules change speed only, never
results.
"""

from __future__ import annotations

from typing import Any

from compiler.int8_depthwise import DepthwiseKernels

__all__ = ["DOTPROD_TILE", "dot_product_target", "input_channels_last", "kernels", "prepare", "rules",
           "schedule"]

# register tile (output columns, output channels): 5 x 4 sdot accumulators + 9 operands: 29 of
# the 32 NEON registers
DOTPROD_TILE = (5, 4)


def dot_product_target(target: Any) -> bool:
    """Whether ``target`` (a ``tvm.target.Target``) is AArch64 with the int8 dot product."""
    if "aarch64" not in str(target.attrs.get("mtriple", "")):
        return False
    return "+dotprod" in [str(a) for a in target.attrs.get("mattr", [])]


def kernels(target: Any) -> DepthwiseKernels | None:
    """The int8 kernels :func:`compiler.integer.integer_kernels` builds itself for ``target``
    (LLVM, ``+dotprod``): the depthwise convolutions' (:mod:`compiler.int8_depthwise`, 4 int32
    lanes per NEON register) and the matmuls' with ``[N, K]`` weights (``sdot`` on ONNX MatMul's
    ``[K, N]`` ones too); None elsewhere."""
    if target is None or target.kind.name != "llvm" or not dot_product_target(target):
        return None
    return DepthwiseKernels(vector=4, rows_matmul=True)


def _int8_convs(mod: Any) -> tuple[int, int]:
    """(int32-accumulating conv2d, other conv2d) bound in ``mod``'s Relax functions."""
    from compiler.layout import conv2d_calls

    dtypes = [str(call.attrs.out_dtype) for call in conv2d_calls(mod)]
    n_int = dtypes.count("int32")
    return n_int, len(dtypes) - n_int


def prepare(mod: Any, target: Any) -> Any:
    """``mod`` (Relax, after :func:`compiler.integer.integer_kernels`) with its int8 convolutions
    in NHWC / OHWI where ``target`` has ``sdot``; otherwise (no dot product, no int8 convolution,
    float convolutions mixed in: their layout on Arm is unmeasured) ``mod`` unchanged."""
    return input_channels_last(mod) if dot_product_target(target) else mod


def input_channels_last(mod: Any) -> Any:
    """``mod`` with its conv2d in NHWC / OHWI when they are all int8 (int32-accumulating), the
    reduction's input channels innermost and contiguous in both operands; else ``mod``."""
    from tvm import relax, transform

    n_int, n_other = _int8_convs(mod)
    if not n_int or n_other:
        return mod
    try:
        return transform.Sequential([
            relax.transform.FoldConstant(),
            relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]}),
            relax.transform.DeadCodeElimination(),
        ])(mod)
    except Exception:  # noqa: BLE001 - TVM's layout inference refused the graph: keep NCHW
        return mod


def _divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def rules(tile: tuple[int, int] = DOTPROD_TILE, accept: Any = dot_product_target) -> list[Any]:
    """Default-schedule rules (dlight ``CPUScheduleRule``) for int8 kernels on targets ``accept``
    takes (default: ``+dotprod``; :func:`schedule`), applied before :mod:`compiler.schedules`'
    own, with register tile ``tile`` (output columns, output channels). They return None (the next
    rule applies) for any other target or function."""
    cols, channels = tile
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

    class DotProductConv(CPUScheduleRule):
        """An int8 x int8 -> int32 ``conv2d_nhwc`` with OHWI weights (groups 1): spatial loops
        ``[N] H W C``, reduction ``KH KW I``. Tile: ``cols`` output columns x ``channels``
        output channels accumulated in registers while the reduction loops run around them,
        input channels innermost and contiguous (what LLVM turns into ``sdot``); outer rows in
        parallel; the epilogue (bias, scale) applied per row while it is in cache."""

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            try:
                return self._apply(func, target)
            except Exception:  # noqa: BLE001 - a schedule primitive refused: the default rules apply
                return None

        def _apply(self, func: Any, target: Any) -> Any:
            if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target) \
                    or not accept(target):
                return None
            sch = s_tir.Schedule(func)
            infos = normalize_prim_func(sch)
            reds = [i for i, b in enumerate(infos or []) if not b.is_injective()]
            if len(reds) != 1:
                return None
            r = reds[0]
            red = infos[r]
            block = sch.get(red.block_rv)
            if block.name_hint != "conv2d_nhwc" or not _int8_products(block):
                return None
            kind = red.dom_kind()
            ns = kind.count("S")
            if kind != "S" * ns + "R" * (len(kind) - ns) or ns not in (3, 4):
                return None
            for b in infos[:r]:  # the (zero-width) padding copy
                sch.compute_inline(b.block_rv)
            for b in infos[r + 1:-1]:
                sch.compute_inline(b.block_rv)
            last = infos[-1].block_rv if r < len(infos) - 1 else None
            loops = sch.get_loops(red.block_rv)
            outer, (h, w, c), reduce = loops[:ns - 3], loops[ns - 3:ns], loops[ns:]
            we, ce = int(sch.get(w).extent), int(sch.get(c).extent)
            wo, wi = sch.split(w, factors=[None, _divisor(we, cols)])
            co, ci = sch.split(c, factors=[None, _divisor(ce, channels)])
            sch.reorder(*outer, h, wo, co, *reduce, wi, ci)
            par = sch.fuse(*outer, h) if outer else h
            if int(sch.get(par).extent) > 1:
                sch.parallel(par)
            # (a "global" tile: TVM lowers it to a stack array; a "local" one was a
            # TVMBackendAllocWorkspace / Free call pair per tile inside the parallel loop)
            acc = sch.cache_write(red.block_rv, 0, "global")
            sch.reverse_compute_at(acc, co, preserve_unit_loops=True)
            if last is not None:
                sch.reverse_compute_at(last, par, preserve_unit_loops=True)
            init = sch.decompose_reduction(red.block_rv, reduce[0])
            for b in (red.block_rv, init, acc):
                lp = sch.get_loops(b)
                for loop in lp[-2:]:
                    if int(sch.get(loop).extent) > 1:
                        sch.unroll(loop)
            return sch

    return [DotProductConv()]


def schedule(prepared: Any, target: Any) -> Any:
    """``prepared`` (fused TIR, :func:`compiler.tuning.prepare`) with :func:`rules` applied: the
    module itself when ``target`` has no dot product, else a copy."""
    import tvm
    from tvm.s_tir import dlight as dl

    if not dot_product_target(target):
        return prepared
    with target, tvm.transform.PassContext(opt_level=3):
        return dl.ApplyDefaultSchedule(*rules())(prepared.clone())


def _int8_products(block: Any) -> bool:
    """Whether ``block`` reads only int8 buffers and writes int32 (an integer convolution)."""
    reads = {str(r.source.dtype) for r in block.reads} - {"int32"}  # (the accumulator itself)
    return reads == {"int8"} and {str(w.source.dtype) for w in block.writes} == {"int32"}
