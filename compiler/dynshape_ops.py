"""Relax converters for shape operators whose shape operand is a model input (see
:mod:`compiler.dynshape`): Reshape, Expand, Squeeze, Unsqueeze, Slice.

Each computes its output dims as an int64 tensor at run time, together with a ``bad`` flag for
values ONNX forbids (onnxruntime refuses them): ``checked_shape`` matches ``[*dims, bad]`` against
``[d0, d1, ..., 0]`` in one ``match_cast``, so invalid values stop inference with an error (the
artifact turns it into an InputError) instead of giving an answer. Kernels that could crash on an
invalid value (a zero slice step) get a safe value first; the check still fails afterwards.
TVM's own dynamic converters were not used for these: Expand broadcast to the shape operand
instead of the broadcast of both shapes, and Squeeze / Unsqueeze / Slice accepted non-unit,
duplicate or out-of-range axes silently (measured against onnxruntime).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MAX_RUNTIME_ELEMENTS", "budget_operand", "over_budget",
           "checked_shape", "index_range", "convert_reshape", "convert_expand", "convert_squeeze",
           "convert_unsqueeze", "convert_slice", "convert_split", "convert_topk", "convert_affine_grid",
           "static_len", "axes_mask", "convert_range", "convert_onehot"]


# The most elements a tensor whose dims are decided at run time may have (256 MiB of float32).
# Shape operands arrive with the request: without a bound, one request could make the node
# allocate what the board does not have, or dims whose product overflows int64 (a small buffer
# written as a huge one: heap corruption, measured before this check). Over it: an InputError.
MAX_RUNTIME_ELEMENTS = 1 << 26


def _i64(value: Any) -> Any:
    from tvm import relax

    return relax.const(np.asarray(value, np.int64), "int64")


def over_budget(bb: Any, dims: Any, *factors: Any) -> Any:
    """int64 [1]: 1 if a dim of the int64 [n] tensor ``dims`` is negative or the product of its
    dims (times each int64 [n] tensor in ``factors``, elementwise) exceeds
    :data:`MAX_RUNTIME_ELEMENTS`. The product is taken in float64, which cannot wrap."""
    from tvm import relax

    size = relax.op.astype(dims, "float64")
    negative = relax.op.less(dims, _i64(0))
    for f in factors:
        size = relax.op.multiply(size, relax.op.astype(f, "float64"))
        negative = relax.op.logical_or(negative, relax.op.less(f, _i64(0)))
    total = relax.op.prod(relax.op.abs(size), [0], True)
    big = relax.op.greater(total, relax.const(np.asarray([MAX_RUNTIME_ELEMENTS], np.float64), "float64"))
    return _or(bb, any_of(bb, bb.normalize(negative)), bb.normalize(relax.op.astype(big, "int64")))


def static_len(x: Any) -> int | None:
    """The static length of a 1-D tensor, or None."""
    from tvm import relax, tirx

    ty = x.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim != 1 or ty.shape is None:
        return None
    n = ty.shape.values[0]
    return int(n.value) if isinstance(n, tirx.IntImm) else None


def _rank(x: Any) -> int | None:
    from tvm import relax

    ty = x.ty
    return int(ty.ndim) if isinstance(ty, relax.TensorType) and ty.ndim >= 0 else None


def dims_of(bb: Any, x: Any) -> Any:
    """``x``'s shape as an int64 [rank] tensor."""
    from tvm import relax

    return bb.normalize(relax.op.shape_to_tensor(relax.op.shape_of(x)))


def _int64(bb: Any, x: Any) -> Any:
    from tvm import relax

    return x if x.ty.dtype == "int64" else bb.normalize(relax.op.astype(x, "int64"))


def any_of(bb: Any, cond: Any) -> Any:
    """int64 [1]: 1 if any element of the bool tensor ``cond`` is true."""
    from tvm import relax

    if _rank(cond) == 0:
        cond = relax.op.reshape(cond, [1])
    return bb.normalize(relax.op.max(relax.op.astype(cond, "int64"), [0], True))


