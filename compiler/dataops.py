"""Operators whose output length depends on the input *values* (issue 29): NonMaxSuppression.

NonZero, Unique and Compress go through TVM's converters (``relax.op.nonzero`` / ``unique`` and a
``match_cast`` to a fresh symbolic dim; checked against onnxruntime, tests/compiler/test_dataops.py).
TVM's NonMaxSuppression converter is not used: it replaces a ``max_output_boxes_per_class``,
``iou_threshold`` or ``score_threshold`` that is not a constant by a default (0 boxes, 0.5, 0.0),
and its kernel estimates a row budget from the box count; the model inputs of ONNX's own cases are
exactly such run-time values. :func:`convert_nms` is a sequential TIR kernel instead, onnxruntime's
algorithm per batch and class: the boxes scoring above ``score_threshold`` (strictly; every box when
it is absent) in descending score order (ties: lower box index first), each kept unless its IoU with
a box already kept for the class exceeds ``iou_threshold``, at most ``max_output_boxes_per_class``
(<= 0 or absent: none). The kernel writes every kept (batch, class, box) row and the row count; the
output is the first ``count`` rows (a run-time dim). An ``iou_threshold`` outside [0, 1] (onnxruntime
refuses it) stops inference with an error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["clip_condition", "convert_nms", "convert_unique", "nms_kernel", "unique_kernel"]


def nms_kernel(batches: int, classes: int, boxes: int, center: bool, has_score: bool) -> Any:
    """The TIR function ``(boxes [B, N, 4] f32, scores [B, C, N] f32, max_out [1] i64, iou [1] f32,
    score [1] f32) -> (rows [B*C*N, 3] i64, count [1] i64)``."""
    from tvm.script import tirx as T

    rows = batches * classes * boxes

    @T.prim_func(private=True)
    def nms(b_in: T.handle, s_in: T.handle, m_in: T.handle, i_in: T.handle, t_in: T.handle,
            r_out: T.handle, c_out: T.handle) -> None:
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        bx = T.match_buffer(b_in, (batches, boxes, 4), "float32")
        sc = T.match_buffer(s_in, (batches, classes, boxes), "float32")
        mx = T.match_buffer(m_in, (1,), "int64")
        io = T.match_buffer(i_in, (1,), "float32")
        th = T.match_buffer(t_in, (1,), "float32")
        out = T.match_buffer(r_out, (rows, 3), "int64")
        cnt = T.match_buffer(c_out, (1,), "int64")
        order = T.alloc_buffer((boxes,), "int32")
        lo = T.alloc_buffer((boxes, 2), "float32")  # per box: x min, y min
        hi = T.alloc_buffer((boxes, 2), "float32")  # x max, y max
        kept = T.alloc_buffer((boxes,), "int32")
        st = T.alloc_buffer((4,), "int32")  # candidates, kept in class, insertion slot, suppressed
        total = T.alloc_buffer((1,), "int64")
        total[0] = T.int64(0)
        for b in T.serial(batches):
            for n in T.serial(boxes):
                if center:
                    lo[n, 0] = bx[b, n, 0] - bx[b, n, 2] / T.float32(2)
                    hi[n, 0] = bx[b, n, 0] + bx[b, n, 2] / T.float32(2)
                    lo[n, 1] = bx[b, n, 1] - bx[b, n, 3] / T.float32(2)
                    hi[n, 1] = bx[b, n, 1] + bx[b, n, 3] / T.float32(2)
                else:
                    lo[n, 0] = T.min(bx[b, n, 1], bx[b, n, 3])
                    hi[n, 0] = T.max(bx[b, n, 1], bx[b, n, 3])
                    lo[n, 1] = T.min(bx[b, n, 0], bx[b, n, 2])
                    hi[n, 1] = T.max(bx[b, n, 0], bx[b, n, 2])
            for c in T.serial(classes):
                st[0] = 0
                for n in T.serial(boxes):
                    if (not has_score) or sc[b, c, n] > th[0]:
                        # insertion into the descending order; an equal score stays behind
                        st[2] = st[0]
                        while st[2] > 0 and sc[b, c, order[T.max(st[2] - 1, 0)]] < sc[b, c, n]:
                            order[st[2]] = order[st[2] - 1]
                            st[2] = st[2] - 1
                        order[st[2]] = n
                        st[0] = st[0] + 1
                st[1] = 0
                for k in T.serial(boxes):
                    if k < st[0] and T.Cast("int64", st[1]) < mx[0]:
                        st[3] = 0
                        for j in T.serial(boxes):
                            if j < st[1] and st[3] == 0:
                                p = kept[j]
                                q = order[k]
                                ix = T.min(hi[p, 0], hi[q, 0]) - T.max(lo[p, 0], lo[q, 0])
                                iy = T.min(hi[p, 1], hi[q, 1]) - T.max(lo[p, 1], lo[q, 1])
                                inter = ix * iy
                                a1 = (hi[p, 0] - lo[p, 0]) * (hi[p, 1] - lo[p, 1])
                                a2 = (hi[q, 0] - lo[q, 0]) * (hi[q, 1] - lo[q, 1])
                                union = a1 + a2 - inter
                                if ix > T.float32(0) and iy > T.float32(0) and inter > T.float32(0) \
                                        and a1 > T.float32(0) and a2 > T.float32(0) \
                                        and union > T.float32(0) and inter / union > io[0]:
                                    st[3] = 1
                        if st[3] == 0:
                            kept[st[1]] = order[k]
                            out[total[0], 0] = T.Cast("int64", b)
                            out[total[0], 1] = T.Cast("int64", c)
                            out[total[0], 2] = T.Cast("int64", order[k])
                            total[0] = total[0] + T.int64(1)
                            st[1] = st[1] + 1
        cnt[0] = total[0]

    return nms


def _i64(values: list[int]) -> Any:
    from tvm import relax

    return relax.const(np.array(values, np.int64), "int64")


def _scalar(bb: Any, value: Any, dtype: str, default: float) -> Any:
    """``value`` (a model input, constant or None) as a [1] tensor of ``dtype``."""
    from tvm import relax

    if value is None:
        return relax.const(np.array([default], dtype), dtype)
    value = relax.op.reshape(value, [1])
    if bb.normalize(value).ty.dtype != dtype:
        value = relax.op.astype(value, dtype)
    return bb.normalize(value)


def convert_nms(bb: Any, inputs: list[Any], attrs: dict[str, Any]) -> Any:
    """ONNX NonMaxSuppression (opset 10/11) as :func:`nms_kernel` plus a run-time slice."""
    from tvm import relax

    from compiler.dynshape_ops import checked_shape

    def at(i: int) -> Any:
        return inputs[i] if i < len(inputs) else None

    boxes, scores = at(0), at(1)
    bty, sty = boxes.ty, scores.ty
    if bty.ndim != 3 or sty.ndim != 3 or bty.shape is None or sty.shape is None:
        raise ValueError("NonMaxSuppression needs boxes [B, N, 4] and scores [B, C, N] of known shapes")
    (nb, n, four), (sb, nc, sn) = ([int(d) for d in t.shape.values] for t in (bty, sty))
    if four != 4 or nb != sb or n != sn or 0 in (nb, nc, n):
        raise ValueError(f"NonMaxSuppression boxes {[nb, n, four]} and scores {[sb, nc, sn]} do not match")
    center = int(attrs.get("center_point_box", 0))
    if center not in (0, 1):
        raise ValueError(f"NonMaxSuppression center_point_box {center} is neither 0 nor 1")
    f32 = [bb.normalize(relax.op.astype(x, "float32")) if x.ty.dtype != "float32" else x
           for x in (boxes, scores)]
    mx = _scalar(bb, at(2), "int64", 0)
    iou = _scalar(bb, at(3), "float32", 0.0)
    thr = _scalar(bb, at(4), "float32", 0.0)
    rows = nb * nc * n
    gv = bb.add_func(nms_kernel(nb, nc, n, bool(center), at(4) is not None), "fractal_nms")
    res = bb.emit(relax.call_tir(gv, [*f32, mx, iou, thr],
                                 [relax.TensorType([rows, 3], "int64"), relax.TensorType([1], "int64")]))
    sel, count = bb.emit(relax.TupleGetItem(res, 0)), bb.emit(relax.TupleGetItem(res, 1))
    bad = relax.op.logical_or(relax.op.less(iou, relax.const(0.0, "float32")),
                              relax.op.greater(iou, relax.const(1.0, "float32")))
    bad = bb.normalize(relax.op.astype(bad, "int64"))
    dims = bb.normalize(relax.op.concat([count, relax.const(np.array([3], np.int64), "int64")], axis=0))
    rows_dim = checked_shape(bb, count, bad, "nms_selected").values[0]
    zeros = relax.const(np.zeros(2, np.int64), "int64")
    ones = relax.const(np.ones(2, np.int64), "int64")
    cut = bb.normalize(relax.op.dynamic_strided_slice(sel, zeros, dims, ones))
    return relax.op.reshape(cut, relax.ShapeExpr([rows_dim, 3]))


def unique_kernel(outer: int, length: int, inner: int, dtype: str, ordered: bool) -> Any:
    """The TIR function ``(x [O, L, I]) -> (y [O, L, I], indices [L], inverse [L], counts [L],
    count [1])``: the distinct slices ``x[:, k, :]`` (in ascending lexicographic order with
    ``ordered``, else in order of first occurrence) in the first ``count`` rows of ``y``, where
    each first occurs, which one each slice is, and how often each occurs. O(L^2 * O * I)."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, check_well_formed=False)
    def unique(x_in: T.handle, y_out: T.handle, i_out: T.handle, v_out: T.handle, c_out: T.handle,
               n_out: T.handle) -> None:
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        x = T.match_buffer(x_in, (outer, length, inner), dtype)
        y = T.match_buffer(y_out, (outer, length, inner), dtype)
        idx = T.match_buffer(i_out, (length,), "int64")
        inv = T.match_buffer(v_out, (length,), "int64")
        counts = T.match_buffer(c_out, (length,), "int64")
        num = T.match_buffer(n_out, (1,), "int64")
        with T.sblock("root"):  # (a root block: RewriteDataflowReshape inspects one-input kernels)
            first = T.alloc_buffer((length,), "int32")  # the first slice equal to slice i
            rank = T.alloc_buffer((length,), "int32")  # a first slice's row in the output
            st = T.alloc_buffer((3,), "int32")  # equal so far / decided / less
            total = T.alloc_buffer((1,), "int64")
            total[0] = T.int64(0)
            for i in T.serial(length):
                first[i] = i
                for j in T.serial(length):
                    if j < i and first[i] == i:
                        st[0] = 1
                        for o in T.serial(outer):
                            for e in T.serial(inner):
                                if x[o, j, e] != x[o, i, e]:
                                    st[0] = 0
                        if st[0] == 1:
                            first[i] = j
                if first[i] == i:
                    total[0] = total[0] + T.int64(1)
            for i in T.serial(length):
                counts[i] = T.int64(0)
                rank[i] = 0
                if first[i] == i:
                    for k in T.serial(length):
                        if first[k] == k and k != i:
                            if ordered:
                                st[1] = 0
                                st[2] = 0
                                for o in T.serial(outer):
                                    for e in T.serial(inner):
                                        if st[1] == 0 and x[o, k, e] != x[o, i, e]:
                                            st[1] = 1
                                            if x[o, k, e] < x[o, i, e]:
                                                st[2] = 1
                                rank[i] = rank[i] + st[2]
                            elif k < i:
                                rank[i] = rank[i] + 1
            for i in T.serial(length):
                r = rank[first[i]]
                inv[i] = T.Cast("int64", r)
                counts[r] = counts[r] + T.int64(1)
                if first[i] == i:
                    idx[r] = T.Cast("int64", i)
                    for o in T.serial(outer):
                        for e in T.serial(inner):
                            y[o, r, e] = x[o, i, e]
            num[0] = total[0]

    return unique


