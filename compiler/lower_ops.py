"""Operators TVM's Relax frontend lacks, rejects or imports wrongly, rewritten into standard ones
in the preparation stage (each found by ONNX's operator suite, issue 29):

* ScatterElements (and opset 10's Scatter, which the opset upgrade makes one): TVM fails to
  schedule it; it becomes ScatterND with the coordinates of every update spelled out.
* EyeLike with a ``dtype`` (TVM refuses the dtype change) of a static shape: a constant.
* ReverseSequence (no converter): GatherElements along the time axis with per-batch indices.
* SpaceToDepth in CRD mode (TVM ignores the mode): Reshape / Transpose / Reshape.
* ConvTranspose with ``output_shape`` (TVM ignores it): the equivalent ``pads``, as ONNX defines them.
* BatchNormalization in training mode (batch statistics and the running-statistics outputs):
  ReduceMean / Sub / Mul / Sqrt, the running statistics mixed with ``momentum``.
* TensorScatter (no converter; a KV cache written at per-batch positions): ScatterND with the
  positions write_indices[b] + i (modulo the cache length in circular mode; clamped to the cache
  in linear mode, where ONNX leaves writes past the end undefined, so none lands outside memory).
* DFT (no converter): MatMul of the real and imaginary parts by constant cosine / sine tables
  along the axis (forward, inverse, one-sided, inverse one-sided, ``dft_length``); an axis given at
  run time computes every possible axis and keeps the one asked for (as CumProd does).

Shapes must be static where the rewrite needs them; otherwise the node is refused in one line.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.errors import ModelError
from compiler.graphbuild import node_attr
from compiler.graphbuild import static_dims as _static
from compiler.lower_misc import MISC_OPS, lower_misc_node, wanted_misc
from compiler.lower_window import WINDOW_OPS, lower_window_node, wanted_window

__all__ = ["LOWERED_OPS", "lower_ops"]

LOWERED_OPS = (
    frozenset(
        {
            "ScatterElements",
            "Scatter",
            "EyeLike",
            "ReverseSequence",
            "SpaceToDepth",
            "ConvTranspose",
            "BatchNormalization",
            "DFT",
            "STFT",
            "TensorScatter",
        }
    )
    | WINDOW_OPS
    | MISC_OPS
) - {"MaxPool", "Pow"}  # TVM converts these but for the forms lowered here (see _wanted)
_DFT_MAX = 4096  # a length-N transform is an N x N table per part


_attr = node_attr


def _wanted(node: Any, types: dict[str, int] | None = None) -> bool:
    """Whether ``node`` is rewritten (``types`` None: might be, before the element types are known)."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in LOWERED_OPS | WINDOW_OPS | MISC_OPS:
        return False
    op = node.op_type
    if op in WINDOW_OPS:
        return wanted_window(node)
    if op in MISC_OPS:
        return types is None or wanted_misc(node, types)
    if op == "EyeLike":
        return _attr(node, "dtype") is not None
    if op == "SpaceToDepth":
        return _attr(node, "mode", "DCR") == "CRD"
    if op == "ConvTranspose":
        return _attr(node, "output_shape") is not None
    if op == "BatchNormalization":
        return bool(_attr(node, "training_mode", 0))
    return True


def _scatter_elements(bld: Any, node: Any, shapes: dict[str, list[int]], opset: int, label: str) -> None:
    data, indices, updates = node.input[:3]
    dims = _static(shapes, indices, label, "indices")
    rank = len(dims)
    axis = int(_attr(node, "axis", 0))
    axis = axis + rank if axis < 0 else axis
    grid = np.indices(dims, dtype=np.int64) if dims else np.zeros((0,), np.int64)
    parts = []
    for j in range(rank):
        coord = bld.op("Cast", [indices], to=7) if j == axis else bld.const(grid[j], "coord")
        parts.append(
            bld.op("Unsqueeze", [coord, bld.const(np.array([-1], np.int64), "axes")])
            if opset >= 13
            else bld.op("Unsqueeze", [coord], axes=[-1])
        )
    coords = bld.op("Concat", parts, axis=-1) if len(parts) > 1 else parts[0]
    reduction = _attr(node, "reduction", "none")
    extra = {"reduction": reduction} if reduction != "none" else {}
    bld.op("ScatterND", [data, coords, updates], out=node.output[0], **extra)