def checked_shape(bb: Any, dims: Any, bad: Any, prefix: str) -> Any:
    """A ShapeExpr of run-time dims from the int64 [n] tensor ``dims``, bound only when the int64
    [1] flag ``bad`` is 0 and the dims are within :data:`MAX_RUNTIME_ELEMENTS` (else the VM
    raises)."""
    from tvm import relax, tirx

    n = static_len(dims)
    assert n is not None
    if n:
        bad = _or(bb, bad, over_budget(bb, dims))
    both = bb.normalize(relax.op.concat([dims, bad], axis=0))
    both = bb.match_cast(both, relax.TensorType([n + 1], "int64"))
    shape = bb.emit(relax.op.tensor_to_shape(both))
    names = [tirx.Var(f"{prefix}_{i}", "int64") for i in range(n)]
    bb.match_cast(shape, relax.ShapeType([*names, tirx.IntImm("int64", 0)]))
    return relax.ShapeExpr(names)


def budget_operand(bb: Any, op: str, inputs: list[Any]) -> Any:
    """The run-time shape operand of TVM's own Tile (repeats) or ConstantOfShape (shape) converter,
    passed through :func:`checked_shape` with the size of the output they make from it."""
    from tvm import relax

    if op == "ConstantOfShape":
        shape = _int64(bb, inputs[0])
        n = static_len(shape)
        if n is None:
            raise ValueError("ConstantOfShape with a run-time shape needs its static length")
        return checked_shape(bb, shape, _i64([0]), "filled")
    reps = _int64(bb, inputs[1])
    n, rank = static_len(reps), _rank(inputs[0])
    if n is None or rank is None or n != rank:
        raise ValueError("Tile with run-time repeats needs as many repeats as the input's rank")
    bad = over_budget(bb, dims_of(bb, inputs[0]), reps)
    return bb.normalize(relax.op.shape_to_tensor(checked_shape(bb, reps, bad, "repeats")))


def index_range(bb: Any, n: Any) -> Any:
    """int64 [n]: 0 .. n - 1 (``n`` a dim bound by :func:`checked_shape`, or an int)."""
    from tvm import relax

    return bb.normalize(relax.op.arange(0, n, 1, "int64"))


def axes_mask(bb: Any, axes: Any, rank: int) -> tuple[Any, Any]:
    """(int64 [rank] 0/1 mask of the axes named by ``axes`` (negative from the end), int64 [1]
    flag: some axis is out of range or repeated)."""
    from tvm import relax

    k = static_len(axes)
    assert k is not None
    axes = _int64(bb, axes)
    norm = bb.normalize(relax.op.where(relax.op.less(axes, _i64(0)), relax.op.add(axes, _i64(rank)), axes))
    every = relax.op.reshape(relax.op.arange(0, rank, 1, "int64"), [1, rank])
    hits = relax.op.astype(relax.op.equal(relax.op.reshape(norm, [k, 1]), every), "int64")
    mask = bb.normalize(relax.op.max(hits, [0], False))
    count = relax.op.sum(mask, [0], True)
    return mask, bb.normalize(relax.op.astype(relax.op.not_equal(count, _i64([k])), "int64"))


def compact(bb: Any, dims: Any, keep: Any, rank: int, out_rank: int) -> Any:
    """int64 [out_rank]: the entries of ``dims`` where ``keep`` (int64 0/1 [rank]) is 1, in order
    (zeros past the kept ones)."""
    from tvm import relax

    if out_rank == 0:
        return _i64(np.zeros(0, np.int64))
    pos = bb.normalize(relax.op.cumsum(keep, axis=0))
    slots = relax.op.reshape(relax.op.arange(1, out_rank + 1, 1, "int64"), [1, out_rank])
    sel = relax.op.astype(relax.op.equal(relax.op.reshape(pos, [rank, 1]), slots), "int64")
    sel = relax.op.multiply(sel, relax.op.reshape(keep, [rank, 1]))
    picked = relax.op.multiply(sel, relax.op.reshape(dims, [rank, 1]))
    return bb.normalize(relax.op.sum(picked, [0], False))