def convert_unique(bb: Any, inputs: list[Any], attrs: dict[str, Any]) -> Any:
    """ONNX Unique (opset 11) as :func:`unique_kernel` plus run-time slices (TVM's converter calls
    numpy at run time, whose ``inverse`` has the input's shape under numpy 2: a shape mismatch)."""
    from tvm import relax

    from compiler.dynshape_ops import checked_shape

    x = inputs[0]
    ty = x.ty
    if ty.shape is None or ty.ndim < 0:
        raise ValueError("Unique needs an input of known shape")
    dims = [int(d) for d in ty.shape.values]
    axis = attrs.get("axis")
    if axis is None:
        outer, length, inner = 1, int(np.prod(dims)), 1
    else:
        axis = int(axis)
        if not -len(dims) <= axis < len(dims):
            raise ValueError(f"Unique axis {axis} is out of range for a rank-{len(dims)} input")
        axis %= len(dims)
        outer, length, inner = int(np.prod(dims[:axis])), dims[axis], int(np.prod(dims[axis + 1:]))
    if length == 0:
        raise ValueError("Unique of an empty input")
    dtype = str(ty.dtype)
    work = relax.op.astype(x, "int8") if dtype == "bool" else x  # TIR orders no bool
    wdt = "int8" if dtype == "bool" else dtype
    flat = bb.normalize(relax.op.reshape(work, [outer, length, inner]))
    gv = bb.add_func(unique_kernel(outer, length, inner, wdt, bool(attrs.get("sorted", 1))), "fractal_unique")
    res = bb.emit(relax.call_tir(gv, [flat], [relax.TensorType([outer, length, inner], wdt),
                                              *[relax.TensorType([length], "int64")] * 3,
                                              relax.TensorType([1], "int64")]))
    y_all, idx, inv, counts, num = (bb.emit(relax.TupleGetItem(res, i)) for i in range(5))
    n = checked_shape(bb, num, _i64([0]), "unique").values[0]

    def first_rows(t: Any, around: tuple[int, int] | None) -> Any:
        """``t``'s first ``num`` rows: along axis 1 of [O, L, I] (``around`` = (O, I)), or of [L]."""
        parts = [num] if around is None else [_i64([around[0]]), num, _i64([around[1]])]
        rank = len(parts)
        ends = bb.normalize(relax.op.concat(parts, axis=0)) if rank > 1 else num
        return bb.normalize(relax.op.dynamic_strided_slice(t, _i64([0] * rank), ends, _i64([1] * rank)))

    y = first_rows(y_all, (outer, inner))
    y_shape = [n] if axis is None else [*dims[:axis], n, *dims[axis + 1:]]
    y = relax.op.reshape(y, relax.ShapeExpr(y_shape))
    if dtype == "bool":
        y = relax.op.astype(y, "bool")
    outs = [bb.normalize(y),
            bb.normalize(relax.op.reshape(first_rows(idx, None), relax.ShapeExpr([n]))),
            inv,
            bb.normalize(relax.op.reshape(first_rows(counts, None), relax.ShapeExpr([n])))]
    wanted = int(attrs.get("tvm_custom", {}).get("num_outputs", 1))
    return outs[0] if wanted == 1 else relax.Tuple(outs[:wanted])


def clip_condition(bb: Any, data: Any, cond: Any, axis: int | None) -> Any:
    """Compress's ``condition`` cut to the length of the selected axis (of the flattened input
    without ``axis``): onnxruntime ignores entries past it, TVM's ``take`` would read past the input."""
    from tvm import relax

    dty, cty = data.ty, cond.ty
    if dty.shape is None or cty.shape is None or cty.ndim != 1:
        return cond
    dims = [int(d) for d in dty.shape.values]
    size = int(np.prod(dims)) if axis is None else dims[int(axis) % len(dims)] if dims else 1
    if int(cty.shape.values[0]) <= size:
        return cond
    return bb.normalize(relax.op.strided_slice(cond, [0], [0], [size]))
