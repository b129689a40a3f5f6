"""Channels-last convolutions on x86_64: the layout both untuned and tuned builds start from.

In NCHW the contiguous dimension of a convolution's activations is the output row (3-6 wide in
the late layers of small CNNs), so vectors and register tiles are narrow and pointwise
convolutions cannot be GEMMs. onnxruntime's MLAS kernels get their speed from a blocked layout
(NCHWc: channels in the vector lanes); this module gives TVM the same idea with NHWC activations
and HWIO weights. The activations are transposed once at the graph's edges; the weight
transposes depend on parameters only, so pre-packing (:mod:`compiler.prepack`) moves them into
the per-parameter-set transform.

:func:`compiler.tuning.prepare` applies it, so the untuned default schedules
(:mod:`compiler.schedules`) and MetaSchedule's tasks (hence the tuning databases' workload keys)
see the same graph.
"""

from __future__ import annotations

from typing import Any

__all__ = ["channels_last", "has_conv2d", "wants_channels_last"]


def wants_channels_last(target: Any) -> bool:
    """Whether builds for ``target`` convert convolutions to NHWC (x86_64: measured faster on every
    zoo CNN with both the default schedules and tuning; other targets unmeasured, kept NCHW)."""
    return "x86_64" in str(target.attrs.get("mtriple", ""))


def channels_last(mod: Any) -> Any:
    """``mod`` (Relax) with every conv2d in NHWC/HWIO (``relax.transform.ConvertLayout``).

    A module without a conv2d is returned as it is, and so is one ConvertLayout cannot handle
    (this TVM build's layout inference fails on some broadcasting elementwise ops, e.g. Max of a
    [2, 3] and a [3] input, and on Concat/Split graphs): the conversion is an optimisation, the
    NCHW build is still correct."""
    from tvm import relax, transform

    if not has_conv2d(mod):
        return mod
    try:
        return transform.Sequential([
            relax.transform.FoldConstant(),  # (ConvertLayout crashes on add(constant, prim value))
            # conv2d_transpose follows its input into NHWC unless told otherwise, and this TVM
            # cannot legalize an NHWC conv2d_transpose (PaddleOCR's detector stopped compiling)
            relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "HWIO"],
                                           "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}),
            relax.transform.DeadCodeElimination(),
        ])(mod)
    except Exception:  # noqa: BLE001 - TVM's InternalError from layout inference: keep NCHW
        return mod


def has_conv2d(mod: Any) -> bool:
    """Whether a Relax function of ``mod`` binds a ``relax.nn.conv2d`` call (the imported form:
    bindings in the functions' top-level blocks; no printing of the whole module)."""
    from tvm import ir, relax

    conv = ir.Op.get("relax.nn.conv2d")
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for block in func.body.blocks:
            for b in block.bindings:
                if isinstance(b.value, relax.Call) and b.value.op.same_as(conv):
                    return True
    return False