def _or(bb: Any, *flags: Any) -> Any:
    from tvm import relax

    out = flags[0]
    for f in flags[1:]:
        out = relax.op.maximum(out, f)
    return bb.normalize(out)


def convert_reshape(bb: Any, x: Any, shape: Any, allowzero: bool) -> Any:
    from tvm import relax

    r, n = _rank(x), static_len(shape)
    if r is None or n is None:
        raise ValueError("Reshape with a run-time shape needs a known input rank and shape length")
    s = _int64(bb, shape)
    d = dims_of(bb, x)
    if not allowzero:  # 0 copies the input's dim (a sentinel -2 past its rank fails the check)
        ext = d if n == r else (relax.op.strided_slice(d, [0], [0], [n]) if n < r else
                                relax.op.concat([d, _i64([-2] * (n - r))], axis=0))
        s = bb.normalize(relax.op.where(relax.op.equal(s, _i64(0)), ext, s))
    infer = bb.normalize(relax.op.equal(s, _i64(-1)))
    known = relax.op.prod(relax.op.where(infer, _i64(1), s), [0], True)
    numel = bb.normalize(relax.op.prod(d, [0], True) if r > 0 else _i64([1]))
    fill = relax.op.floor_divide(numel, relax.op.maximum(known, _i64(1)))
    out = bb.normalize(relax.op.where(infer, fill, s))
    several = relax.op.astype(relax.op.greater(relax.op.sum(relax.op.astype(infer, "int64"), [0], True),
                                               _i64([1])), "int64")
    size = relax.op.prod(out, [0], True) if n > 0 else _i64([1])
    wrong_size = relax.op.astype(relax.op.not_equal(size, numel), "int64")
    bad = _or(bb, several, any_of(bb, relax.op.less(s, _i64(-1))), wrong_size)
    return relax.op.reshape(x, checked_shape(bb, out, bad, "reshape"))


def convert_expand(bb: Any, x: Any, shape: Any) -> Any:
    from tvm import relax

    r, n = _rank(x), static_len(shape)
    if r is None or n is None:
        raise ValueError("Expand with a run-time shape needs a known input rank and shape length")
    rank = max(r, n)
    s = _int64(bb, shape)
    d = dims_of(bb, x)
    if r < rank:
        d = bb.normalize(relax.op.concat([_i64([1] * (rank - r)), d], axis=0))
        x = relax.op.expand_dims(x, list(range(rank - r)))
    if n < rank:
        s = bb.normalize(relax.op.concat([_i64([1] * (rank - n)), s], axis=0))
    one_d, one_s = relax.op.equal(d, _i64(1)), relax.op.equal(s, _i64(1))
    fits = relax.op.logical_or(relax.op.equal(d, s), relax.op.logical_or(one_d, one_s))
    out = bb.normalize(relax.op.where(one_d, s, d))
    bad = _or(bb, any_of(bb, relax.op.logical_not(fits)), any_of(bb, relax.op.less(s, _i64(0))))
    return relax.op.broadcast_to(x, checked_shape(bb, out, bad, "expand"))


def convert_squeeze(bb: Any, x: Any, axes: Any) -> Any:
    from tvm import relax

    r, k = _rank(x), static_len(axes)
    if r is None or k is None:
        raise ValueError("Squeeze with run-time axes needs a known input rank and axes length")
    if k == 0:
        return relax.op.squeeze(x)
    if k > r:
        raise ValueError(f"Squeeze of {k} axes of a rank-{r} input")
    d = dims_of(bb, x)
    mask, bad = axes_mask(bb, axes, r)
    not_unit = relax.op.logical_and(relax.op.astype(mask, "bool"), relax.op.not_equal(d, _i64(1)))
    keep = bb.normalize(relax.op.subtract(_i64(1), mask))
    out = compact(bb, d, keep, r, r - k)
    return relax.op.reshape(x, checked_shape(bb, out, _or(bb, bad, any_of(bb, not_unit)), "squeeze"))


