"""Int8 kernels on RISC-V with the vector extension (``riscv64-rvv``: rv64gcv, C backend).

The C backend compiles the kernels with TVM's own LLVM (22 in TVM 0.27), not with the board's
GCC (12 in bookworm/trixie cross toolchains, which does not auto-vectorise for RVV), so RVV
code comes from LLVM's loop vectoriser: the int8 x int8 -> int32 loops of
:mod:`compiler.integer` become widening multiply-accumulates (``vwmacc.vx`` / ``vwmacc.vv`` on
``vle8``/``vsext`` loads, ``vredsum`` for contiguous reductions) with no schedule of ours
(``tests/compiler/test_int8_boards.py`` asserts them from the disassembly of every zoo model).

What needs handling is TVM's RISC-V vector code generation: a loop the default schedules mark
``vectorized`` (4 lanes) in a kernel that also holds int8 quantize / accumulate blocks fails in
``tvm.tirx.build`` ("Check failed: MatchType(value.ty())"; resnet8-cifar10's QDQ model, with float
or integer kernels alike), so on RVV targets :func:`serial_vectors` turns those loops of kernels
touching int8 buffers back into plain loops and leaves vectorising them to LLVM, which does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RVV_TILE", "prepare", "rvv_target", "schedule", "serial_vectors"]

# One accumulator per output: the input-channel loop is then a plain int8 dot product, which
# LLVM vectorises for RVV (vle8 + vwmacc.vv / vmacc.vv + vredsum); with register tiles of
# several accumulators (the Arm tile) it vectorised none of resnet8-cifar10's convolutions.
RVV_TILE = (1, 1)


def rvv_target(target: Any) -> bool:
    """Whether ``target`` (a ``tvm.target.Target``) is RISC-V with the vector extension."""
    if "riscv" not in str(target.attrs.get("mtriple", "")):
        return False
    return "+v" in [str(a) for a in target.attrs.get("mattr", [])]


def prepare(mod: Any, target: Any) -> Any:
    """``mod`` (Relax) with int8 convolutions in NHWC / OHWI on RVV targets
    (:func:`compiler.int8_arm.input_channels_last`); else ``mod``."""
    from compiler import int8_arm

    return int8_arm.input_channels_last(mod) if rvv_target(target) else mod


def schedule(prepared: Any, target: Any) -> Any:
    """``prepared`` (fused TIR) with the int8 convolutions scheduled input channels innermost,
    one accumulator per output (:data:`RVV_TILE`) on RVV targets; else ``prepared`` itself."""
    import tvm
    from tvm.s_tir import dlight as dl

    from compiler import int8_arm

    if not rvv_target(target):
        return prepared
    with target, tvm.transform.PassContext(opt_level=3):
        return dl.ApplyDefaultSchedule(*int8_arm.rules(RVV_TILE, rvv_target))(prepared.clone())


def _touches_int8(func: Any) -> bool:
    return any(" int8" in s or "uint8" in s for s in (str(p.ty) for p in func.params)) or \
        '"int8"' in func.script() or '"uint8"' in func.script()


def serial_vectors(mod: Any, target: Any) -> Any:
    """``mod`` (scheduled fused TIR) with the ``vectorized`` loops of its int8 kernels made serial
    when ``target`` is RVV (see above); else ``mod`` itself."""
    import tvm
    from tvm import tirx

    if not rvv_target(target):
        return mod
    serial = tirx.transform.VectorizeLoop(False)  # (disabled: vectorized loops become serial ones)
    out = mod
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and _touches_int8(func):
            out = out.clone() if out is mod else out
            out[gv] = serial(tvm.IRModule({gv: func}))[gv]
    return out
