"""Operators whose shape operand is a model input: output shapes decided at run time (issue 29).

TVM's Relax ONNX frontend needs most shape operands (Reduce* axes, Reshape's shape, ...) as
compile-time constants. When one is a model input instead, the output's *rank* is still static
(the operand has a static length), only its dims are decided at run time. Relax represents that
with symbolic shapes, and its VM allocates such outputs at run time.

This module owns the import of those nodes: :func:`from_onnx` is the frontend's importer with
the converters below tried first, and :func:`runtime_operand_refusal` says which shape operands
may come from a model input (the others are refused at compile time, by name).

- ``Reduce*`` (ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare) with run-time
  ``axes``: a mask of the reduced axes is computed from ``axes``; each axis ``i`` is reduced
  conditionally (``where(mask[i], reduce(y, i, keepdims), y)``: the reduction broadcast back, so
  every intermediate keeps the input's static shape), then the output is cut out with a run-time
  slice (``keepdims=1``: dims of the reduced axes become 1) and reshaped to the kept dims
  (``keepdims=0``: rank ``r - k``). ``axes`` of length 0 is known at compile time
  (``noop_with_empty_axes``). Negative axes count from the end. Duplicate or out-of-range axes
  (invalid in ONNX; onnxruntime reduces a duplicate once, giving a rank other than the one
  declared) stop inference with an error: the number of distinct valid axes is checked against
  ``k`` by a shape match at run time, never a silently different answer.

- Reshape, Expand, Squeeze, Unsqueeze, Slice, Split, TopK and AffineGrid:
  :mod:`compiler.dynshape_ops`; Resize: :mod:`compiler.dynshape_resize`; Pad and CenterCropPad:
  :mod:`compiler.dynshape_pad` (same run-time checks); Tile and ConstantOfShape: TVM's converters
  (they refuse negative values themselves).

Everything downstream copes with symbolic output dims: the manifest records them as -1, the
artifact is compiled for exactly its input shapes (no batch chunking: a run-time operand is not
a batch of samples), and an error the VM raises on such inputs is an InputError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DATA_DEPENDENT", "EMPTY_DIMS_ATTR", "RUNTIME_ATTR", "marked", "REDUCE_OPS", "SHAPE_OPERANDS",
           "data_dependent_node", "from_onnx",
           "runtime_operand_refusal",
           "has_runtime_shape_operand", "shape_operand_inputs"]

# on a Reduce* node (compiler.empty): the dims of the empty data its input stands in for
EMPTY_DIMS_ATTR = "fractal_empty_dims"
# on a node (compiler.dynshape_flow): its shape operand (or Shape's input dims) is a run-time value
RUNTIME_ATTR = "fractal_runtime_operand"


def marked(node: Any) -> bool:
    """Whether :func:`compiler.dynshape_flow.mark_runtime_operands` marked ``node``."""
    return any(a.name == RUNTIME_ATTR for a in node.attribute)


# op -> the opset from which ``axes`` is an input (before it: an attribute)
REDUCE_OPS: dict[str, int] = {
    "ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18, "ReduceMin": 18, "ReduceProd": 18,
    "ReduceL1": 18, "ReduceL2": 18, "ReduceLogSum": 18, "ReduceLogSumExp": 18, "ReduceSumSquare": 18,
}

# op -> input positions that decide an output *shape* (TVM's frontend needs them constant unless
# this module converts the op)
SHAPE_OPERANDS: dict[str, tuple[int, ...]] = {
    "Expand": (1,), "Reshape": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Upsample": (1,), "Resize": (2, 3), "Slice": (1, 2, 3, 4), "Pad": (1, 3), "Split": (1,),
    "SplitToSequence": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "OneHot": (1,), "TopK": (1,),
    "AffineGrid": (1,), "CenterCropPad": (1,), "Col2Im": (1, 2),
    **{op: (1,) for op in REDUCE_OPS},
}

# op -> (first opset whose converter below applies, positions of its shape operands)
_OWN: dict[str, tuple[int, tuple[int, ...]]] = {
    "Reshape": (5, (1,)), "Expand": (8, (1,)), "Squeeze": (13, (1,)), "Unsqueeze": (13, (1,)),
    "Slice": (10, (1, 2, 3, 4)), "Resize": (11, (2, 3)), "Split": (13, (1,)), "TopK": (10, (1,)),
    "Pad": (11, (1, 3)), "CenterCropPad": (18, (1,)), "AffineGrid": (20, (1,)), "Range": (11, (0, 1, 2)),
    "OneHot": (11, (1,)),
    **{op: (v, (1,)) for op, v in REDUCE_OPS.items()},
}
# ops only this module converts (TVM has no converter)
_ONLY_HERE = frozenset({"CenterCropPad"})
# op -> further inputs the converter needs as constants when they are (its axes)
_CONST_INPUTS: dict[str, tuple[int, ...]] = {}
# ops whose run-time shape operand compiles (checked against onnxruntime, tests/compiler/test_dynshape.py):
# this module's converters, and TVM's for Tile and ConstantOfShape (which refuse negative dims)
_CONVERTED: frozenset[str] = frozenset({*_OWN, "Tile", "ConstantOfShape"})


def runtime_operand_refusal(op: str, position: int) -> str | None:
    """Why ``op`` cannot take its input ``position`` from a model input, or None when it can."""
    if position not in SHAPE_OPERANDS.get(op, ()):
        return None
    if op in _CONVERTED:
        return None
    return "output shapes decided at run time are not supported for this operator"


def shape_operand_inputs(model: Any) -> set[str]:
    """The model inputs some node takes as a shape operand (directly). Such an input may have
    length 0 (an empty ``axes``), unlike the data inputs."""
    inits = {t.name for t in model.graph.initializer}
    runtime = {i.name for i in model.graph.input if i.name not in inits}
    return {node.input[pos] for node in model.graph.node for pos in SHAPE_OPERANDS.get(node.op_type, ())
            if pos < len(node.input) and node.input[pos] in runtime}


# ops with an output whose length depends on the input *values* (compiled unbatched, output dims -1)
DATA_DEPENDENT: frozenset[str] = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression"})


def data_dependent_node(model: Any) -> str | None:
    """``"Op at node 'name'"`` for the first node of ``model`` whose output length depends on the
    data (NonZero, Unique, ...), or None."""
    for idx, node in enumerate(model.graph.node):
        if node.op_type in DATA_DEPENDENT and node.domain in ("", "ai.onnx"):
            return f"{node.op_type} at node {node.name or f'#{idx}'!r}"
    return None


def has_runtime_shape_operand(model: Any) -> bool:
    """Whether a node of ``model`` takes a shape operand from a model input (directly, or computed
    from one: :mod:`compiler.dynshape_flow`), or checks one's value at run time (a guard of
    :mod:`compiler.convert_ops`)."""
    from compiler.convert_ops import guarded

    return bool(shape_operand_inputs(model)) or any(guarded(n) or marked(n) for n in model.graph.node)


# ------------------------------------------------------------------------------------- Reduce*
def _rank_and_len(data: Any, axes: Any) -> tuple[int, int] | None:
    """(rank of ``data``, static length of ``axes``) or None if either is unknown."""
    from tvm import relax, tirx

    dty, aty = data.ty, axes.ty
    if not isinstance(dty, relax.TensorType) or not isinstance(aty, relax.TensorType) or dty.ndim < 0:
        return None
    if aty.shape is None or aty.ndim != 1:
        return None
    k = aty.shape.values[0]
    if not isinstance(k, tirx.IntImm):
        return None
    return int(dty.ndim), int(k.value)


def _reduce_all(op: str, x: Any, keepdims: bool) -> Any:
    """``op`` over every axis (the static case of an empty ``axes``)."""
    from tvm import relax

    rank = x.ty.ndim
    axes = list(range(rank))
    fold, pre, post = _PARTS[op]
    if op == "ReduceLogSumExp":
        m = relax.op.max(x, axes, True)
        out = relax.op.add(relax.op.log(relax.op.sum(relax.op.exp(relax.op.subtract(x, m)), axes, True)), m)
        return out if keepdims else relax.op.squeeze(out, axes)
    return post(fold(pre(x), axes, keepdims))


def _square(x: Any) -> Any:
    from tvm import relax

    return relax.op.multiply(x, x)


def _ident(x: Any) -> Any:
    return x


def _folds() -> dict[str, Callable[[Any, Any, bool], Any]]:
    from tvm import relax

    return {"sum": relax.op.sum, "mean": relax.op.mean, "max": relax.op.max, "min": relax.op.min,
            "prod": relax.op.prod}


class _Parts:
    """(fold over axes, elementwise before, elementwise after) of each Reduce op."""

    def __getitem__(self, op: str) -> tuple[Callable[[Any, Any, bool], Any], Callable[[Any], Any],
                                            Callable[[Any], Any]]:
        from tvm import relax

        f = _folds()
        table = {
            "ReduceSum": (f["sum"], _ident, _ident), "ReduceMean": (f["mean"], _ident, _ident),
            "ReduceMax": (f["max"], _ident, _ident), "ReduceMin": (f["min"], _ident, _ident),
            "ReduceProd": (f["prod"], _ident, _ident), "ReduceL1": (f["sum"], relax.op.abs, _ident),
            "ReduceL2": (f["sum"], _square, relax.op.sqrt), "ReduceSumSquare": (f["sum"], _square, _ident),
            "ReduceLogSum": (f["sum"], _ident, relax.op.log), "ReduceLogSumExp": (f["sum"], _ident, _ident),
        }
        return table[op]


_PARTS = _Parts()


def _i64(value: Any) -> Any:
    from tvm import relax

    return relax.const(value, "int64")


def _masked_fold(bb: Any, fold: Callable[[Any, Any, bool], Any], y: Any, mask: Any, rank: int) -> Any:
    """``fold`` over the axes ``i`` with ``mask[i]``, each result broadcast back along its axis
    (so ``y`` keeps its shape)."""
    from tvm import relax

    for i in range(rank):
        m = bb.normalize(relax.op.take(mask, _i64(i), axis=0))
        y = bb.normalize(relax.op.where(m, fold(y, [i], True), y))
    return y


def _shape_of(bb: Any, x: Any, dims: Any, bad: Any) -> Any:
    """``x`` reshaped to the run-time shape ``dims`` (an int64 [n] tensor) when ``bad`` is 0."""
    from tvm import relax

    from compiler.dynshape_ops import checked_shape

    return relax.op.reshape(x, checked_shape(bb, dims, bad, "reduced"))


def _convert_reduce(bb: Any, op: str, inputs: list[Any], attrs: dict[str, Any]) -> Any:
    from tvm import relax

    from compiler.dynshape_ops import axes_mask, compact

    data, axes = inputs[0], inputs[1]
    # compiler.empty: data is the reduction's identity standing in for an empty tensor of these dims
    empty = attrs.get(EMPTY_DIMS_ATTR)
    if isinstance(data.ty, relax.TensorType) and data.ty.dtype == "bool":  # TVM reduces no bool
        out = _convert_reduce(bb, op, [bb.normalize(relax.op.astype(data, "int8")), axes], attrs)
        return relax.op.astype(bb.normalize(out), "bool")
    found = _rank_and_len(data, axes)
    if found is None:
        raise ValueError(f"{op} with run-time axes needs a known input rank and a static axes length")
    rank, k = found
    keepdims = bool(attrs.get("keepdims", 1))
    if k == 0:  # known at compile time
        return data if attrs.get("noop_with_empty_axes", 0) else _reduce_all(op, data, keepdims)
    mask_i, bad = axes_mask(bb, axes, rank)  # [rank] 0/1; bad: a repeated or out-of-range axis
    mask = bb.normalize(relax.op.astype(mask_i, "bool"))
    fold, pre, post = _PARTS[op]
    if empty is not None:  # nothing to reduce: the identity, cut to the output's dims below
        y = data
    elif op == "ReduceLogSumExp":
        m = _masked_fold(bb, _folds()["max"], data, mask, rank)
        s = _masked_fold(bb, fold, bb.normalize(relax.op.exp(relax.op.subtract(data, m))), mask, rank)
        y = bb.normalize(relax.op.add(relax.op.log(s), m))
    else:
        y = bb.normalize(post(_masked_fold(bb, fold, bb.normalize(pre(data)), mask, rank)))
    dims = _i64(list(empty)) if empty is not None else \
        bb.normalize(relax.op.shape_to_tensor(relax.op.shape_of(data)))
    kept = bb.normalize(relax.op.where(mask, _i64(1), dims))  # keepdims=1 output dims
    zeros, ones = _i64([0] * rank), _i64([1] * rank)
    cut = bb.normalize(relax.op.dynamic_strided_slice(y, zeros, kept, ones))
    if keepdims:
        return _shape_of(bb, cut, kept, bad)
    if k > rank:
        raise ValueError(f"{op} reduces {k} axes of a rank-{rank} input")
    keep = bb.normalize(relax.op.subtract(_i64(1), mask_i))
    return _shape_of(bb, cut, compact(bb, dims, keep, rank, rank - k), bad)


def _convert(bb: Any, op: str, inputs: list[Any], attrs: dict[str, Any]) -> Any:
    from compiler import dynshape_ops as ops

    def at(i: int) -> Any:
        return inputs[i] if i < len(inputs) else None

    if op in REDUCE_OPS:
        return _convert_reduce(bb, op, inputs, attrs)
    if op == "Reshape":
        return ops.convert_reshape(bb, inputs[0], inputs[1], bool(attrs.get("allowzero", 0)))
    if op == "Expand":
        return ops.convert_expand(bb, inputs[0], inputs[1])
    if op == "Squeeze":
        return ops.convert_squeeze(bb, inputs[0], inputs[1])
    if op == "Unsqueeze":
        return ops.convert_unsqueeze(bb, inputs[0], inputs[1])
    if op == "Resize":
        from compiler.dynshape_resize import convert_resize

        return convert_resize(bb, inputs[0], at(1), at(2), at(3), attrs)
    if op in ("Pad", "CenterCropPad"):
        from compiler import dynshape_pad as pad

        if op == "CenterCropPad":
            return pad.convert_center_crop_pad(bb, inputs[0], inputs[1], attrs.get("axes"))
        mode = attrs.get("mode", b"constant")
        return pad.convert_pad(bb, inputs[0], inputs[1], at(2), at(3),
                               mode.decode() if isinstance(mode, bytes) else str(mode))
    if op == "Split":
        return ops.convert_split(bb, inputs[0], inputs[1], int(attrs.get("axis", 0)),
                                 int(attrs["tvm_custom"]["num_outputs"]))
    if op == "TopK":
        return ops.convert_topk(bb, inputs[0], inputs[1], int(attrs.get("axis", -1)),
                                bool(attrs.get("largest", 1)), bool(attrs.get("sorted", 1)))
    if op == "AffineGrid":
        return ops.convert_affine_grid(bb, inputs[0], inputs[1], bool(attrs.get("align_corners", 0)))
    if op == "OneHot":
        return ops.convert_onehot(bb, inputs[0], inputs[1], inputs[2], int(attrs.get("axis", -1)))
    if op == "Range":
        return ops.convert_range(bb, inputs[0], inputs[1], inputs[2])
    return ops.convert_slice(bb, inputs[0], inputs[1], inputs[2], at(3), at(4))


def _computed(e: Any) -> bool:
    """Whether the operand ``e`` is a tensor computed at run time (not a constant, not a ShapeExpr)."""
    import tvm
    from tvm import relax

    return isinstance(e.ty, relax.TensorType) and not isinstance(e, tvm.ir.GenericConst)


def _shape_tensor(bb: Any, x: Any, attrs: dict[str, Any]) -> Any:
    """ONNX Shape (``start`` / ``end`` attributes) as an int64 tensor of ``x``'s run-time dims."""
    from tvm import relax

    from compiler.dynshape_ops import dims_of

    dims = dims_of(bb, x)
    rank = x.ty.ndim
    start, end = int(attrs.get("start", 0)), attrs.get("end")
    if start == 0 and end is None:
        return dims
    if rank < 0:
        raise ValueError("Shape with start / end of a tensor of unknown rank")
    lo, hi = slice(start, None if end is None else int(end)).indices(rank)[:2]
    return relax.op.strided_slice(dims, axes=[0], begin=[lo], end=[max(lo, hi)])