def convert_unsqueeze(bb: Any, x: Any, axes: Any) -> Any:
    from tvm import relax

    r, k = _rank(x), static_len(axes)
    if r is None or k is None:
        raise ValueError("Unsqueeze with run-time axes needs a known input rank and axes length")
    rank = r + k
    d = dims_of(bb, x)
    mask, bad = axes_mask(bb, axes, rank)
    keep = bb.normalize(relax.op.subtract(_i64(1), mask))
    if r == 0:
        out = _i64([1] * rank)
    else:
        # out[i] = 1 on an inserted axis, else the next input dim: the (pos[i])-th one
        pos = bb.normalize(relax.op.cumsum(keep, axis=0))
        slots = relax.op.reshape(relax.op.arange(1, r + 1, 1, "int64"), [1, r])
        sel = relax.op.astype(relax.op.equal(relax.op.reshape(pos, [rank, 1]), slots), "int64")
        taken = relax.op.sum(relax.op.multiply(sel, relax.op.reshape(d, [1, r])), [1], False)
        out = bb.normalize(relax.op.where(relax.op.astype(mask, "bool"), _i64(1), taken))
    return relax.op.reshape(x, checked_shape(bb, out, bad, "unsqueeze"))


def convert_slice(bb: Any, x: Any, starts: Any, ends: Any, axes: Any | None, steps: Any | None) -> Any:
    from tvm import relax

    r, k = _rank(x), static_len(starts)
    if r is None or k is None or static_len(ends) != k:
        raise ValueError("Slice with run-time operands needs a known input rank and operand lengths")
    axes = _i64(list(range(k))) if axes is None else axes
    steps = _i64([1] * k) if steps is None else _int64(bb, steps)
    if static_len(axes) != k or static_len(steps) != k:
        raise ValueError("Slice operands differ in length")
    d = dims_of(bb, x)
    mask, bad = axes_mask(bb, axes, r)
    bad = _or(bb, bad, any_of(bb, relax.op.equal(steps, _i64(0))))
    norm = relax.op.where(relax.op.less(_int64(bb, axes), _i64(0)), relax.op.add(_int64(bb, axes), _i64(r)),
                          _int64(bb, axes))
    every = relax.op.reshape(relax.op.arange(0, r, 1, "int64"), [1, r])
    hits = bb.normalize(relax.op.astype(relax.op.equal(relax.op.reshape(norm, [k, 1]), every), "int64"))

    def spread(v: Any) -> Any:  # [k] per named axis -> [r] per axis (0 where not named)
        return relax.op.sum(relax.op.multiply(hits, relax.op.reshape(_int64(bb, v), [k, 1])), [0], False)

    named = relax.op.astype(mask, "bool")
    begin = bb.normalize(relax.op.where(named, spread(starts), _i64(0)))
    end = bb.normalize(relax.op.where(named, spread(ends), d))
    step = relax.op.where(named, spread(steps), _i64(1))
    step = bb.normalize(relax.op.where(relax.op.equal(step, _i64(0)), _i64(1), step))  # never a 0 step
    # the check goes on the input: the slice's own output shape is not available to shape code
    x = bb.normalize(relax.op.reshape(x, checked_shape(bb, d, bad, "sliced")))
    return relax.op.dynamic_strided_slice(x, begin, end, step)