def _eye_like(bld: Any, node: Any, shapes: dict[str, list[int]], types: dict[str, int], label: str) -> None:
    from onnx import helper

    dims = _static(shapes, node.input[0], label, "input")
    if len(dims) != 2:
        raise ModelError(
            f"{label}: the input has rank {len(dims)}; EyeLike takes a 2-D tensor", hint="fix the model"
        )
    elem = int(_attr(node, "dtype", types.get(node.input[0], 1)))
    eye = np.eye(dims[0], dims[1], int(_attr(node, "k", 0)), dtype=helper.tensor_dtype_to_np_dtype(elem))
    bld.op("Identity", [bld.const(eye, "eye")], out=node.output[0])


def _reverse_sequence(bld: Any, node: Any, shapes: dict[str, list[int]], label: str) -> None:
    x, lens = node.input[:2]
    dims = _static(shapes, x, label, "input")
    time_axis, batch_axis = int(_attr(node, "time_axis", 0)), int(_attr(node, "batch_axis", 1))
    if sorted((time_axis, batch_axis)) != [0, 1] or len(dims) < 2:
        raise ModelError(
            f"{label}: time_axis {time_axis} and batch_axis {batch_axis}; ONNX allows 0 and 1",
            hint="fix the model",
        )
    shape_t = [1] * len(dims)
    shape_t[time_axis] = dims[time_axis]
    shape_b = [1] * len(dims)
    shape_b[batch_axis] = dims[batch_axis]
    t = bld.const(np.arange(dims[time_axis], dtype=np.int64).reshape(shape_t), "t")
    n = bld.op("Reshape", [bld.op("Cast", [lens], to=7), bld.const(np.array(shape_b, np.int64), "shape")])
    flipped = bld.op("Sub", [bld.op("Sub", [n, bld.const(np.array(1, np.int64), "one")]), t])
    idx = bld.op("Where", [bld.op("Less", [t, n]), flipped, t])
    idx = bld.op("Expand", [idx, bld.const(np.array(dims, np.int64), "dims")])
    bld.op("GatherElements", [x, idx], out=node.output[0], axis=time_axis)