# ------------------------------------------------------------------------------------- importer
def _importer_class() -> type:
    from tvm import relax
    from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter, get_constant

    class Importer(ONNXGraphImporter):  # type: ignore[misc]
        """The frontend's importer with this module's converters tried first: for a node whose
        shape operand is a model input itself (a shape computed in the graph, e.g. from ``Shape``,
        stays with the frontend, which keeps such shapes static)."""

        def _convert_operator(self, op_name: str, inputs: list[Any], attrs: dict[str, Any],
                              opset: int) -> Any:
            from compiler.convert_ops import GUARD_ATTR, OWN_CONVERTERS, convert_guard
            runtime = bool(attrs.pop(RUNTIME_ATTR, 0))  # (compiler.dynshape_flow)
            if runtime and op_name == "Shape":  # dims decided at run time: a tensor, not a ShapeExpr
                return self.bb.normalize(_shape_tensor(self.bb, inputs[0], attrs))
            if op_name in OWN_CONVERTERS:  # operators TVM has no converter for (compiler.convert_ops)
                return self.bb.normalize(OWN_CONVERTERS[op_name](self.bb, inputs, attrs))
            if op_name == "Where" and GUARD_ATTR in attrs:  # a run-time value check (compiler.convert_ops)
                return self.bb.normalize(convert_guard(self.bb, inputs, attrs))
            if op_name == "NonMaxSuppression" and opset >= 10:  # TVM's drops run-time thresholds
                from compiler.dataops import convert_nms

                return self.bb.normalize(convert_nms(self.bb, list(inputs), attrs))
            if op_name == "Unique" and opset >= 11:  # TVM's calls numpy (its inverse's shape varies)
                from compiler.dataops import convert_unique

                return convert_unique(self.bb, list(inputs), attrs)
            if op_name == "Compress" and len(inputs) > 1:  # a condition past the axis would read past it
                from compiler.dataops import clip_condition

                inputs[1] = clip_condition(self.bb, inputs[0], inputs[1], attrs.get("axis"))
            if op_name in ("Tile", "ConstantOfShape"):  # TVM's converters, with the size bound
                pos = 1 if op_name == "Tile" else 0
                operand = (get_constant(inputs[pos], [self._nodes, self._params]) if pos < len(inputs)
                           else None)
                if operand is not None and _computed(operand):
                    from compiler.dynshape_ops import budget_operand

                    inputs[pos] = budget_operand(self.bb, op_name, inputs)
            own = _OWN.get(op_name)
            if own is not None and opset >= own[0]:
                params = [self._nodes, self._params]
                # in place: the frontend's input list answers None past its end (its converters
                # read optional inputs such as Slice's steps that way); a plain list would raise
                for i in (*own[1], *_CONST_INPUTS.get(op_name, ())):
                    if i < len(inputs) and inputs[i] is not None:
                        inputs[i] = get_constant(inputs[i], params)
                graph_inputs = list(self._inputs.values())
                operands = [i for i in own[1] if i < len(inputs) and inputs[i] is not None]
                if runtime and any(_computed(inputs[i]) for i in operands):
                    for i in operands:  # (a ShapeExpr beside the run-time tensor: as a tensor too)
                        if isinstance(inputs[i], relax.ShapeExpr):
                            inputs[i] = self.bb.normalize(relax.op.shape_to_tensor(inputs[i]))
                    return self.bb.normalize(_convert(self.bb, op_name, inputs, attrs))
                if any(any(inputs[i].same_as(g) for g in graph_inputs) for i in operands):
                    return self.bb.normalize(_convert(self.bb, op_name, inputs, attrs))
            if op_name == "Resize" and attrs.get("nearest_mode") in (b"simple", "simple"):
                raise ValueError("an Upsample / Resize-10 (upgraded to Resize) rounds up on axes it shrinks "
                                 "and down on those it grows; with constant scales one rounding must fit all")
            return super()._convert_operator(op_name, inputs, attrs, opset)

        def _check_for_unsupported_ops(self, graph: Any) -> None:
            # ops TVM has no converter for, left whole for this module (compiler.expand's
            # KEPT_WHEN_RUNTIME: only when their operand is a model input, which routes them here)
            # or converted by compiler.convert_ops (OWN_CONVERTERS)
            from types import SimpleNamespace

            from compiler.convert_ops import OWN_CONVERTERS

            nodes = [n for n in graph.node if n.op_type not in _ONLY_HERE and n.op_type not in OWN_CONVERTERS]
            super()._check_for_unsupported_ops(SimpleNamespace(node=nodes))

    return Importer


def from_onnx(model: Any, *, shape_dict: dict[str, list[int]], opset: int | None,
              keep_params_in_input: bool = True) -> Any:
    """``tvm.relax.frontend.onnx.from_onnx`` with this module's converters (same arguments)."""
    if opset is None:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    importer = _importer_class()(shape_dict, "float32", keep_params_in_input=keep_params_in_input)
    return importer.from_onnx(model.graph, opset)