def convert_split(bb: Any, x: Any, split: Any, axis: int, n_out: int) -> Any:
    """ONNX Split (opset 13+) with run-time ``split``: ``n_out`` pieces along ``axis`` (a tuple);
    a negative length or lengths that do not sum to the dim are refused at run time."""
    from tvm import relax

    r, k = _rank(x), static_len(split)
    if r is None or k is None:
        raise ValueError("Split with a run-time split needs a known input rank and split length")
    if k != n_out:
        raise ValueError(f"Split has {k} lengths for {n_out} outputs")
    if not -r <= axis < r:
        raise ValueError(f"Split axis {axis} is out of range for a rank-{r} input")
    axis = axis + r if axis < 0 else axis
    s = _int64(bb, split)
    d = dims_of(bb, x)
    op = relax.op
    size = op.reshape(op.take(d, _i64(axis), axis=0, mode="clip"), [1])
    bad = _or(bb, any_of(bb, op.less(s, _i64(0))),
              op.astype(op.not_equal(op.sum(s, [0], True), size), "int64"))
    ends = bb.normalize(op.cumsum(s, axis=0))
    at = _i64(np.eye(r, dtype=np.int64)[axis])  # 1 on the split axis
    pieces = []
    for i in range(k):
        length = op.take(s, _i64(i), axis=0, mode="clip")
        first = op.subtract(op.take(ends, _i64(i), axis=0, mode="clip"), length)
        begin = bb.normalize(op.multiply(at, first))
        dims = bb.normalize(op.where(op.astype(at, "bool"), length, d))
        end = bb.normalize(op.add(begin, dims))
        piece = bb.normalize(op.dynamic_strided_slice(x, begin, end, _i64([1] * r)))
        pieces.append(bb.normalize(op.reshape(piece, checked_shape(bb, dims, bad, f"split{i}"))))
    return relax.Tuple(pieces)


def convert_topk(bb: Any, x: Any, k: Any, axis: int, largest: bool, sort: bool) -> Any:
    """ONNX TopK (opset 10+) with a run-time ``k``: the whole axis sorted (stable: among equal
    values the lower index first, as ONNX asks), then the first ``k``; ``k`` outside [0, dim] is
    refused at run time."""
    from tvm import relax

    r, n = _rank(x), static_len(k) if _rank(k) == 1 else (1 if _rank(k) == 0 else None)
    if r is None or n != 1:
        raise ValueError("TopK with a run-time k needs a known input rank and a one-element k")
    if not -r <= axis < r:
        raise ValueError(f"TopK axis {axis} is out of range for a rank-{r} input")
    if not sort:
        raise ValueError("TopK with sorted=0 is not supported")
    axis = axis + r if axis < 0 else axis
    kk = bb.normalize(relax.op.reshape(_int64(bb, k), [1]))
    d = dims_of(bb, x)
    size = relax.op.reshape(relax.op.take(d, _i64(axis), axis=0, mode="clip"), [1])
    bad = _or(bb, relax.op.astype(relax.op.less(kk, _i64([0])), "int64"),
              relax.op.astype(relax.op.greater(kk, size), "int64"))
    at = _i64(np.eye(r, dtype=np.int64)[axis])
    dims = bb.normalize(relax.op.where(relax.op.astype(at, "bool"), relax.op.broadcast_to(kk, [r]), d))
    shape = checked_shape(bb, dims, bad, "topk")
    op = relax.op
    order = bb.normalize(op.argsort(x, axis=axis, descending=largest, dtype="int64"))
    zeros, ones = _i64([0] * r), _i64([1] * r)
    index = bb.normalize(op.reshape(op.dynamic_strided_slice(order, zeros, dims, ones), shape))
    ranked = bb.normalize(op.gather_elements(x, order, axis))
    values = bb.normalize(op.reshape(op.dynamic_strided_slice(ranked, zeros, dims, ones), shape))
    return relax.Tuple([values, index])


def _grid_axis(bb: Any, n: Any, length: Any, align: bool) -> Any:
    """float32 [n]: the normalized coordinates (-1 .. 1) of ``n`` positions (ONNX AffineGrid)."""
    from tvm import relax

    op = relax.op
    i = op.astype(index_range(bb, n), "float32")
    s = op.astype(length, "float32")
    if align:  # -1 + 2 i / (n - 1); one position: -1
        step = op.divide(relax.const(2.0, "float32"), op.maximum(op.subtract(s, relax.const(1.0, "float32")),
                                                                 relax.const(1.0, "float32")))
        return bb.normalize(op.add(relax.const(-1.0, "float32"), op.multiply(i, step)))
    step = op.divide(relax.const(2.0, "float32"), s)  # -1 + step / 2 + i step
    start = op.add(relax.const(-1.0, "float32"), op.divide(step, relax.const(2.0, "float32")))
    return bb.normalize(op.add(start, op.multiply(i, step)))


