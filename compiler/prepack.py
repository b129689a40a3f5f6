"""Parameter-only work moved out of inference: BatchNorm folding and MetaSchedule weight pre-packing.

Parameters are runtime inputs of the compiled ``main`` (a swarm swaps them without recompiling),
so anything computed from parameters alone would otherwise run on every inference: BatchNorm's
``gamma / sqrt(var + eps)`` and, after tuning, the layout rewrite of each convolution's weights
into the blocked layout its tuned schedule reads. This module moves that work into a separate VM
function, ``main_transform_params(params) -> packed``, which the artifact runs once per parameter
set (at load and after every swap, see :class:`compiler.runtime.PreparedParams`):

- :func:`fold_batchnorm` rewrites ``batch_norm(conv2d(x, W), gamma, beta, mean, var)`` (inference
  mode, NCHW/OIHW) into ``conv2d(x, W * s) + (beta - mean * s)`` with ``s = gamma / sqrt(var + eps)``:
  the per-call work is a convolution plus a bias add; ``W * s`` and the bias depend on
  parameters only.
- :func:`before_tuning` marks the weights as layout-free so MetaSchedule's schedules may rewrite
  their layout (``AttachAttrLayoutFreeBuffers``), as ``static_shape_tuning_pipeline(...,
  cpu_weight_prepack=True)`` does.
- :func:`after_tuning` splits each layout rewrite out of its kernel
  (``SplitLayoutRewritePreproc``) and lifts every parameter-only binding (the folded BatchNorm
  arithmetic, the layout rewrites) into ``main_transform_params`` (``LiftTransformParams``).

The training module is imported separately and keeps the original parameters and layout: the
swarm trains and exchanges ONNX-layout parameters; only inference sees the packed ones.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRANSFORM_FUNC", "fold_batchnorm", "before_tuning", "after_tuning", "has_transform"]

TRANSFORM_FUNC = "main_transform_params"


def _param_vars(func: Any) -> list[Any]:
    n = func.attrs.get("num_input") if func.attrs is not None else None
    return list(func.params[int(n):]) if n is not None else []


def _fold_in(func: Any) -> Any:
    from tvm import relax, tirx
    from tvm.ir.expr import Constant
    from tvm.relax.dpl import TupleGetItemPattern, is_op, rewrite_call, wildcard

    params = _param_vars(func)
    if not params:
        return func

    def parameter_only(e: Any) -> bool:
        return isinstance(e, Constant) or any(e.same_as(p) for p in params)

    x, w, cbias = wildcard(), wildcard(), wildcard()
    gamma, beta, mean, var = wildcard(), wildcard(), wildcard(), wildcard()
    conv = is_op("relax.nn.conv2d")(x, w)
    # ONNX Conv with a bias imports as conv2d + reshape(bias, [1, C, 1, 1])
    conv_bias = is_op("relax.add")(conv, is_op("relax.reshape")(cbias, wildcard()))

    def rewriter(with_bias: bool, bn: Any) -> Any:
        def rewrite(expr: Any, m: Any) -> Any:
            c, b = m[conv], m[bn]
            ca, ba = c.attrs, b.attrs
            if (ca.data_layout != "NCHW" or ca.kernel_layout != "OIHW" or ca.out_layout != "NCHW"
                    or int(ba.axis) != 1 or bool(ba.training) or not bool(ba.center) or not bool(ba.scale)):
                return expr
            parts = (w, gamma, beta, mean, var, *((cbias,) if with_bias else ()))
            if not all(parameter_only(m[p]) for p in parts):
                return expr  # folding would add per-call work instead of removing it
            co = int(m[w].ty.shape[0])
            if with_bias and tuple(int(d) for d in m[cbias].ty.shape) != (co,):
                return expr
            eps = relax.prim_value(tirx.FloatImm(m[var].ty.dtype, float(ba.epsilon)))
            # (conv(x, W) + b - mean) * s + beta == conv(x, W * s) + (b - mean) * s + beta
            scale = relax.op.divide(m[gamma], relax.op.sqrt(relax.op.add(m[var], eps)))
            centred = relax.op.subtract(m[cbias], m[mean]) if with_bias else relax.op.negative(m[mean])
            bias = relax.op.add(relax.op.multiply(centred, scale), m[beta])
            w_folded = relax.op.multiply(m[w], relax.op.reshape(scale, (co, 1, 1, 1)))
            out = relax.Call(c.op, [m[x], w_folded], ca)
            return relax.op.add(out, relax.op.reshape(bias, (1, co, 1, 1)))

        return rewrite

    for with_bias in (True, False):
        bn = is_op("relax.nn.batch_norm")(conv_bias if with_bias else conv, gamma, beta, mean, var)
        func = rewrite_call(TupleGetItemPattern(bn, 0), rewriter(with_bias, bn), func)
    return func


def fold_batchnorm(mod: Any) -> Any:
    """``mod`` with every inference BatchNorm after a parameter-weighted conv2d folded into it."""
    import tvm
    from tvm import relax

    mod = relax.transform.DeadCodeElimination()(mod)  # unused BatchNorm mean/var outputs
    funcs = {gv: _fold_in(f) if isinstance(f, relax.Function) else f for gv, f in mod.functions.items()}
    return relax.transform.DeadCodeElimination()(tvm.IRModule(funcs, attrs=mod.attrs))


def before_tuning() -> Any:
    """The pass marking weights layout-free (run on fused TIR, before tasks are extracted)."""
    from tvm import relax

    return relax.transform.AttachAttrLayoutFreeBuffers()


_PREPROC = "meta_schedule.layout_rewrite_preproc"  # the block attribute of a tuned weight rewrite


def _has_layout_rewrite(mod: Any) -> bool:
    """Whether a kernel rewrites a weight's layout (only kernels whose weights
    :func:`before_tuning` marked layout-free can)."""
    from tvm import tirx

    return any(isinstance(f, tirx.PrimFunc) and f.attrs is not None and "layout_free_buffers" in f.attrs
               and _PREPROC in f.script() for f in mod.functions.values())


def after_tuning() -> Any:
    """The passes lifting parameter-only work into ``main_transform_params`` (after the
    database is applied). The layout rewrites are split out only when a kernel has one: the
    split fails on kernels without a compute block (scatter_elements, as the run-time slices
    of :mod:`compiler.dynshape` use it)."""
    from tvm import relax, transform

    @transform.module_pass(opt_level=0, name="SplitLayoutRewriteIfAny")
    def split(mod: Any, _ctx: Any) -> Any:
        return relax.transform.SplitLayoutRewritePreproc()(mod) if _has_layout_rewrite(mod) else mod

    return transform.Sequential([split, relax.transform.LiftTransformParams(),
                                 relax.transform.FoldConstant()])


def has_transform(mod: Any) -> bool:
    """Whether ``mod`` has a parameter transform function to ship."""
    return any(gv.name_hint == TRANSFORM_FUNC for gv in mod.functions)
