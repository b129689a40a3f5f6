"""Pad and CenterCropPad whose ``pads`` / ``shape`` is a model input (see :mod:`compiler.dynshape`).

TVM's Pad converter needs constant pads ("Dynamic pads are not supported yet"), and
CenterCropPad is otherwise expanded into ONNX's function body, whose Pad takes pads computed from
the run-time shape; so both are the project's converters. Each padded axis is one gather: output
index ``j`` reads input position ``src(j)`` (clamped for ``edge``, modulo the length for ``wrap``,
mirrored for ``reflect``; for ``constant`` the positions outside the input take the constant).
Negative pads crop first and the padding then repeats the cropped input, as onnxruntime does.

Refused at run time (onnxruntime refuses them too): an output dim below 1, a cropped extent below
1 for ``edge`` / ``wrap`` / ``reflect``, and for ``reflect`` an extent below 2 or a pad longer than
the extent minus 1. Every index is made safe before the gather (the flag still stops inference).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["convert_pad", "convert_center_crop_pad"]

_MODES = ("constant", "edge", "reflect", "wrap")


def _i64(value: Any) -> Any:
    from tvm import relax

    return relax.const(np.asarray(value, np.int64), "int64")


def _axes(attr_axes: Any, rank: int, what: str) -> list[int]:
    axes = [int(a) + rank if int(a) < 0 else int(a) for a in attr_axes]
    if len(set(axes)) != len(axes) or any(not 0 <= a < rank for a in axes):
        raise ValueError(f"{what} axes {list(attr_axes)} are repeated or out of range for a rank-{rank} "
                         "input")
    return axes


def _const_axes(axes: Any, rank: int, what: str) -> list[int]:
    """``axes`` given as an input: it must be a constant."""
    import tvm

    if axes is None:
        return list(range(rank))
    if not isinstance(axes, tvm.ir.GenericConst):
        raise ValueError(f"{what} with run-time axes is not supported (make axes a constant)")
    return _axes(axes.value.numpy().reshape(-1).tolist(), rank, what)


def _pad_axes(bb: Any, x: Any, axes: list[int], before: list[Any], after: list[Any], mode: str,
              value: Any | None, prefix: str, refused: Any | None = None) -> Any:
    """``x`` padded (negative: cropped) on ``axes`` by the int64 rank-0 tensors ``before`` /
    ``after``, with the output dims bound and checked at run time (and the bool ``refused``)."""
    from tvm import relax

    from compiler.dynshape_ops import any_of, checked_shape, dims_of, index_range

    op = relax.op
    zero, one = _i64(0), _i64(1)
    dims = dims_of(bb, x)
    plans, outs, bad = [], [], []
    for a, pb, pe in zip(axes, before, after, strict=True):
        d = bb.normalize(op.take(dims, _i64(a), axis=0, mode="clip"))
        cut_b, cut_e = op.maximum(op.negative(pb), zero), op.maximum(op.negative(pe), zero)
        grow_b, grow_e = bb.normalize(op.maximum(pb, zero)), bb.normalize(op.maximum(pe, zero))
        extent = bb.normalize(op.subtract(op.subtract(d, cut_b), cut_e))
        out = bb.normalize(op.add(op.add(d, pb), pe))
        bad.append(op.less(out, one))
        if mode != "constant":
            bad.append(op.less(extent, one))
        if mode == "reflect":  # an axis padded by reflection needs 2 values, and pads below the extent
            most = op.subtract(extent, one)
            grows = op.greater(op.add(grow_b, grow_e), zero)
            bad.extend([op.logical_and(grows, op.less(extent, _i64(2))), op.greater(grow_b, most),
                        op.greater(grow_e, most)])
        plans.append((a, bb.normalize(cut_b), grow_b, extent))
        outs.append(out)
    if refused is not None:
        bad.append(refused)
    flag = any_of(bb, op.concat([op.reshape(b, [1]) for b in bad], axis=0))
    shape = checked_shape(bb, bb.normalize(op.stack(outs, axis=0)), flag, prefix)
    y = x
    for (a, cut_b, grow_b, extent), out, size in zip(plans, shape.values, outs, strict=True):
        # q: the position in the cropped input of each output index
        every = index_range(bb, out)
        q = bb.normalize(op.subtract(every, grow_b))
        safe = op.maximum(extent, one)
        if mode == "constant":
            pos = q
        elif mode == "edge":
            pos = op.minimum(op.maximum(q, zero), op.subtract(safe, one))
        elif mode == "wrap":
            pos = op.floor_mod(q, safe)
        else:  # reflect: period 2 (extent - 1)
            period = op.maximum(op.multiply(_i64(2), op.subtract(extent, one)), one)
            m = bb.normalize(op.floor_mod(q, period))
            pos = op.where(op.less(m, extent), m, op.subtract(period, m))
        src = bb.normalize(op.add(pos, cut_b))
        taken = bb.normalize(op.take(y, src, axis=a, mode="clip"))
        if mode == "constant":
            outside = bb.normalize(op.logical_or(op.less(q, zero), op.greater_equal(q, extent)))
            dtype = str(x.ty.dtype)
            fill = value if value is not None else relax.const(np.zeros((), dtype), dtype)
            taken = fill_where(bb, taken, a, outside, every, size, fill)
        y = taken
    return y


def fill_where(bb: Any, y: Any, axis: int, outside: Any, every: Any, size: Any, fill: Any) -> Any:
    """``y`` with the slices along ``axis`` where the bool [size] ``outside`` holds set to the scalar
    ``fill``: one gather from ``y`` with a slice of ``fill`` appended (``every``: 0 .. size - 1).
    A gather, not a broadcast ``where``: the mask's and ``y``'s run-time dims need not be provably
    equal."""
    from tvm import relax

    op = relax.op
    row = op.full_like(op.strided_slice(y, [axis], [0], [1]), fill)
    extended = op.concat([y, row], axis=axis)
    index = op.where(outside, op.astype(size, "int64"), every)
    return bb.normalize(op.take(extended, bb.normalize(index), axis=axis, mode="clip"))


def convert_pad(bb: Any, x: Any, pads: Any, value: Any | None, axes: Any | None, mode: str) -> Any:
    """ONNX Pad (opset 11+) with run-time ``pads`` (and constant or run-time ``axes``)."""
    import tvm
    from tvm import relax

    from compiler.dynshape_ops import static_len

    op = relax.op
    if x.ty.ndim < 0:
        raise ValueError("Pad with run-time pads needs a known input rank")
    if mode not in _MODES:
        raise ValueError(f"Pad mode {mode!r} is not defined by ONNX")
    rank = int(x.ty.ndim)
    pads = pads if pads.ty.dtype == "int64" else bb.normalize(op.astype(pads, "int64"))
    if axes is not None and not isinstance(axes, tvm.ir.GenericConst):
        before, after, refused = _run_time_axes(bb, pads, axes, rank)
        every = list(range(rank))
        return _pad_axes(bb, x, every, before, after, mode, _fill(bb, x, value), "padded", refused)
    chosen = _const_axes(axes, rank, "Pad")
    n = static_len(pads)
    if n != 2 * len(chosen):
        raise ValueError(f"Pad has {n} pads for {len(chosen)} axes (needs {2 * len(chosen)})")
    k = len(chosen)
    before = [bb.normalize(op.take(pads, _i64(i), axis=0, mode="clip")) for i in range(k)]
    after = [bb.normalize(op.take(pads, _i64(k + i), axis=0, mode="clip")) for i in range(k)]
    return _pad_axes(bb, x, chosen, before, after, mode, _fill(bb, x, value), "padded")


def _fill(bb: Any, x: Any, value: Any | None) -> Any | None:
    """Pad's constant ``value`` as a scalar of ``x``'s dtype (None: absent)."""
    from tvm import relax

    op = relax.op
    if value is None:
        return None
    if isinstance(value.ty, relax.TensorType) and value.ty.ndim not in (0, -1):
        value = op.reshape(value, [])
    if value.ty.dtype != x.ty.dtype:
        value = op.astype(value, x.ty.dtype)
    return bb.normalize(value)


def _run_time_axes(bb: Any, pads: Any, axes: Any, rank: int) -> tuple[list[Any], list[Any], Any]:
    """Pad's run-time ``axes`` (k of them, negative from the end): the pads before / after every
    axis of the input (0 where none is named), and a bool flag: an axis repeated or out of range."""
    from tvm import relax

    from compiler.dynshape_ops import axes_mask, static_len

    op = relax.op
    k = static_len(axes)
    if k is None or static_len(pads) != 2 * k:
        raise ValueError(f"Pad has {static_len(pads)} pads for {k} run-time axes (needs twice as many)")
    _, repeated = axes_mask(bb, axes, rank)
    a = axes if axes.ty.dtype == "int64" else bb.normalize(op.astype(axes, "int64"))
    norm = op.where(op.less(a, _i64(0)), op.add(a, _i64(rank)), a)
    hits = bb.normalize(op.astype(op.equal(op.reshape(norm, [k, 1]),
                                           op.reshape(op.arange(0, rank, 1, "int64"), [1, rank])), "int64"))
    sides = []
    for lo in (0, k):
        part = op.reshape(op.strided_slice(pads, [0], [lo], [lo + k]), [k, 1])
        full = bb.normalize(op.sum(op.multiply(hits, part), [0], False))  # [rank]
        sides.append([bb.normalize(op.take(full, _i64(i), axis=0, mode="clip")) for i in range(rank)])
    return sides[0], sides[1], bb.normalize(op.greater(repeated, _i64([0])))


def convert_center_crop_pad(bb: Any, x: Any, shape: Any, attr_axes: Any | None) -> Any:
    """ONNX CenterCropPad with a run-time target ``shape``: centred crop where the input is
    larger, centred zero padding where it is smaller (the extra element of an odd difference goes
    to the end)."""
    from tvm import relax

    from compiler.dynshape_ops import dims_of, static_len

    op = relax.op
    if x.ty.ndim < 0:
        raise ValueError("CenterCropPad with a run-time shape needs a known input rank")
    rank = int(x.ty.ndim)
    axes = _axes(attr_axes if attr_axes is not None else range(rank), rank, "CenterCropPad")
    if static_len(shape) != len(axes):
        raise ValueError(f"CenterCropPad shape has {static_len(shape)} values for {len(axes)} axes")
    shape = shape if shape.ty.dtype == "int64" else bb.normalize(op.astype(shape, "int64"))
    dims = dims_of(bb, x)
    before, after = [], []
    for i, a in enumerate(axes):
        want = bb.normalize(op.take(shape, _i64(i), axis=0, mode="clip"))
        d = bb.normalize(op.take(dims, _i64(a), axis=0, mode="clip"))
        grow = op.subtract(want, d)
        # pad: (want - d) // 2 before; crop: (d - want) // 2 removed before
        pb = bb.normalize(op.where(op.greater_equal(want, d), op.floor_divide(grow, _i64(2)),
                                   op.negative(op.floor_divide(op.negative(grow), _i64(2)))))
        before.append(pb)
        after.append(bb.normalize(op.subtract(grow, pb)))
    return _pad_axes(bb, x, axes, before, after, "constant", None, "cropped")