def convert_affine_grid(bb: Any, theta: Any, size: Any, align: bool) -> Any:
    """ONNX AffineGrid with a run-time ``size`` ([N, C, H, W] or [N, C, D, H, W]): the grid of
    normalized coordinates, transformed by each ``theta``; a batch other than theta's, a spatial
    size below 1, or (``align_corners``) of 1 is refused at run time."""
    from tvm import relax

    op = relax.op
    tr, n = _rank(theta), static_len(size)
    if tr != 3 or n not in (4, 5):
        raise ValueError("AffineGrid takes theta [N, 2, 3] with size [N, C, H, W], or [N, 3, 4] with "
                         "[N, C, D, H, W]")
    spatial = n - 2
    tdims = theta.ty.shape.values
    if theta.ty.shape is None or not all(hasattr(v, "value") for v in tdims) or \
            (int(tdims[1].value), int(tdims[2].value)) != (spatial, spatial + 1):
        raise ValueError(f"AffineGrid with a {n}-value size needs theta of shape "
                         f"[N, {spatial}, {spatial + 1}]")
    s = _int64(bb, size)
    batch = op.reshape(op.take(dims_of(bb, theta), _i64(0), axis=0, mode="clip"), [1])
    lens = op.strided_slice(s, [0], [2], [n])
    flags = [op.astype(op.not_equal(op.strided_slice(s, [0], [0], [1]), batch), "int64"),
             any_of(bb, op.less(lens, _i64(1)))]
    if align:  # one position with align_corners: ONNX's reference puts it at -1, onnxruntime elsewhere
        flags.append(any_of(bb, op.equal(lens, _i64(1))))
    bad = _or(bb, *flags)
    shape = checked_shape(bb, bb.normalize(lens), bad, "grid")
    sizes = [op.take(s, _i64(2 + i), axis=0, mode="clip") for i in range(spatial)]
    # per spatial axis (D, H, W order) its coordinates, broadcast to the grid; homogeneous x, y(, z), 1
    axes = [_grid_axis(bb, shape.values[i], sizes[i], align) for i in range(spatial)]
    full = [shape.values[i] for i in range(spatial)]
    coords = []
    for i in reversed(range(spatial)):  # x (along W) first
        view = [1] * spatial
        view[i] = full[i]
        coords.append(op.broadcast_to(op.reshape(axes[i], view), full))
    coords.append(op.ones_like(coords[0]))
    count = full[0]
    for v in full[1:]:
        count = count * v
    points = op.reshape(op.stack(coords, axis=spatial), [count, spatial + 1])  # [P, spatial + 1]
    t = theta if theta.ty.dtype == "float32" else op.astype(theta, "float32")
    grid = op.matmul(op.expand_dims(points, 0), op.permute_dims(t, [0, 2, 1]))  # [N, P, spatial]
    out = op.reshape(grid, [tdims[0], *full, spatial])
    return out if theta.ty.dtype == "float32" else op.astype(out, theta.ty.dtype)


