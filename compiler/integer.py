"""Integer kernels for QDQ models: ``dequantize -> conv2d / matmul (+ bias) [-> relu] -> quantize``
becomes an int8 x int8 -> int32 convolution / matmul with the bias added in int32 and one
requantization to int8.

TVM 0.27's ONNX frontend imports a QDQ graph (onnxruntime ``quantize_static``, QDQ format) as
``R.dequantize`` -> float32 op -> ``R.quantize``, so an int8 model ran float kernels plus the
conversions around them. This pass runs on the imported Relax module, where the QDQ scales and
zero points and the int8 weights are constants (the preparation stage leaves a weight's
``DequantizeLinear`` unfolded for it, ``compiler.prepare.fold_constants``), and the result is
what both routes lower: the LLVM/VM build and the C backend. QOperator-format models (QLinearConv,
QGemm, ...) reach this pattern too: the preparation stage rewrites them into their QDQ form
(:mod:`compiler.qoperator`).

Arithmetic (activations per tensor: scale ``sx``, zero point ``zx``; weights per output channel:
scale ``sw[c]``, zero point 0, as ``quantize_static`` makes them; bias ``bq[c]`` int32 at scale
``sx * sw[c]``)::

    acc[c] = sum((xq - zx) * wq[c]) + bq[c]
           = conv(pad(xq, value=zx), wq)[c] + (bq[c] - zx * sum(wq[c]))     # all int32
    q      = quantize(acc * (sx * sw[c]), sy, zy)                          # R.quantize: round half to even
    relu   -> q = max(q, zy)

The padding is explicit with the value ``zx`` (the quantized zero), so the zero-point correction
is one constant per output channel, folded into the int32 bias. The float reference computes the
same sum in float32 and rounds once, so results are equal or one quantization step apart where
the float sum lands next to a rounding boundary.

Anything the pattern does not match (per-channel activations, weight zero points, a bias at
another scale, an intermediate value used elsewhere, conv1d/3d, Add / pooling / other ops
between Q and DQ) keeps the float path the frontend built: correct, only not integer.

Given the target, the ops that fit a CPU's int8 dot-product instruction are built as that
target's tensorized kernels instead of the generic ``conv2d`` / ``matmul`` (x86:
:mod:`compiler.int8_x86`, same arithmetic, requantized in registers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["IntegerRewrite", "integer_kernels"]


@dataclass(frozen=True)
class IntegerRewrite:
    """What :func:`integer_kernels` did: the module and how many of each op went integer."""

    mod: Any
    conv2d: int
    matmul: int
    dot: int = 0  # of those, how many run a target's dot-product kernel (compiler.int8_x86)
    intrin: str = ""

    def describe(self) -> str:
        return f"integer_kernels({self.conv2d} conv2d, {self.matmul} matmul int8->int32)"

    def describe_dot(self) -> str:
        return f"dot_product_kernels({self.dot} of them: {self.intrin})"


def _const(expr: Any) -> np.ndarray | None:
    from tvm import ir

    return expr.value.numpy() if isinstance(expr, ir.expr.Constant) else None


def _scalar(a: np.ndarray | None) -> float | None:
    return float(a.reshape(-1)[0]) if a is not None and a.size == 1 else None


def _per_channel(scale: np.ndarray, axis: int, ndim: int, channels: int, out_axis: int) -> np.ndarray | None:
    """A weight scale as one value per output channel (None: it varies along another axis)."""
    if scale.size == 1:
        return np.full(channels, float(scale.reshape(-1)[0]), np.float64)
    if scale.size == channels and axis % ndim == out_axis:
        return scale.astype(np.float64).reshape(-1)
    return None


class _Rewriter:
    """The DFPattern of one quantized conv/matmul and the integer expression replacing it."""

    def __init__(self, dot: Any = None) -> None:
        from tvm.relax.dpl import is_const, is_op, wildcard

        self.dot = dot  # compiler.int8_depthwise.Int8Kernels (the target's), or None: the generic ops
        self.dots = 0

        self.xq = wildcard()
        self.sx, self.zx = is_const(), is_const()
        dq_x = is_op("relax.dequantize")(self.xq, self.sx, self.zx)
        self.wq, self.sw, self.zw = is_const(), is_const(), is_const()
        self.dq_w = is_op("relax.dequantize")(self.wq, self.sw, self.zw)
        self.w_t = is_op("relax.permute_dims")(self.dq_w)
        self.conv = is_op("relax.nn.conv2d")(dq_x, self.dq_w)
        self.mm = is_op("relax.matmul")(dq_x, self.dq_w | self.w_t)
        op = self.conv | self.mm
        self.bq, self.sb, self.zb = is_const(), is_const(), is_const()
        self.dq_b = is_op("relax.dequantize")(self.bq, self.sb, self.zb)
        bias = self.dq_b | is_op("relax.reshape")(self.dq_b, wildcard())
        self.biased = is_op("relax.add")(op, bias)
        pre = op | self.biased
        self.relu = is_op("relax.nn.relu")(pre)
        self.sy, self.zy = is_const(), is_const()
        self.pattern = is_op("relax.quantize")(pre | self.relu, self.sy, self.zy)
        self.conv2d = 0
        self.matmul = 0

    def __call__(self, expr: Any, m: dict[Any, Any]) -> Any:
        try:
            return self._rewrite(expr, m)
        except _NoMatch:
            return expr

    def _rewrite(self, expr: Any, m: dict[Any, Any]) -> Any:
        from tvm import relax

        xq = m[self.xq]
        sx, zx = _scalar(_const(m[self.sx])), _scalar(_const(m[self.zx]))
        sy, zy = _scalar(_const(m[self.sy])), _scalar(_const(m[self.zy]))
        wq, sw, zw = _const(m[self.wq]), _const(m[self.sw]), _const(m[self.zw])
        if sx is None or zx is None or sy is None or zy is None or wq is None or sw is None or zw is None:
            raise _NoMatch
        x_dtype = str(xq.ty.dtype)
        out_dtype = str(expr.attrs.out_dtype)
        if x_dtype not in ("int8", "uint8") or str(wq.dtype) not in ("int8", "uint8") or np.any(zw != 0):
            raise _NoMatch
        is_conv = self.conv in m
        w_axis = int(m[self.dq_w].attrs.axis)
        if is_conv:
            attrs = m[self.conv].attrs
            if attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW" or wq.ndim != 4:
                raise _NoMatch
            channels = wq.shape[0]
            s_w = _per_channel(sw, w_axis, 4, channels, 0)
            w_int = wq.astype(np.int64)
            w_sum = w_int.reshape(channels, -1).sum(axis=1)
        else:
            if wq.ndim != 2:
                raise _NoMatch
            transposed = self.w_t in m
            if transposed and list(m[self.w_t].attrs.axes or [1, 0]) != [1, 0]:
                raise _NoMatch
            channels = wq.shape[0] if transposed else wq.shape[1]
            s_w = _per_channel(sw, w_axis, 2, channels, 0 if transposed else 1)
            w_kn = wq.T if transposed else wq
            w_sum = w_kn.astype(np.int64).sum(axis=0)
        if s_w is None:
            raise _NoMatch
        scale = np.float32(sx) * s_w.astype(np.float32)  # the float path's product, per channel
        bias = np.zeros(channels, np.int64)
        if self.biased in m:
            bq, sb, zb = _const(m[self.bq]), _const(m[self.sb]), _const(m[self.zb])
            if bq is None or sb is None or zb is None or np.any(zb != 0) or bq.size != channels or \
                    not np.allclose(np.broadcast_to(sb, (channels,)), scale, rtol=1e-6, atol=0):
                raise _NoMatch
            bias = bq.astype(np.int64).reshape(-1)
        bias = bias - int(zx) * w_sum
        if np.abs(bias).max(initial=0) >= 2**31:
            raise _NoMatch
        fast = self._dot(expr, m, is_conv, wq, bias, scale, zx, sy, zy, out_dtype)
        if fast is not None:
            self.dots += 1
            if is_conv:
                self.conv2d += 1
            else:
                self.matmul += 1
            return fast
        shape = [1, channels, 1, 1] if is_conv else [channels]
        if is_conv:
            attrs = m[self.conv].attrs
            pads = [int(p) for p in attrs.padding]  # top, left, bottom, right
            data = xq
            if any(pads):
                data = relax.op.nn.pad(xq, [0, 0, 0, 0, pads[0], pads[2], pads[1], pads[3]],
                                       pad_value=float(zx))
            acc = relax.op.nn.conv2d(data, relax.const(wq), strides=attrs.strides, padding=[0, 0, 0, 0],
                                     dilation=attrs.dilation, groups=int(attrs.groups),
                                     out_dtype="int32")
            self.conv2d += 1
        else:
            w_const = relax.const(np.ascontiguousarray(wq.T if self.w_t in m else wq))
            acc = relax.op.matmul(xq, w_const, out_dtype="int32")
            self.matmul += 1
        acc = relax.op.add(acc, relax.const(bias.astype(np.int32).reshape(shape)))
        real = relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(scale.reshape(shape)))
        q = relax.op.quantize(real, m[self.sy], m[self.zy], axis=int(expr.attrs.axis), out_dtype=out_dtype)
        if self.relu in m:
            q = relax.op.maximum(q, relax.const(np.array(zy, dtype=out_dtype)))
        return q


    def _dot(self, expr: Any, m: dict[Any, Any], is_conv: bool, wq: np.ndarray, bias: np.ndarray,
             scale: np.ndarray, zx: float, sy: float, zy: float, out_dtype: str) -> Any:
        """The same computation on the target's dot-product kernel, or None (no such kernel, or
        it does not apply to this op)."""
        if self.dot is None:
            return None
        common = {"zx": int(zx), "sy": sy, "zy": int(zy), "out_dtype": out_dtype, "relu": self.relu in m}
        if is_conv:
            attrs = m[self.conv].attrs
            pads = [int(p) for p in attrs.padding]
            return self.dot.conv2d(m[self.xq], wq, bias, scale, strides=tuple(int(s) for s in attrs.strides),
                                   dilation=tuple(int(d) for d in attrs.dilation),
                                   pads=(pads[0], pads[1], pads[2], pads[3]), groups=int(attrs.groups),
                                   **common)
        return self.dot.matmul(m[self.xq], np.ascontiguousarray(wq.T if self.w_t in m else wq), bias,
                               scale, **common)


class _NoMatch(Exception):
    pass


def _cancel_transposes(func: Any) -> Any:
    """``func`` with ``permute_dims(permute_dims(x, p), q)`` that compose to the identity replaced
    by ``x``: the target kernels take and give channels-last tensors behind NCHW transposes
    (:mod:`compiler.int8_x86`, :mod:`compiler.int8_depthwise`), so between two of them the
    activations went NHWC -> NCHW -> NHWC, fused into the next copy but a gather per element."""
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    x = wildcard()
    inner = is_op("relax.permute_dims")(x)
    outer = is_op("relax.permute_dims")(inner)

    def cancel(expr: Any, m: dict[Any, Any]) -> Any:
        p, q = m[inner].attrs.axes, m[outer].attrs.axes
        if p is None or q is None:
            return expr
        p, q = [int(a) for a in p], [int(a) for a in q]
        return m[x] if [p[a] for a in q] == list(range(len(p))) else expr

    return rewrite_call(outer, cancel, func)


def _sink_transposes(func: Any) -> Any:
    """``func`` with the NCHW transposes the target kernels leave behind moved past the per-tensor
    glue between them (``dequantize`` / ``quantize`` with one scale, ``add`` of two tensors under
    the same transpose, ``relu``, and a ``mean`` that keeps its dims) so that they meet and cancel
    (:func:`_cancel_transposes`) or end on the pooled ``[N, 1, 1, C]`` tensor: a residual add or a
    global average pool then reads channels-last int8 where it read an unscheduled gather
    (resnet8's last add was 8 us, ds-cnn-kws' pool input 6.7 us)."""
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    def axes(t: Any) -> list[int] | None:
        a = t.attrs.axes
        return None if a is None else [int(v) for v in a]

    x, y = wildcard(), wildcard()
    tx, ty = is_op("relax.permute_dims")(x), is_op("relax.permute_dims")(y)
    s, z = wildcard(), wildcard()
    dq = is_op("relax.dequantize")(tx, s, z)
    q = is_op("relax.quantize")(tx, s, z)
    relu = is_op("relax.nn.relu")(tx)
    add = is_op("relax.add")(tx, ty)
    mean = is_op("relax.mean")(tx)

    def scalar(e: Any) -> bool:  # one scale / zero point for the whole tensor
        c = _const(e)
        return c is not None and c.size == 1

    def sink(expr: Any, m: dict[Any, Any]) -> Any:
        p = axes(m[tx])
        if p is None:
            return expr
        inner = m[x]
        if dq in m or q in m:
            if not (scalar(m[s]) and scalar(m[z])):
                return expr
            a = expr.attrs
            op = relax.op.dequantize if dq in m else relax.op.quantize
            moved = op(inner, m[s], m[z], axis=p[int(a.axis) % len(p)], out_dtype=str(a.out_dtype))
        elif relu in m:
            moved = relax.op.nn.relu(inner)
        elif add in m:
            if axes(m[ty]) != p or list(m[x].ty.shape) != list(m[y].ty.shape):
                return expr
            moved = relax.op.add(inner, m[y])
        else:  # mean
            a = expr.attrs
            if not bool(a.keepdims) or a.axis is None:
                return expr
            moved = relax.op.mean(inner, axis=[p[int(v) % len(p)] for v in a.axis], keepdims=True)
        return relax.op.permute_dims(moved, p)

    pattern = dq | q | relu | add | mean
    for _ in range(64):
        new = _cancel_transposes(rewrite_call(pattern, sink, func))
        if new.same_as(func):
            break
        func = new
    return func


def integer_kernels(mod: Any, target: Any = None) -> IntegerRewrite:
    """``mod`` with every matching quantized conv2d / matmul on integer kernels (see above);
    with a ``target`` (``tvm.target.Target``) that has an int8 dot-product instruction the kernels
    that fit are that target's tensorized ones (x86: :mod:`compiler.int8_x86`)."""
    from tvm import relax
    from tvm.relax.dpl import rewrite_call

    from compiler import int8_arm, int8_x86

    dot = int8_x86.kernels(target) or int8_arm.kernels(target)
    rw = _Rewriter(dot)
    out = mod
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            new = rewrite_call(rw.pattern, rw, func)
            if dot is not None and not new.same_as(func):
                new = _sink_transposes(_cancel_transposes(new))
            if not new.same_as(func):
                out = out.clone() if out is mod else out
                out[gv] = new
    if dot is not None and dot.funcs:
        out = out.clone() if out is mod else out
        for gv, f in dot.funcs:
            out[gv] = f
    if rw.conv2d or rw.matmul:
        out = relax.transform.DeadCodeElimination()(out)
    return IntegerRewrite(out, rw.conv2d, rw.matmul, rw.dots, dot.summary() if dot is not None else "")
