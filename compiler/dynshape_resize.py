"""Resize and Upsample whose ``scales`` / ``sizes`` are a model input (see :mod:`compiler.dynshape`).

TVM's Resize converter needs ``scales`` / ``sizes`` as constants (it also lacks ``axes``,
``antialias`` and ``keep_aspect_ratio_policy``, and with ``scales`` it maps coordinates by
``in / out`` rather than by the scale, which ONNX uses), so this is the project's converter.
It follows ONNX's definition (the reference's separable form): one axis after the other, each
output index ``y`` maps to a source coordinate ``x`` (``coordinate_transformation_mode``, in
float64 as the reference does), and the output is a weighted sum of ``n`` input samples around
``x`` (indices clamped to the edge, as ONNX pads by repeating the edge):

- nearest: one sample, ``x`` rounded by ``nearest_mode``;
- linear / cubic: ``n`` = 2 / 4 taps, weights from the kernel at the taps' distances; with
  ``antialias`` and a scale below 1 the kernel is stretched by ``1 / scale`` and normalized, so
  ``n`` grows as the scale shrinks: it is computed at run time too;
- ``exclude_outside``: taps outside the input get weight 0, the others are renormalized;
- ``tf_crop_and_resize``: coordinates come from ``roi``; outside the input the output is
  ``extrapolation_value``.

The output dims (``floor(dim * scale)``, or ``sizes`` with ``keep_aspect_ratio_policy``) are
bound at run time with the values ONNX forbids flagged (a scale that is not positive, a negative
size): :func:`compiler.dynshape_ops.checked_shape` stops inference on them. Upsample (opset 9,
converted to Resize by the opset upgrade) is the same with ``asymmetric`` coordinates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["convert_resize"]

_COORD = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
          "tf_crop_and_resize")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
_FLOATS = ("float16", "float32", "float64")


def _text(attrs: dict[str, Any], name: str, default: str) -> str:
    v = attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def _f64(value: Any) -> Any:
    from tvm import relax

    return relax.const(np.asarray(value, np.float64), "float64")


def _i64(value: Any) -> Any:
    from tvm import relax

    return relax.const(np.asarray(value, np.int64), "int64")


class _Plan:
    """Compile-time facts of one Resize node."""

    def __init__(self, x: Any, attrs: dict[str, Any], n_scales: int, n_sizes: int, n_roi: int) -> None:
        from tvm import relax

        ty = x.ty
        if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
            raise ValueError("Resize with run-time scales or sizes needs a known input rank")
        self.rank = int(ty.ndim)
        self.dtype = str(ty.dtype)
        self.mode = _text(attrs, "mode", "nearest")
        self.coord = _text(attrs, "coordinate_transformation_mode", "half_pixel")
        self.nearest = _text(attrs, "nearest_mode", "round_prefer_floor")
        self.policy = _text(attrs, "keep_aspect_ratio_policy", "stretch")
        self.antialias = bool(attrs.get("antialias", 0))
        self.exclude = bool(attrs.get("exclude_outside", 0))
        self.cubic_a = float(attrs.get("cubic_coeff_a", -0.75))
        self.extrapolation = float(attrs.get("extrapolation_value", 0.0))
        axes = [int(a) for a in attrs.get("axes", range(self.rank))]
        self.axes = [a + self.rank if a < 0 else a for a in axes]
        self.n_roi = n_roi
        if self.mode not in ("nearest", "linear", "cubic"):
            raise ValueError(f"Resize mode {self.mode!r} is not defined by ONNX")
        if self.coord not in _COORD:
            raise ValueError(f"coordinate_transformation_mode {self.coord!r} is not defined by ONNX")
        if self.mode == "nearest" and self.nearest not in (*_NEAREST, "simple"):
            raise ValueError(f"nearest_mode {self.nearest!r} is not defined by ONNX")
        if self.policy not in ("stretch", "not_larger", "not_smaller"):
            raise ValueError(f"keep_aspect_ratio_policy {self.policy!r} is not defined by ONNX")
        if self.antialias and self.mode == "nearest":
            raise ValueError("antialias applies to the linear and cubic modes only")
        if len(set(self.axes)) != len(self.axes) or any(not 0 <= a < self.rank for a in self.axes):
            raise ValueError(f"Resize axes {axes} are repeated or out of range for a rank-{self.rank} input")
        if self.dtype not in _FLOATS and self.mode != "nearest":
            raise ValueError(f"{self.mode} Resize of {self.dtype} data is not supported (float data only)")
        if (n_scales > 0) == (n_sizes > 0):
            raise ValueError("Resize takes exactly one of scales and sizes")
        self.by_scales = n_scales > 0
        given = n_scales or n_sizes
        if given != len(self.axes):
            what = "scales" if self.by_scales else "sizes"
            raise ValueError(f"Resize {what} has {given} values for {len(self.axes)} axes")
        if self.coord == "tf_crop_and_resize" and n_roi != 2 * len(self.axes):
            raise ValueError(f"tf_crop_and_resize needs a roi of {2 * len(self.axes)} values, got {n_roi}")


def _scalar(bb: Any, vec: Any, i: int, dtype: str) -> Any:
    """Element ``i`` of the 1-D tensor ``vec`` as a rank-0 ``dtype`` tensor."""
    from tvm import relax

    v = relax.op.take(vec, _i64(i), axis=0, mode="clip")
    return bb.normalize(v if vec.ty.dtype == dtype else relax.op.astype(v, dtype))


def _scales_and_sizes(bb: Any, plan: _Plan, dims: Any, operand: Any) -> tuple[list[Any], list[Any], Any]:
    """Per resized axis: (float64 scale, int64 output dim), and the int64 [1] flag of forbidden values."""
    from tvm import relax

    from compiler.dynshape_ops import any_of

    lens = [_scalar(bb, dims, a, "float64") for a in plan.axes]
    if plan.by_scales:
        scales = [_scalar(bb, operand, i, "float64") for i in range(len(plan.axes))]
        sizes = [bb.normalize(relax.op.astype(relax.op.floor(relax.op.multiply(s, n)), "int64"))
                 for s, n in zip(scales, lens, strict=True)]
        # a scale must be positive (NaN fails too)
        positive = relax.op.greater(relax.op.astype(operand, "float64"), _f64(0.0))
        bad = any_of(bb, relax.op.logical_not(positive))
        return scales, sizes, bad
    sizes = [_scalar(bb, operand, i, "int64") for i in range(len(plan.axes))]
    bad = any_of(bb, relax.op.less(relax.op.astype(operand, "int64"), _i64(0)))
    scales = [bb.normalize(relax.op.divide(relax.op.astype(s, "float64"), n))
              for s, n in zip(sizes, lens, strict=True)]
    if plan.policy != "stretch":
        pick = relax.op.min if plan.policy == "not_larger" else relax.op.max
        one = bb.normalize(pick(relax.op.stack(scales, axis=0), [0], False))
        scales = [one] * len(plan.axes)
        rounded = [relax.op.floor(relax.op.add(relax.op.multiply(one, n), _f64(0.5))) for n in lens]
        sizes = [bb.normalize(relax.op.astype(v, "int64")) for v in rounded]
    return scales, sizes, bad


def _coordinates(bb: Any, plan: _Plan, out: Any, out_int: Any, scale: Any, length: Any,
                 roi: tuple[Any, Any] | None) -> tuple[Any, Any | None]:
    """float64 [out]: the source coordinate of each output index along one axis, and (for
    tf_crop_and_resize) the bool [out] mask of coordinates outside the input."""
    from tvm import relax

    from compiler.dynshape_ops import index_range

    op = relax.op
    y = op.astype(index_range(bb, out), "float64")
    width = bb.normalize(op.multiply(scale, length))  # the reference's float output width
    single = op.equal(width, _f64(1.0))
    centred = op.subtract(op.divide(op.add(y, _f64(0.5)), scale), _f64(0.5))
    last = op.subtract(length, _f64(1.0))
    mask = None
    if plan.coord == "half_pixel":
        x = centred
    elif plan.coord == "pytorch_half_pixel":
        x = op.where(single, _f64(-0.5), centred)
    elif plan.coord == "asymmetric":
        x = op.divide(y, scale)
    elif plan.coord == "align_corners":
        x = op.where(single, _f64(0.0), op.divide(op.multiply(y, last), op.subtract(width, _f64(1.0))))
    elif plan.coord == "half_pixel_symmetric":
        adjustment = op.divide(op.astype(out_int, "float64"), width)
        offset = op.multiply(op.divide(length, _f64(2.0)), op.subtract(_f64(1.0), adjustment))
        x = op.add(offset, centred)
    else:  # tf_crop_and_resize
        assert roi is not None
        start, end = roi
        span = op.subtract(end, start)
        x = op.where(single, op.divide(op.multiply(span, last), _f64(2.0)),
                     op.divide(op.multiply(op.multiply(y, span), last), op.subtract(width, _f64(1.0))))
        x = op.add(x, op.multiply(start, last))
        x = bb.normalize(x)
        mask = bb.normalize(op.logical_or(op.less(x, _f64(0.0)), op.greater(x, last)))
    return bb.normalize(x), mask


def _nearest_index(bb: Any, mode: str, x: Any, scale: Any) -> Any:
    from tvm import relax

    op = relax.op
    low = bb.normalize(op.floor(x))
    frac = op.subtract(x, low)
    up = op.add(low, _f64(1.0))
    if mode == "round_prefer_floor":
        idx = op.where(op.less_equal(frac, _f64(0.5)), low, up)
    elif mode == "round_prefer_ceil":
        idx = op.where(op.less(frac, _f64(0.5)), low, up)
    elif mode == "floor":
        idx = low
    elif mode == "ceil":
        idx = op.ceil(x)
    else:  # Upsample's: ceil when downsampling, else floor
        idx = op.where(op.less(scale, _f64(1.0)), op.ceil(x), low)
    return bb.normalize(op.astype(idx, "int64"))


def _kernel(plan: _Plan, d: Any) -> Any:
    """The interpolation kernel at the (already scaled) distances ``d``."""
    from tvm import relax

    op = relax.op
    t = op.abs(d)
    if plan.mode == "linear":
        return op.maximum(op.subtract(_f64(1.0), t), _f64(0.0))
    a = plan.cubic_a
    t2 = op.multiply(t, t)
    t3 = op.multiply(t2, t)
    near = op.add(op.subtract(op.multiply(_f64(a + 2), t3), op.multiply(_f64(a + 3), t2)), _f64(1.0))
    far = op.subtract(op.add(op.subtract(op.multiply(_f64(a), t3), op.multiply(_f64(5 * a), t2)),
                             op.multiply(_f64(8 * a), t)), _f64(4 * a))
    return op.where(op.less_equal(t, _f64(1.0)), near, op.where(op.less(t, _f64(2.0)), far, _f64(0.0)))


def _taps(bb: Any, plan: _Plan, scale: Any) -> tuple[Any, Any, Any]:
    """(number of taps as a PrimExpr, int64 [n] 0 .. n - 1, float64 kernel scale): 2 (linear) or 4
    (cubic) taps, more with antialias when downsampling (the kernel stretched by 1 / scale)."""
    from tvm import relax

    from compiler.dynshape_ops import checked_shape, index_range

    base = 2 if plan.mode == "linear" else 4
    if not plan.antialias:
        return base, index_range(bb, base), _f64(1.0)
    op = relax.op
    s = bb.normalize(op.minimum(scale, _f64(1.0)))
    first = op.add(op.floor(op.divide(_f64(-base / 2), s)), _f64(1.0))
    n = op.astype(op.subtract(_f64(2.0), op.multiply(_f64(2.0), first)), "int64")
    n = bb.normalize(op.reshape(n, [1]))
    taps = checked_shape(bb, n, _i64([0]), "taps").values[0]
    return taps, index_range(bb, taps), s


def _weighted(bb: Any, plan: _Plan, data: Any, axis: int, x: Any, scale: Any, length: Any) -> Any:
    """Linear / cubic interpolation of ``data`` along ``axis`` at the coordinates ``x``."""
    from tvm import relax

    op = relax.op
    n, steps, s = _taps(bb, plan, scale)
    out = x.ty.shape.values[0]
    # taps at xi + 1 - n/2 + k (k < n), xi = ceil(x) - 1: the reference's neighbours, whose
    # distances to x are (1 - n/2 + k - ratio), ratio = x - xi in (0, 1]
    xi = bb.normalize(op.subtract(op.ceil(x), _f64(1.0)))
    ratio = op.reshape(op.subtract(x, xi), [out, 1])
    k = op.reshape(op.astype(steps, "float64"), [1, n])
    count = op.astype(op.sum(op.ones_like(steps), [0], True), "float64")  # n as a tensor
    offset = op.add(op.subtract(_f64(1.0), op.divide(op.reshape(count, [1, 1]), _f64(2.0))), k)
    weights = _kernel(plan, op.multiply(op.subtract(offset, ratio), s))
    if plan.antialias:
        weights = op.divide(weights, op.sum(weights, [1], True))
    taps = bb.normalize(op.astype(op.add(op.reshape(xi, [out, 1]), offset), "int64"))
    if plan.exclude:
        inside = op.logical_and(op.greater_equal(taps, _i64(0)),
                                op.less(taps, op.astype(length, "int64")))
        weights = op.where(inside, weights, _f64(0.0))
        total = op.sum(weights, [1], True)
        weights = op.divide(weights, op.where(op.equal(total, _f64(0.0)), _f64(1.0), total))
    dims = list(data.ty.shape.values)
    flat = op.reshape(taps, [out * n])
    gathered = op.reshape(op.take(data, flat, axis=axis, mode="clip"),
                          [*dims[:axis], out, n, *dims[axis + 1:]])
    w = op.reshape(op.astype(weights, data.ty.dtype),
                   [*([1] * axis), out, n, *([1] * (len(dims) - axis - 1))])
    return bb.normalize(op.sum(op.multiply(gathered, w), [axis + 1], False))


def convert_resize(bb: Any, x: Any, roi: Any | None, scales: Any | None, sizes: Any | None,
                   attrs: dict[str, Any]) -> Any:
    """ONNX Resize (opset 11+) with ``scales`` or ``sizes`` computed at run time."""
    from tvm import relax

    from compiler.dynshape_ops import checked_shape, dims_of, index_range, static_len
    from compiler.dynshape_pad import fill_where

    op = relax.op
    lens = [static_len(v) if v is not None else 0 for v in (scales, sizes, roi)]
    if any(n is None for n in lens):
        raise ValueError("Resize with run-time scales or sizes needs operands of static length")
    plan = _Plan(x, attrs, *[int(n or 0) for n in lens])
    dims = bb.normalize(op.astype(dims_of(bb, x), "int64"))
    operand = scales if plan.by_scales else sizes
    scale_list, size_list, bad = _scales_and_sizes(bb, plan, dims, operand)
    # the output dims, bound at run time (and checked)
    shape = checked_shape(bb, bb.normalize(op.stack(size_list, axis=0)), bad, "resized")
    work = plan.dtype if plan.dtype in ("float32", "float64") or plan.mode == "nearest" else "float32"
    y = x if work == plan.dtype else bb.normalize(op.astype(x, work))
    for i, axis in enumerate(plan.axes):
        length = _scalar(bb, dims, axis, "float64")
        roi_pair = None
        if plan.coord == "tf_crop_and_resize":
            assert roi is not None
            k = len(plan.axes)
            roi_pair = (_scalar(bb, roi, i, "float64"), _scalar(bb, roi, k + i, "float64"))
        out = shape.values[i]
        coords, outside = _coordinates(bb, plan, out, size_list[i], scale_list[i], length, roi_pair)
        if plan.mode == "nearest":
            index = _nearest_index(bb, plan.nearest, coords, scale_list[i])
            y = bb.normalize(op.take(y, index, axis=axis, mode="clip"))
        else:
            y = _weighted(bb, plan, y, axis, coords, scale_list[i], length)
        if outside is not None:
            dtype = str(y.ty.dtype)
            fill = relax.const(np.asarray(plan.extrapolation, dtype), dtype)
            y = fill_where(bb, y, axis, outside, index_range(bb, out), size_list[i], fill)
    return y if work == plan.dtype else op.astype(y, plan.dtype)