def convert_range(bb: Any, start: Any, limit: Any, delta: Any) -> Any:
    """ONNX Range with run-time scalars: ``max(ceil((limit - start) / delta), 0)`` values
    ``start + i * delta``, computed in float64 for a float type (as ONNX's reference, numpy's
    ``arange``) and in int64 for an integer one; a zero (or, for floats, non-finite) ``delta`` or
    length is refused at run time (onnxruntime refuses a zero delta too)."""
    from tvm import relax

    op = relax.op
    if any(_rank(v) != 0 for v in (start, limit, delta)):
        raise ValueError("Range takes rank-0 start, limit and delta")
    dtype = str(start.ty.dtype)
    is_float = dtype.startswith(("float", "bfloat"))
    wide = "float64" if is_float else "int64"
    s, lim, d = (bb.normalize(op.astype(v, wide)) for v in (start, limit, delta))
    zero = relax.const(0, wide)
    zero_step = op.equal(d, zero)
    safe = bb.normalize(op.where(zero_step, relax.const(1, wide), d))
    if is_float:
        q = bb.normalize(op.ceil(op.divide(op.subtract(lim, s), safe)))
        finite = op.logical_and(op.less(op.abs(q), relax.const(2.0**62, wide)), op.equal(q, q))
        bad = op.logical_or(zero_step, op.logical_not(finite))
        q = op.where(finite, q, relax.const(0.0, wide))
        n = op.astype(q, "int64")
    else:  # ceil(a / b) = -floor(-a / b)
        n = op.negative(op.floor_divide(op.negative(op.subtract(lim, s)), safe))
        # limit - start may wrap int64 (-2**63 .. 2**63 - 1 gave an empty answer): the length
        # estimated in float64 too, refused past what the size bound would take anyway
        f = [bb.normalize(op.astype(v, "float64")) for v in (s, lim, safe)]
        approx = op.ceil(op.divide(op.subtract(f[1], f[0]), f[2]))
        budget = relax.const(float(MAX_RUNTIME_ELEMENTS), "float64")
        bad = op.logical_or(zero_step, op.greater(approx, budget))
    n = op.maximum(n, _i64(0))
    shape = checked_shape(bb, bb.normalize(op.reshape(n, [1])), any_of(bb, bb.normalize(bad)), "range")
    i = op.astype(index_range(bb, shape.values[0]), wide)
    out = bb.normalize(op.add(s, op.multiply(i, d)))
    return out if dtype == wide else op.astype(out, dtype)



def convert_onehot(bb: Any, indices: Any, depth: Any, values: Any, axis: int) -> Any:
    """ONNX OneHot with a run-time ``depth`` (a scalar, or one element; a float truncated): the
    output has ``depth`` positions on ``axis``, ``values[1]`` where the index (negative: from
    ``depth``) is, ``values[0]`` elsewhere (everywhere for an index out of range); a depth below 1
    is refused at run time."""
    from tvm import relax

    op = relax.op
    r = _rank(indices)
    if r is None or _rank(values) != 1 or static_len(values) != 2:
        raise ValueError("OneHot with a run-time depth needs indices of known rank and two values")
    ax = axis + r + 1 if axis < 0 else axis
    if not 0 <= ax <= r:
        raise ValueError(f"OneHot axis {axis} is out of range for rank-{r} indices")
    if _rank(depth) not in (0, 1) or (_rank(depth) == 1 and static_len(depth) != 1):
        raise ValueError("OneHot takes a scalar (or one-element) depth")
    dep = bb.normalize(op.reshape(op.astype(depth, "int64"), [1]))
    d = dims_of(bb, indices)
    parts = [op.strided_slice(d, [0], [0], [ax]), dep, op.strided_slice(d, [0], [ax], [r])]
    bad = any_of(bb, bb.normalize(op.less(dep, _i64(1))))
    shape = checked_shape(bb, bb.normalize(op.concat(parts, axis=0)), bad, "onehot")
    idx = bb.normalize(op.astype(indices, "int64"))
    idx = bb.normalize(op.where(op.less(idx, _i64(0)), op.add(idx, op.reshape(dep, [])), idx))
    view = [1] * (r + 1)
    view[ax] = shape.values[ax]
    classes = op.reshape(index_range(bb, shape.values[ax]), view)
    hit = op.equal(op.expand_dims(idx, [ax]), classes)
    on, off = (op.take(values, _i64(k), axis=0) for k in (1, 0))
    return op.reshape(op.where(hit, on, off), shape)
