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

from collections.abc import Iterator
from typing import Any

__all__ = ["channels_last", "conv2d_calls", "has_conv2d", "wants_channels_last"]


def wants_channels_last(target: Any) -> bool:
    """Whether builds for ``target`` convert convolutions to NHWC (x86_64: measured faster on every
    zoo CNN with both the default schedules and tuning; other targets unmeasured, kept NCHW)."""
    return "x86_64" in str(target.attrs.get("mtriple", ""))


def channels_last(mod: Any) -> Any:
    """``mod`` (Relax) with every conv2d in NHWC/HWIO (``relax.transform.ConvertLayout``).

    A module without a conv2d is returned as it is, and so is one ConvertLayout cannot handle
    (this TVM build's layout inference fails on some broadcasting elementwise ops, e.g. Max of a
    [2, 3] and a [3] input): the conversion is an optimisation, the NCHW build is still correct.
    The imported forms it failed on (every ``light`` network of the onnx wheel but ZFNet-512
    stayed NCHW) are rewritten first (:func:`_for_layout`): an inference Dropout, ONNX's Sum
    (stack + sum) and broadcasting ops on operands of different ranks."""
    import tvm
    from tvm import relax, transform

    from compiler.constfold import fold_numpy

    if not has_conv2d(mod):
        return mod
    mod = tvm.IRModule({gv: _for_layout(f) if isinstance(f, relax.Function) else f
                        for gv, f in mod.functions.items()}, attrs=mod.attrs)
    mod = fold_numpy(mod)  # (the folds numpy does exactly first: FoldConstant builds each with LLVM)
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


def _for_layout(func: Any) -> Any:
    """``func`` with the two imported forms ConvertLayout's layout inference cannot take rewritten
    to equivalent ones it can: ``dropout(x)[0]`` (inference: the identity; the dropout's tuple
    output failed with "Expected nested to match tuple") -> ``x``, and ONNX's n-ary Sum, imported
    as ``sum(stack(xs, axis=k), axis=[k])`` (a 5-d tensor: "can't find S in source layout
    ABCDE", every ResNet's residual add) -> ``xs[0] + xs[1] + ...``, its operands'
    ``broadcast_to`` to their own shape dropped; and broadcasting binary ops of operands of
    different ranks made same-rank (:func:`_same_rank`)."""
    from tvm import relax
    from tvm.relax.dpl import TupleGetItemPattern, is_op, rewrite_call, wildcard

    x, parts = wildcard(), wildcard()
    func = rewrite_call(TupleGetItemPattern(is_op("relax.nn.dropout")(x), 0), lambda e, m: m[x], func)
    stack = is_op("relax.stack")(parts)
    total = is_op("relax.sum")(stack)

    def add_up(expr: Any, m: Any) -> Any:
        fields, axis, red = m[parts], int(m[stack].attrs.axis), m[total].attrs
        if (not isinstance(fields, relax.Tuple) or red.axis is None or bool(red.keepdims)
                or [int(a) for a in red.axis] != [axis]):
            return expr
        out = fields.fields[0]
        for f in fields.fields[1:]:
            out = relax.op.add(out, f)
        return out

    func = rewrite_call(total, add_up, func)
    shape = wildcard()
    func = rewrite_call(is_op("relax.broadcast_to")(x, shape), _unbroadcast(x), func)
    for op in _BINARY:
        a, b = wildcard(), wildcard()
        func = rewrite_call(is_op(op)(a, b), _same_rank(a, b), func)
    return func


# broadcasting elementwise ops whose operands ConvertLayout needs at the same rank
_BINARY = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum")


def _unbroadcast(x: Any) -> Any:
    """A rewrite dropping a ``broadcast_to`` to the shape its input already has (ONNX's Sum
    broadcasts every operand first; layout inference keeps NCHW for broadcast_to)."""
    def rewrite(expr: Any, m: Any) -> Any:
        src, dst = _static_shape(m[x]), _static_shape(expr)
        return m[x] if src is not None and src == dst else expr

    return rewrite


def _static_shape(expr: Any) -> list[int] | None:
    shape = getattr(expr.ty, "shape", None)  # (a tensor's type; a tuple or prim value has none)
    try:
        return None if shape is None else [int(d) for d in shape]
    except TypeError:  # a symbolic dimension
        return None


def _rank(expr: Any) -> int | None:
    shape = getattr(expr.ty, "shape", None)  # (a tensor's type; a tuple or prim value has none)
    return len(shape) if shape is not None else None


def _same_rank(a: Any, b: Any) -> Any:
    """A rewrite reshaping the lower-rank operand of a broadcasting binary op to the other's rank
    (leading 1s, the same broadcast): ONNX's BatchNorm-as-Mul/Add (DenseNet, Inception v2) imports
    a [N, C, H, W] x [C, 1, 1] product, on which layout inference gave up and left the rest of the
    network in NCHW, transposes around every convolution."""
    from tvm import relax

    def rewrite(expr: Any, m: Any) -> Any:
        x, y = m[a], m[b]
        rx, ry = _rank(x), _rank(y)
        if rx is None or ry is None or rx == ry or min(rx, ry) == 0 or max(rx, ry) != 4:
            return expr
        lo, hi = (x, y) if rx < ry else (y, x)
        dims = [1] * (max(rx, ry) - min(rx, ry)) + [int(d) for d in lo.ty.shape]
        lifted = relax.op.reshape(lo, dims)
        args = (lifted, y) if lo is x else (x, lifted)
        return relax.Call(expr.op, list(args), expr.attrs)

    return rewrite


def conv2d_calls(mod: Any) -> Iterator[Any]:
    """The ``relax.nn.conv2d`` calls bound in ``mod``'s Relax functions (the imported form:
    bindings in the functions' top-level blocks; no printing of the whole module)."""
    from tvm import ir, relax

    conv = ir.Op.get("relax.nn.conv2d")
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for block in func.body.blocks:
            for b in block.bindings:
                if isinstance(b.value, relax.Call) and b.value.op.same_as(conv):
                    yield b.value


def has_conv2d(mod: Any) -> bool:
    """Whether a Relax function of ``mod`` binds a ``relax.nn.conv2d`` call."""
    return next(conv2d_calls(mod), None) is not None