def _space_to_depth_crd(bld: Any, node: Any, shapes: dict[str, list[int]], label: str) -> None:
    dims = _static(shapes, node.input[0], label, "input")
    b = int(_attr(node, "blocksize", 1))
    if len(dims) != 4 or dims[2] % b or dims[3] % b:
        raise ModelError(
            f"{label}: input {dims} is not 4-D with H and W divisible by blocksize {b}", hint="fix the model"
        )
    n, c, h, w = dims
    v = bld.op(
        "Reshape", [node.input[0], bld.const(np.array([n, c, h // b, b, w // b, b], np.int64), "shape")]
    )
    v = bld.op("Transpose", [v], perm=[0, 1, 3, 5, 2, 4])
    bld.op(
        "Reshape",
        [v, bld.const(np.array([n, c * b * b, h // b, w // b], np.int64), "shape")],
        out=node.output[0],
    )


def _conv_transpose_pads(
    node: Any, shapes: dict[str, list[int]], consts: dict[str, np.ndarray], label: str
) -> Any:
    """The node with ``output_shape`` replaced by the pads ONNX derives from it."""
    import onnx

    x = _static(shapes, node.input[0], label, "input")
    w = (
        list(consts[node.input[1]].shape)
        if node.input[1] in consts
        else _static(shapes, node.input[1], label, "weight")
    )
    spatial = len(x) - 2
    out = list(_attr(node, "output_shape"))[-spatial:]
    strides = list(_attr(node, "strides", [1] * spatial))
    dilations = list(_attr(node, "dilations", [1] * spatial))
    out_pad = list(_attr(node, "output_padding", [0] * spatial))
    kernel = list(_attr(node, "kernel_shape", w[2:]))
    auto_pad = _attr(node, "auto_pad", "NOTSET")
    begin, end = [], []
    for i in range(spatial):
        total = strides[i] * (x[2 + i] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1 - out[i]
        lo, hi = (
            (total // 2, total - total // 2) if auto_pad == "SAME_UPPER" else (total - total // 2, total // 2)
        )
        if lo < 0:
            raise ModelError(
                f"{label}: output_shape {out} needs negative leading padding",
                hint="give pads and output_padding instead",
            )
        if hi < 0:  # a negative trailing pad is one more output row: output_padding
            out_pad[i] -= hi
            hi = 0
        begin.append(lo)
        end.append(hi)
    new = onnx.NodeProto()
    new.CopyFrom(node)
    keep = [a for a in new.attribute if a.name not in ("output_shape", "pads", "auto_pad", "output_padding")]
    del new.attribute[:]
    new.attribute.extend(keep)
    new.attribute.append(onnx.helper.make_attribute("pads", begin + end))
    new.attribute.append(onnx.helper.make_attribute("output_padding", out_pad))
    return new


def _batchnorm_training(
    bld: Any, node: Any, shapes: dict[str, list[int]], types: dict[str, int], opset: int, label: str
) -> None:
    from onnx import helper

    x, scale, bias, mean, var = node.input[:5]
    dims = _static(shapes, x, label, "input")
    if len(dims) < 2:
        raise ModelError(
            f"{label}: the input has rank {len(dims)}; BatchNormalization needs N, C, ...",
            hint="fix the model",
        )
    dtype = helper.tensor_dtype_to_np_dtype(types.get(x, 1))
    axes = [0, *range(2, len(dims))]
    eps = float(_attr(node, "epsilon", 1e-5))
    momentum = float(_attr(node, "momentum", 0.9))

    def reduce_mean(v: str) -> str:
        if opset >= 18:
            return bld.op("ReduceMean", [v, bld.const(np.array(axes, np.int64), "axes")], keepdims=1)
        return bld.op("ReduceMean", [v], axes=axes, keepdims=1)

    per_channel = bld.const(np.array([1, dims[1]] + [1] * (len(dims) - 2), np.int64), "shape")
    flat = bld.const(np.array([dims[1]], np.int64), "flat")
    mu = reduce_mean(x)
    centered = bld.op("Sub", [x, mu])
    sigma2 = reduce_mean(bld.op("Mul", [centered, centered]))
    denom = bld.op("Sqrt", [bld.op("Add", [sigma2, bld.const(np.array(eps, dtype), "eps")])])
    y = bld.op("Div", [centered, denom])
    y = bld.op("Mul", [y, bld.op("Reshape", [scale, per_channel])])
    bld.op("Add", [y, bld.op("Reshape", [bias, per_channel])], out=node.output[0])
    keep, mix = (
        bld.const(np.array(momentum, dtype), "momentum"),
        bld.const(np.array(1 - momentum, dtype), "mix"),
    )
    for k, (running, batch) in enumerate(((mean, mu), (var, sigma2)), start=1):
        if k < len(node.output) and node.output[k]:
            now = bld.op("Reshape", [batch, flat])
            bld.op("Add", [bld.op("Mul", [running, keep]), bld.op("Mul", [now, mix])], out=node.output[k])


def _dft_tables(n_in: int, length: int, inverse: bool, onesided: bool) -> tuple[np.ndarray, np.ndarray]:
    """(C, S): cos and sin of 2 pi n k / length, scaled (1/length for the inverse), [n_in, bins]."""
    if inverse and onesided:  # Hermitian input of n_in bins -> `length` real samples (numpy's irfft)
        k = np.arange(n_in)[:, None]
        theta = 2 * np.pi * k * np.arange(length)[None, :] / length
        weight = np.where((k == 0) | ((length % 2 == 0) & (k == length // 2)), 1.0, 2.0)
        weight = weight * (k < min(n_in, length // 2 + 1))
        return weight * np.cos(theta) / length, weight * np.sin(theta) / length
    bins = length // 2 + 1 if onesided else length
    n = np.arange(n_in)[:, None]
    theta = 2 * np.pi * n * np.arange(bins)[None, :] / length
    used = (n < length) / (length if inverse else 1)  # a longer input is truncated to dft_length
    return used * np.cos(theta), used * np.sin(theta)


def _dft_along(
    bld: Any,
    re: str,
    im: str | None,
    dims: list[int],
    axis: int,
    length: int,
    inverse: bool,
    onesided: bool,
    dtype: Any,
) -> str:
    """DFT of re + i im (shape ``dims``, no complex axis) along ``axis``: [..., K, 2], or [..., L, 1]
    for the inverse of a one-sided spectrum."""
    rank = len(dims)
    perm = [d for d in range(rank) if d != axis] + [axis]
    back = [int(v) for v in np.argsort(perm)]
    c, s = _dft_tables(dims[axis], length, inverse, onesided)

    def along(x: str, table: np.ndarray) -> str:
        moved = bld.op("Transpose", [x], perm=perm)
        return str(
            bld.op(
                "Transpose", [bld.op("MatMul", [moved, bld.const(table.astype(dtype), "table")])], perm=back
            )
        )

    last = bld.const(np.array([-1], np.int64), "axes")
    if inverse and onesided:  # Re(X e^{i theta}) summed with the Hermitian weights
        real = along(re, c) if im is None else bld.op("Sub", [along(re, c), along(im, s)])
        return str(bld.op("Unsqueeze", [real, last]))
    if im is None:
        y_re, y_im = along(re, c), along(re, s)
        if not inverse:
            y_im = bld.op("Neg", [y_im])
    elif inverse:  # (re + i im)(cos + i sin)
        y_re = bld.op("Sub", [along(re, c), along(im, s)])
        y_im = bld.op("Add", [along(im, c), along(re, s)])
    else:  # (re + i im)(cos - i sin)
        y_re = bld.op("Add", [along(re, c), along(im, s)])
        y_im = bld.op("Sub", [along(im, c), along(re, s)])
    return str(
        bld.op("Concat", [bld.op("Unsqueeze", [y_re, last]), bld.op("Unsqueeze", [y_im, last])], axis=-1)
    )


def _dft(
    bld: Any,
    node: Any,
    shapes: dict[str, list[int]],
    consts: dict[str, np.ndarray],
    types: dict[str, int],
    opset: int,
    label: str,
) -> None:
    from onnx import helper

    x = node.input[0]
    dims = _static(shapes, x, label, "input")
    if len(dims) < 3 or dims[-1] not in (1, 2):
        raise ModelError(f"{label}: input {dims}; DFT takes [batch, ..., n, 1 or 2]", hint="fix the model")
    rank = len(dims) - 1  # without the real / imaginary axis
    inverse, onesided = bool(_attr(node, "inverse", 0)), bool(_attr(node, "onesided", 0))
    if opset >= 20:
        axis_name = node.input[2] if len(node.input) > 2 else ""
        given = consts.get(axis_name) if axis_name else np.array(-2)
    else:
        axis_name, given = "", np.array(_attr(node, "axis", 1))
    length_name = node.input[1] if len(node.input) > 1 else ""
    if length_name and length_name not in consts:
        raise ModelError(
            f"{label}: dft_length {length_name!r} is known only at run time; output shapes decided at "
            "run time are not supported",
            hint="make dft_length a constant of the model",
        )
    candidates = [int(given) % (rank + 1)] if given is not None else list(range(1, rank))
    dtype = helper.tensor_dtype_to_np_dtype(types.get(x, 1))
    sizes = dims[:-1]
    re = bld.op(
        "Squeeze",
        [
            bld.op("Slice", [x, *(bld.const(np.array([v], np.int64), "b") for v in (0, 1, -1))]),
            bld.const(np.array([-1], np.int64), "axes"),
        ],
    )
    im = (
        None
        if dims[-1] == 1
        else bld.op(
            "Squeeze",
            [
                bld.op("Slice", [x, *(bld.const(np.array([v], np.int64), "b") for v in (1, 2, -1))]),
                bld.const(np.array([-1], np.int64), "axes"),
            ],
        )
    )
    results, shapes_out, shape_of = {}, set(), {}
    for axis in candidates:
        if not 0 < axis < rank:
            raise ModelError(
                f"{label}: axis {axis} is the batch or the real/imaginary axis", hint="fix the model"
            )
        n = sizes[axis]
        length = int(consts[length_name]) if length_name else (2 * (n - 1) if inverse and onesided else n)
        if max(n, length) > _DFT_MAX:
            raise ModelError(
                f"{label}: a transform of length {max(n, length)}; DFT is a table product, up to {_DFT_MAX}",
                hint="compute the transform outside the model",
            )
        bins = length if inverse or not onesided else length // 2 + 1
        shape_of[axis] = tuple([*sizes[:axis], bins, *sizes[axis + 1 :], 1 if inverse and onesided else 2])
        shapes_out.add(shape_of[axis])
        results[axis] = _dft_along(bld, re, im, sizes, axis, length, inverse, onesided, dtype)
    declared = tuple(shapes.get(node.output[0]) or ())
    if len(shapes_out) != 1 and declared in shapes_out:
        # the output's declared shape leaves the axes that give it: those compiled, the run-time
        # axis checked to be one of them (-r .. -1 counted from the end too)
        from compiler.convert_ops import MAX_ALTERNATIVES, guard_values

        fit = [a for a in candidates if shape_of[a] == declared]
        if len(fit) * 2 <= MAX_ALTERNATIVES:
            alternatives = [{axis_name: np.array(v)} for a in fit for v in (a, a - rank - 1)]
            guard_values(bld, [results[a] for a in fit for _ in (0, 1)], alternatives, node.output[0])
            return
    if len(shapes_out) != 1:
        raise ModelError(
            f"{label}: the axis {axis_name!r} is known only at run time and the output shape depends on it",
            hint="make the axis a constant of the model",
        )
    picked = results[candidates[-1]]
    if len(candidates) > 1:  # the axis arrives at run time: every candidate computed, the one asked kept
        ax = bld.op(
            "Cast", [bld.op("Reshape", [axis_name, bld.const(np.array([], np.int64), "scalar")])], to=7
        )
        ax = bld.op("Mod", [ax, bld.const(np.array(rank + 1, np.int64), "rank")])
        for axis in reversed(candidates[:-1]):
            hit = bld.op("Equal", [ax, bld.const(np.array(axis, np.int64), "k")])
            picked = bld.op("Where", [hit, results[axis], picked])
    bld.op("Identity", [picked], out=node.output[0])


def _stft(
    bld: Any,
    node: Any,
    shapes: dict[str, list[int]],
    consts: dict[str, np.ndarray],
    types: dict[str, int],
    label: str,
) -> None:
    """STFT: the frames gathered with a constant index table, times the window, then DFT's tables."""
    from compiler.convert_ops import guard_values

    x = node.input[0]
    dims = _static(shapes, x, label, "signal")
    if len(dims) != 3 or dims[-1] not in (1, 2):
        raise ModelError(f"{label}: signal {dims}; STFT takes [batch, length, 1 or 2]", hint="fix the model")
    pairs, alternatives = _stft_operands(node, dims, shapes, consts, label)
    results = [_stft_body(bld, node, dims, step, flen, types, label) for step, flen in pairs]
    guard_values(bld, results, alternatives, node.output[0])


def _stft_body(
    bld: Any, node: Any, dims: list[int], step: int, flen: int, types: dict[str, int], label: str
) -> str:
    from onnx import helper

    x = node.input[0]
    window = node.input[2] if len(node.input) > 2 else ""
    if step < 1 or not 0 < flen <= dims[1]:
        raise ModelError(
            f"{label}: frame_step {step} and frame_length {flen} for a signal of {dims[1]} samples",
            hint="give a positive frame_step and a window or frame_length no longer than the signal",
        )
    if flen > _DFT_MAX:
        raise ModelError(
            f"{label}: frames of {flen} samples; STFT is a table product, up to {_DFT_MAX}",
            hint="compute the transform outside the model",
        )
    frames = (dims[1] - flen) // step + 1
    table = bld.const(np.arange(frames)[:, None] * step + np.arange(flen)[None, :], "frames")
    dtype = helper.tensor_dtype_to_np_dtype(types.get(x, 1))
    parts = []
    for k in range(dims[-1]):
        one = bld.op("Gather", [x, bld.const(np.array(k, np.int64), "k")], axis=2)  # [B, L]
        framed = bld.op("Gather", [one, table], axis=1)  # [B, frames, flen]
        if window:
            framed = bld.op("Mul", [framed, window])
        parts.append(framed)
    onesided = bool(_attr(node, "onesided", 1))
    return _dft_along(
        bld,
        parts[0],
        parts[1] if len(parts) > 1 else None,
        [dims[0], frames, flen],
        2,
        flen,
        False,
        onesided,
        dtype,
    )


def _stft_operands(
    node: Any, dims: list[int], shapes: dict[str, list[int]], consts: dict[str, np.ndarray], label: str
) -> tuple[list[tuple[int, int]], list[dict[str, np.ndarray]]]:
    """The (frame_step, frame_length) pairs to compile and, per pair, the run-time operands' values
    it stands for: a model input takes each value the signal's, the window's and the declared
    output's static shapes allow (at most MAX_ALTERNATIVES)."""
    from compiler.convert_ops import MAX_ALTERNATIVES

    names = {pos: node.input[pos] if len(node.input) > pos else "" for pos in (1, 3)}
    known = {pos: int(np.asarray(consts[n]).reshape(-1)[0]) for pos, n in names.items() if n in consts}
    window = node.input[2] if len(node.input) > 2 else ""
    wlen = None
    if window:
        wdims = list(consts[window].shape) if window in consts else _static(shapes, window, label, "window")
        if len(wdims) != 1 or known.get(3, wdims[0]) != wdims[0]:
            raise ModelError(f"{label}: window {wdims} for frame_length {known.get(3)}", hint="fix the model")
        wlen = wdims[0]
    out = shapes.get(node.output[0]) or []
    onesided = bool(_attr(node, "onesided", 1))
    if 3 in known or wlen is not None:
        lengths = [known.get(3, wlen or 0)]
    elif names[3] and len(out) == 4 and out[2] > 0:
        lengths = [2 * (out[2] - 1), 2 * out[2] - 1] if onesided else [out[2]]
    else:
        lengths = []
    pairs = []
    for flen in lengths:
        fits = len(out) == 4 and 0 < flen <= dims[1]
        steps = (
            [known[1]]
            if 1 in known
            else [s for s in range(1, dims[1] + 1) if fits and (dims[1] - flen) // s + 1 == out[1]]
        )
        pairs += [(s, flen) for s in steps]
    if not 0 < len(pairs) <= MAX_ALTERNATIVES:
        pos = 1 if 1 not in known else 3
        what = "frame_step" if pos == 1 else "frame_length"
        raise ModelError(
            f"{label}: {what} {names[pos]!r} is known only at run time and the static shapes allow "
            f"{len(pairs)} values; output shapes decided at run time are not supported for this operator",
            hint=f"make {what} a constant (initializer) of the model",
        )
    alternatives = [
        {names[pos]: np.array(v) for pos, v in ((1, step), (3, flen)) if names[pos] and pos not in known}
        for step, flen in pairs
    ]
    return pairs, alternatives


def _tensor_scatter(bld: Any, node: Any, shapes: dict[str, list[int]], label: str) -> None:
    cache, update = node.input[:2]
    writes = node.input[2] if len(node.input) > 2 else ""
    dims = _static(shapes, cache, label, "past_cache")
    upd = _static(shapes, update, label, "update")
    axis = int(_attr(node, "axis", -2)) % len(dims)
    if axis == 0 or len(upd) != len(dims):
        raise ModelError(
            f"{label}: axis {axis} of a rank-{len(dims)} cache; the sequence axis follows the batch",
            hint="fix the model",
        )
    grid = np.indices(upd[: axis + 1], dtype=np.int64)
    length = dims[axis]
    pos = bld.const(grid[axis], "seq")
    if writes:
        start = bld.op("Gather", [bld.op("Cast", [writes], to=7), bld.const(grid[0], "batch")], axis=0)
        pos = bld.op("Add", [start, pos])
    if _attr(node, "mode", "linear") == "circular":
        pos = bld.op("Mod", [pos, bld.const(np.array(length, np.int64), "length")])
    else:
        pos = bld.op("Min", [pos, bld.const(np.array(length - 1, np.int64), "last")])
        pos = bld.op("Max", [pos, bld.const(np.array(0, np.int64), "first")])
    last = bld.const(np.array([-1], np.int64), "axes")
    parts = [
        bld.op("Unsqueeze", [bld.const(grid[j], "coord") if j < axis else pos, last]) for j in range(axis + 1)
    ]
    coords = bld.op("Concat", parts, axis=-1)
    bld.op("ScatterND", [cache, coords, update], out=node.output[0])


def lower_ops(model: Any) -> bool:
    """Rewrite the nodes listed in the module docstring; True if any was."""
    from compiler.graphbuild import Builder as _Builder
    from compiler.graphbuild import _const_inputs, _elem_types, _opset, _replace_nodes, _static_shapes

    g = model.graph
    if not any(_wanted(n) for n in g.node):
        return False
    shapes = _static_shapes(model)
    types = _elem_types(model)
    consts = _const_inputs(model)
    opset = _opset(model)
    if not any(_wanted(n, types) for n in g.node):
        return False
    new_nodes = []
    for i, node in enumerate(g.node):
        if not _wanted(node, types):
            new_nodes.append(node)
            continue
        label = f"{node.op_type} at node {node.name or f'#{i}'!r}"
        if node.op_type == "ConvTranspose":
            new_nodes.append(_conv_transpose_pads(node, shapes, consts, label))
            continue
        bld = _Builder(model, f"{node.name or node.op_type}_{i}")
        if node.op_type in ("ScatterElements", "Scatter"):
            _scatter_elements(bld, node, shapes, opset, label)
        elif node.op_type == "EyeLike":
            _eye_like(bld, node, shapes, types, label)
        elif node.op_type == "ReverseSequence":
            _reverse_sequence(bld, node, shapes, label)
        elif node.op_type == "SpaceToDepth":
            _space_to_depth_crd(bld, node, shapes, label)
        elif node.op_type == "TensorScatter":
            _tensor_scatter(bld, node, shapes, label)
        elif node.op_type == "DFT":
            _dft(bld, node, shapes, consts, types, opset, label)
        elif node.op_type == "STFT":
            _stft(bld, node, shapes, consts, types, label)
        elif node.op_type in WINDOW_OPS:
            lower_window_node(bld, node, shapes, consts, types, opset, label)
        elif node.op_type in MISC_OPS:
            lower_misc_node(bld, node, shapes, types, opset, label)
        else:
            _batchnorm_training(bld, node, shapes, types, opset, label)
        new_nodes.extend(bld.nodes)
        g.initializer.extend(bld.inits)
    _replace_nodes(g, new_nodes)
    return True
