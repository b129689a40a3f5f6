"""Sliding-window operators TVM's Relax frontend lacks or imports only in part, rewritten into
standard ones in the preparation stage (found by ONNX's operator suite, issue 29). Every window
is known at compile time (static shapes), so each becomes constant index tables and gathers:

* MaxPool asked for its ``Indices`` output (TVM's converter gives only ``Y``): the windows are
  gathered from the flattened input (a padding slot holds the type's lowest value), ``ReduceMax``
  and ``ArgMax`` (first maximum, as onnxruntime) pick over each window, and the position found is
  mapped to the flat index ONNX defines (row-major, or column-major with ``storage_order`` 1).
* MaxUnpool (TVM fails to import it): ``ScatterND`` of the values into zeros at the flat indices.
* Col2Im (no converter): ``ScatterND`` with ``reduction='add'`` of every column entry that lands
  inside the image, at its pixel. ``image_shape`` / ``block_shape`` given as model inputs: each
  value the static shapes allow is compiled and the one the input holds picked at run time
  (:func:`compiler.convert_ops.guard_values`; any other value stops inference).
* DeformConv (no converter): bilinear sampling at the offset positions (the four corners side by
  side in one ``GatherElements``, zero outside the image, as ONNX's GridSample with
  ``align_corners``), times the mask, then one batched ``MatMul`` per group with the weights.

MaxUnpool's ``output_shape`` must be a constant of the model; otherwise the node is refused in one
line.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from compiler.errors import ModelError
from compiler.graphbuild import node_attr
from compiler.graphbuild import static_dims as _static

__all__ = ["WINDOW_OPS", "lower_window_node", "wanted_window"]

WINDOW_OPS = frozenset({"MaxPool", "MaxUnpool", "Col2Im", "DeformConv"})

_attr = node_attr


def wanted_window(node: Any) -> bool:
    if node.op_type == "MaxPool":
        return len(node.output) > 1 and bool(node.output[1])
    return node.op_type in WINDOW_OPS


def _constant(consts: dict[str, np.ndarray], node: Any, pos: int, label: str, what: str) -> np.ndarray:
    name = node.input[pos] if pos < len(node.input) else ""
    if name not in consts:
        raise ModelError(
            f"{label}: {what} {name!r} is known only at run time; output shapes decided at run time are "
            "not supported for this operator",
            hint=f"make {what} a constant (initializer) of the model",
        )
    return np.asarray(consts[name]).astype(np.int64).reshape(-1)


def _i64(bld: Any, values: Any, hint: str = "c") -> str:
    return str(bld.const(np.asarray(values, np.int64), hint))


def _lowest(dtype: Any) -> Any:
    return np.finfo(dtype).min if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min


# ------------------------------------------------------------------------------ MaxPool + Indices
_Geometry = tuple[list[int], list[int], list[int], list[int], list[int]]


def _pool_geometry(node: Any, spatial: list[int], out: list[int] | None, label: str) -> _Geometry:
    """(kernel, strides, dilations, leading pads, output dims) of a pooling node."""
    rank = len(spatial)
    kernel = list(_attr(node, "kernel_shape"))
    strides = list(_attr(node, "strides", [1] * rank))
    dil = list(_attr(node, "dilations", [1] * rank))
    pads = list(_attr(node, "pads", [0] * 2 * rank))
    auto_pad = _attr(node, "auto_pad", "NOTSET")
    ceil = bool(_attr(node, "ceil_mode", 0))
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dil, strict=True)]
    dims = []
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") and any(d != 1 for d in dil):
        raise ModelError(f"{label}: auto_pad {auto_pad} with dilations {dil} (onnxruntime pads as if "
                         "undilated, unlike ONNX's definition)", hint="give explicit pads")
    for i in range(rank):
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-spatial[i] // strides[i])
            total = max((o - 1) * strides[i] + span[i] - spatial[i], 0)
            lo = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            pads[i], pads[i + rank] = lo, total - lo
        elif auto_pad == "VALID":
            pads[i] = pads[i + rank] = 0
        full = spatial[i] + pads[i] + pads[i + rank] - span[i]
        o = (-(-full // strides[i]) if ceil else full // strides[i]) + 1
        if ceil and (o - 1) * strides[i] >= spatial[i] + pads[i]:  # a window starting in the end padding
            o -= 1
        dims.append(o)
    if out is not None and len(out) == rank and all(d > 0 for d in out) and out != dims:
        dims = out  # what shape inference declared (the model's own answer)
    return kernel, strides, dil, pads[:rank], dims


def _window_table(spatial: list[int], kernel: list[int], strides: list[int], dil: list[int],
                  lead: list[int], out: list[int]) -> np.ndarray:
    """[*out, K] flat (row-major) input position of every window element; prod(spatial) where it
    falls in the padding."""
    size = int(np.prod(spatial))
    table = np.full([*out, int(np.prod(kernel))], size, np.int64)
    for o in itertools.product(*(range(v) for v in out)):
        for k, off in enumerate(itertools.product(*(range(v) for v in kernel))):
            pos = [o[i] * strides[i] - lead[i] + off[i] * dil[i] for i in range(len(spatial))]
            if all(0 <= p < s for p, s in zip(pos, spatial, strict=True)):
                table[(*o, k)] = int(np.ravel_multi_index(pos, spatial))
    return table


def _maxpool_indices(bld: Any, node: Any, shapes: dict[str, list[int]], types: dict[str, int],
                     opset: int, label: str) -> None:
    from onnx import helper

    dims = _static(shapes, node.input[0], label, "input")
    n, c, spatial = dims[0], dims[1], dims[2:]
    declared = shapes.get(node.output[0])
    kernel, strides, dil, lead, out = _pool_geometry(node, spatial, declared[2:] if declared else None, label)
    order = int(_attr(node, "storage_order", 0))
    if order and len(spatial) != 2:
        raise ModelError(f"{label}: storage_order 1 of a {len(spatial)}-D pooling; ONNX defines it for 2-D",
                         hint="use storage_order 0")
    table = _window_table(spatial, kernel, strides, dil, lead, out)
    size = int(np.prod(spatial))
    dtype = helper.tensor_dtype_to_np_dtype(types.get(node.input[0], 1))
    rows = bld.op("Reshape", [node.input[0], _i64(bld, [n * c, size], "rows")])
    pad = bld.op("Expand", [bld.const(np.array([[_lowest(dtype)]], dtype), "lowest"),
                            _i64(bld, [n * c, 1], "col")])
    rows = bld.op("Concat", [rows, pad], axis=1)
    windows = bld.op("Gather", [rows, _i64(bld, table, "windows")], axis=1)  # [NC, *out, K]
    shape = _i64(bld, [n, c, *out], "shape")
    top = (bld.op("ReduceMax", [windows, _i64(bld, [-1], "axes")], keepdims=0) if opset >= 18
           else bld.op("ReduceMax", [windows], axes=[-1], keepdims=0))
    bld.op("Reshape", [top, shape], out=node.output[0])
    # flat index of each window position in the storage order, plus the (n, c) plane's offset
    flat = np.where(table < size, table, 0)
    if order:
        h, w = np.unravel_index(flat, spatial)
        flat = h + w * spatial[0]
    planes = (np.arange(n * c, dtype=np.int64) * size).reshape([n * c] + [1] * (len(out) + 1))
    index = bld.const(flat[None] + planes, "index")  # [NC, *out, K]
    best = bld.op("ArgMax", [windows], axis=-1, keepdims=1)
    picked = bld.op("GatherElements", [index, best], axis=len(out) + 1)
    bld.op("Reshape", [picked, shape], out=node.output[1])


# ------------------------------------------------------------------------------------- MaxUnpool
def _max_unpool(bld: Any, node: Any, shapes: dict[str, list[int]], consts: dict[str, np.ndarray],
                types: dict[str, int], label: str) -> None:
    from onnx import helper

    dims = _static(shapes, node.input[0], label, "input")
    spatial = dims[2:]
    rank = len(spatial)
    if len(node.input) > 2 and node.input[2]:
        out = [int(v) for v in _constant(consts, node, 2, label, "output_shape")]
        if len(out) != len(dims) or out[:2] != dims[:2]:
            raise ModelError(f"{label}: output_shape {out} for an input of shape {dims}",
                             hint="fix the model")
    else:
        kernel = list(_attr(node, "kernel_shape"))
        strides = list(_attr(node, "strides", [1] * rank))
        pads = list(_attr(node, "pads", [0] * 2 * rank))
        out = dims[:2] + [(spatial[i] - 1) * strides[i] - pads[i] - pads[i + rank] + kernel[i]
                          for i in range(rank)]
    dtype = helper.tensor_dtype_to_np_dtype(types.get(node.input[0], 1))
    total = int(np.prod(out))
    zeros = bld.op("Expand", [bld.const(np.zeros([1], dtype), "zero"), _i64(bld, [total], "total")])
    where = bld.op("Reshape", [bld.op("Cast", [node.input[1]], to=7), _i64(bld, [-1, 1], "col")])
    values = bld.op("Reshape", [node.input[0], _i64(bld, [-1], "flat")])
    flat = bld.op("ScatterND", [zeros, where, values])
    bld.op("Reshape", [flat, _i64(bld, out, "shape")], out=node.output[0])


# ----------------------------------------------------------------------------------------- Col2Im
def _col2im_blocks(node: Any, image: list[int], block: list[int]) -> list[int]:
    rank = len(image)
    strides = list(_attr(node, "strides", [1] * rank))
    dil = list(_attr(node, "dilations", [1] * rank))
    pads = list(_attr(node, "pads", [0] * 2 * rank))
    return [(image[i] + pads[i] + pads[i + rank] - dil[i] * (block[i] - 1) - 1) // strides[i] + 1
            for i in range(rank)]


def _col2im_operands(node: Any, dims: list[int], shapes: dict[str, list[int]], consts: dict[str, np.ndarray],
                     label: str) -> tuple[list[tuple[list[int], list[int]]], list[dict[str, np.ndarray]]]:
    """The (image_shape, block_shape) pairs to compile and, per pair, the run-time operands' values
    it stands for: a model input takes each value the input's and the declared output's static
    shapes allow (at most MAX_ALTERNATIVES)."""
    from compiler.convert_ops import MAX_ALTERNATIVES

    known = {pos: [int(v) for v in np.asarray(consts[node.input[pos]]).reshape(-1)]
             for pos in (1, 2) if node.input[pos] in consts}
    if len(known) == 2:
        return [(known[1], known[2])], [{}]
    out = shapes.get(node.output[0]) or []
    image = known.get(1) or (out[2:] if all(d > 0 for d in out) else [])
    rank = len(image)
    choices = []
    if rank and all(d > 0 for d in out) and len(dims) == 3 and out[1] > 0 and dims[1] % out[1] == 0:
        per = dims[1] // out[1]  # block elements per channel
        sizes = [range(1, per + 1)] * rank if 2 not in known else [[v] for v in known[2]]
        choices = [list(b) for b in itertools.product(*sizes)
                   if int(np.prod(b)) == per and int(np.prod(_col2im_blocks(node, image, list(b)))) == dims[2]
                   and min(_col2im_blocks(node, image, list(b))) >= 1]
    if not 0 < len(choices) <= MAX_ALTERNATIVES:
        pos = 2 if image and 2 not in known else 1  # the declared output gives the image shape
        what = "image_shape" if pos == 1 else "block_shape"
        raise ModelError(
            f"{label}: {what} {node.input[pos]!r} is known only at run time and the static shapes allow "
            f"{len(choices)} values; output shapes decided at run time are not supported for this operator",
            hint=f"make {what} a constant (initializer) of the model",
        )
    pairs = [(image, block) for block in choices]
    alternatives = [{node.input[pos]: np.array(v) for pos, v in ((1, image), (2, block)) if pos not in known}
                    for image, block in pairs]
    return pairs, alternatives


def _col2im(bld: Any, node: Any, shapes: dict[str, list[int]], consts: dict[str, np.ndarray],
            types: dict[str, int], label: str) -> None:
    from compiler.convert_ops import guard_values

    dims = _static(shapes, node.input[0], label, "input")
    pairs, alternatives = _col2im_operands(node, dims, shapes, consts, label)
    results = [_col2im_body(bld, node, dims, image, block, types, label) for image, block in pairs]
    guard_values(bld, results, alternatives, node.output[0])


def _col2im_body(bld: Any, node: Any, dims: list[int], image: list[int], block: list[int],
                 types: dict[str, int], label: str) -> str:
    from onnx import helper

    rank = len(image)
    if len(block) != rank:
        raise ModelError(f"{label}: image_shape {image} and block_shape {block} differ in length",
                         hint="fix the model")
    strides = list(_attr(node, "strides", [1] * rank))
    dil = list(_attr(node, "dilations", [1] * rank))
    pads = list(_attr(node, "pads", [0] * 2 * rank))
    k = int(np.prod(block))
    blocks = _col2im_blocks(node, image, block)
    fits = len(dims) == 3 and min(blocks) >= 1
    if not fits or dims[1] % k or int(np.prod(blocks)) != dims[2]:
        raise ModelError(f"{label}: input {dims} does not hold {blocks} blocks of {block} for image {image}",
                         hint="fix the model")
    n, c = dims[0], dims[1] // k
    src, dst = [], []
    for b, off in enumerate(itertools.product(*(range(v) for v in block))):
        for j, at in enumerate(itertools.product(*(range(v) for v in blocks))):
            pos = [at[i] * strides[i] - pads[i] + off[i] * dil[i] for i in range(rank)]
            if all(0 <= p < s for p, s in zip(pos, image, strict=True)):
                src.append(b * dims[2] + j)
                dst.append(int(np.ravel_multi_index(pos, image)))
    size = int(np.prod(image))
    dtype = helper.tensor_dtype_to_np_dtype(types.get(node.input[0], 1))
    cols = bld.op("Reshape", [node.input[0], _i64(bld, [n, c, k * dims[2]], "cols")])
    used = bld.op("Transpose", [bld.op("Gather", [cols, _i64(bld, src, "src")], axis=2)], perm=[2, 0, 1])
    zeros = bld.op("Expand", [bld.const(np.zeros([1, 1, 1], dtype), "zero"), _i64(bld, [size, n, c], "dims")])
    where = _i64(bld, np.array(dst).reshape(-1, 1), "dst")
    summed = bld.op("ScatterND", [zeros, where, used], reduction="add")
    return str(bld.op("Reshape", [bld.op("Transpose", [summed], perm=[1, 2, 0]),
                                  _i64(bld, [n, c, *image], "shape")]))


# ------------------------------------------------------------------------------------- DeformConv
def _deform_conv(bld: Any, node: Any, shapes: dict[str, list[int]], consts: dict[str, np.ndarray],
                 types: dict[str, int], label: str) -> None:
    from onnx import helper

    x, w, offset = node.input[:3]
    bias = node.input[3] if len(node.input) > 3 else ""
    mask = node.input[4] if len(node.input) > 4 else ""
    xd = _static(shapes, x, label, "input")
    wd = list(consts[w].shape) if w in consts else _static(shapes, w, label, "weight")
    od = _static(shapes, offset, label, "offset")
    if len(xd) != 4:
        raise ModelError(f"{label}: a {len(xd) - 2}-D deformable convolution; only 2-D is supported",
                         hint="use a 2-D DeformConv")
    n, c, h, wid = xd
    oc, kh, kw = wd[0], *list(_attr(node, "kernel_shape", wd[2:]))
    oh, ow = od[2], od[3]
    sh, sw = list(_attr(node, "strides", [1, 1]))
    dh, dw = list(_attr(node, "dilations", [1, 1]))
    pt, pl = list(_attr(node, "pads", [0, 0, 0, 0]))[:2]
    group, og = int(_attr(node, "group", 1)), int(_attr(node, "offset_group", 1))
    k = kh * kw
    if c % og or c != wd[1] * group or oc % group or od[1] != og * 2 * k:
        raise ModelError(f"{label}: input {xd}, weight {wd}, offset {od}, group {group} and offset_group "
                         f"{og} do not fit", hint="fix the model")
    dtype = helper.tensor_dtype_to_np_dtype(types.get(x, 1))
    cg, pts = c // og, k * oh * ow
    # the undeformed sampling position of each (kernel element, output pixel): [K, oH, oW]
    base_y = (np.arange(kh)[:, None, None, None] * dh + np.arange(oh)[None, None, :, None] * sh - pt)
    base_x = (np.arange(kw)[None, :, None, None] * dw + np.arange(ow)[None, None, None, :] * sw - pl)
    base_y = np.broadcast_to(base_y, (kh, kw, oh, ow)).reshape(1, 1, pts).astype(dtype)
    base_x = np.broadcast_to(base_x, (kh, kw, oh, ow)).reshape(1, 1, pts).astype(dtype)
    off = bld.op("Reshape", [offset, _i64(bld, [n, og, k, 2, oh * ow], "off")])

    def part(i: int) -> str:
        one = bld.op("Gather", [off, _i64(bld, i, "i")], axis=3)  # [N, G, K, oHoW]
        return str(bld.op("Reshape", [one, _i64(bld, [n, og, pts], "pts")]))

    y = bld.op("Add", [part(0), bld.const(base_y, "base_y")])
    xx = bld.op("Add", [part(1), bld.const(base_x, "base_x")])
    y0, x0 = bld.op("Floor", [y]), bld.op("Floor", [xx])
    ly, lx = bld.op("Sub", [y, y0]), bld.op("Sub", [xx, x0])
    one = bld.const(np.array(1, dtype), "one")
    hy, hx = bld.op("Sub", [one, ly]), bld.op("Sub", [one, lx])
    y1, x1 = bld.op("Add", [y0, one]), bld.op("Add", [x0, one])
    planes = bld.op("Reshape", [x, _i64(bld, [n, og, cg, h * wid], "planes")])
    zero = bld.const(np.array(0, dtype), "zero")

    def inside(v: str, size: int) -> str:
        top = bld.const(np.array(size - 1, dtype), "top")
        return str(bld.op("And", [bld.op("GreaterOrEqual", [v, zero]), bld.op("LessOrEqual", [v, top])]))

    def clip(v: str, size: int) -> str:
        return str(bld.op("Cast", [bld.op("Min", [bld.op("Max", [v, zero]),
                                                  bld.const(np.array(size - 1, dtype), "top")])], to=7))

    # the four corners side by side along the last axis: one gather for all of them
    ys = bld.op("Concat", [y0, y0, y1, y1], axis=-1)  # [N, G, 4P]
    xs = bld.op("Concat", [x0, x1, x0, x1], axis=-1)
    wts = bld.op("Concat", [bld.op("Mul", [hy, hx]), bld.op("Mul", [hy, lx]), bld.op("Mul", [ly, hx]),
                            bld.op("Mul", [ly, lx])], axis=-1)
    ok = bld.op("Cast", [bld.op("And", [inside(ys, h), inside(xs, wid)])], to=types.get(x, 1))
    weight = bld.op("Unsqueeze", [bld.op("Mul", [wts, ok]), _i64(bld, [2], "ax")])  # [N, G, 1, 4P]
    at = bld.op("Add", [bld.op("Mul", [clip(ys, h), _i64(bld, wid, "w")]), clip(xs, wid)])
    at = bld.op("Unsqueeze", [at, _i64(bld, [2], "ax")])
    at = bld.op("Expand", [at, _i64(bld, [n, og, cg, 4 * pts], "e")])
    got = bld.op("Mul", [bld.op("GatherElements", [planes, at], axis=3), weight])  # [N, G, Cg, 4P]
    total = bld.op("ReduceSum", [bld.op("Reshape", [got, _i64(bld, [n, og, cg, 4, pts], "corners")]),
                                 _i64(bld, [3], "axes")], keepdims=0)  # [N, G, Cg, P]
    if mask:
        m = bld.op("Reshape", [mask, _i64(bld, [n, og, 1, pts], "m")])
        total = bld.op("Mul", [total, m])
    cpg = c // group
    cols = bld.op("Reshape", [total, _i64(bld, [n, group, cpg * k, oh * ow], "cols")])
    weights = bld.op("Reshape", [w, _i64(bld, [group, oc // group, cpg * k], "w")])
    out = bld.op("Reshape", [bld.op("MatMul", [weights, cols]), _i64(bld, [n, oc, oh, ow], "shape")])
    if bias:
        out = bld.op("Add", [out, bld.op("Reshape", [bias, _i64(bld, [1, oc, 1, 1], "b")])])
    bld.op("Identity", [out], out=node.output[0])


def lower_window_node(bld: Any, node: Any, shapes: dict[str, list[int]], consts: dict[str, np.ndarray],
                      types: dict[str, int], opset: int, label: str) -> None:
    """Emit ``node``'s replacement into ``bld`` (``node`` is one :func:`wanted_window` accepts)."""
    if node.op_type == "MaxPool":
        _maxpool_indices(bld, node, shapes, types, opset, label)
    elif node.op_type == "MaxUnpool":
        _max_unpool(bld, node, shapes, consts, types, label)
    elif node.op_type == "Col2Im":
        _col2im(bld, node, shapes, consts, types, label)
    else:
        _deform_conv(bld, node, shapes, consts, types, label)
