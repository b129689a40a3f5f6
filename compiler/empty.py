"""Empty data tensors (issue 29): a model input given a zero dim (``--shape data=2,0,4``).

A tensor of static shape with a zero dim has no elements: its value is known at compile time, so
what a node computes from it is known too, and no compiled code has to read it (TVM's kernels
refuse such an argument at run time, "Mismatched data.strides"; its importer fails on some ops).
:func:`fold_empty`, a preparation step, answers the nodes that read one:

- every input known (empty, or a constant): the node is evaluated at compile time by ONNX's
  reference implementation (the specification's own arithmetic: ReduceSum over an empty set is 0,
  ReduceProd 1, ReduceMax -inf or the type's lowest value, ReduceLogSum -inf, MatMul with an
  inner dim of 0 is zeros, ``Shape`` is the dims) and becomes a constant. A result with a NaN the
  inputs did not have (ReduceMean over nothing: 0 / 0) is not taken: left to the check below.
- ``Reduce*`` with ``axes`` a model input (which axes is decided at run time): the data becomes a
  stand-in filled with the reduction's identity (shape: the zero dims made 1) and the node is
  marked with the empty dims (:data:`EMPTY_DIMS_ATTR`); :mod:`compiler.dynshape`'s run-time-axes
  converter then cuts the stand-in to the output's dims (a kept zero dim: an empty output).
- ``Concat``: an empty operand adds nothing and is dropped.
- nodes whose outputs are all empty (shape inference: static dims with a 0) compute nothing and
  stay (the artifact answers an empty model output itself, :mod:`compiler.importer`), as do the
  ops that cannot make elements out of none (:data:`SHRINKING`: Reshape, Split, Slice, ... with
  run-time shape operands, whose output dims only the run time knows).

Any other node still reading an empty tensor is refused at compile time by name: its answer would
be TVM's arithmetic over nothing, which no test checks (a wrong answer is worse than a refusal).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from compiler.dynshape import EMPTY_DIMS_ATTR  # read by dynshape's Reduce converter: defined there
from compiler.errors import ModelError

__all__ = ["EMPTY_DIMS_ATTR", "SHRINKING", "empty_inputs", "fold_empty"]

# ops whose output has at most as many elements as their data input (one of them empty: none),
# whatever the values of their shape operands
SHRINKING = frozenset({"Reshape", "Split", "Slice", "Squeeze", "Unsqueeze", "Flatten", "Transpose",
                       "Identity", "Expand", "Tile", "TopK", "Cast"})

_MAX_FOLD = 1 << 22  # elements of a constant answer (a bigger one stays a node, refused below)


def empty_inputs(model: Any, shapes: dict[str, list[int]] | None) -> set[str]:
    """Model inputs ``shapes`` (``--shape``) gives a zero dim, other than the shape operands and
    dtype carriers that could always be empty: the data tensors :func:`fold_empty` answers."""
    from compiler.dynshape import shape_operand_inputs
    from compiler.graphbuild import dtype_only_inputs

    inits = {t.name for t in model.graph.initializer}
    names = {i.name for i in model.graph.input if i.name not in inits}
    asked = {n for n, dims in (shapes or {}).items() if n in names and 0 in dims}
    return asked - shape_operand_inputs(model) - dtype_only_inputs(model) if asked else set()


def _data_positions(node: Any) -> list[int]:
    """Input positions of ``node`` whose values it reads (not its shape operands, not CastLike's
    dtype-only ``target_type``)."""
    from compiler.dynshape import SHAPE_OPERANDS

    skip = set(SHAPE_OPERANDS.get(node.op_type, ()))
    if node.op_type == "CastLike":
        skip.add(1)
    return [p for p, name in enumerate(node.input) if name and p not in skip]


def _inferred(model: Any) -> tuple[dict[str, list[int]], dict[str, int]]:
    """(static dims, element types) by shape inference from the inputs alone: the graph outputs'
    declared shapes are cleared first (a run-time shape operand's output may be declared with
    dims its run-time values do not give)."""
    import copy

    import onnx

    m = copy.deepcopy(model)
    for out in m.graph.output:
        out.type.tensor_type.ClearField("shape")
    del m.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:
        return {}, {}
    dims: dict[str, list[int]] = {}
    types: dict[str, int] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tt = vi.type.tensor_type
        if tt.elem_type:
            types[vi.name] = tt.elem_type
        if tt.HasField("shape"):
            dims[vi.name] = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
    return dims, types


def _is_empty(dims: list[int] | None) -> bool:
    return dims is not None and 0 in dims and all(d >= 0 for d in dims)


def _where(node: Any, idx: int) -> str:
    return f"{node.op_type} at node {node.name or f'#{idx}'!r}"


def _np_dtype(elem: int) -> np.dtype:
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


def _no_new_nan(result: list[np.ndarray], inputs: list[np.ndarray | None]) -> bool:
    """Whether ``result`` has a NaN only where an input had one (ReduceMean over nothing: 0 / 0)."""
    def nan(a: np.ndarray) -> bool:
        return a.dtype.kind in "fc" and bool(np.isnan(a).any())

    return not any(nan(r) for r in result) or any(a is not None and nan(a) for a in inputs)


def _identity(op: str, dtype: np.dtype, opset: int) -> np.ndarray | None:
    """``op``'s value over an empty set of ``dtype`` (ONNX's reference implementation), or None
    when it has none (ReduceMean: 0 / 0) or the reference cannot tell."""
    from onnx import helper

    from compiler.graphbuild import _eval_node

    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=0)
    with warnings.catch_warnings():  # numpy's "Mean of empty slice"
        warnings.simplefilter("ignore")
        got = _eval_node(node, opset, [np.empty((0,), dtype), np.array([0], np.int64)])
    if not got or got[0].shape != () or not _no_new_nan(got, []):
        return None
    return np.asarray(got[0], dtype)


def _stand_in(bld: Any, node: Any, dims: list[int], dtype: np.dtype, opset: int) -> bool:
    """Make the run-time-axes Reduce ``node`` read a stand-in of ``dims`` (zeros made 1) filled with
    its identity, marked with the empty dims; False if the op has no identity for ``dtype``."""
    from onnx import helper

    ident = _identity(node.op_type, dtype, opset)
    full = [d or 1 for d in dims]
    if ident is None or int(np.prod(full)) > _MAX_FOLD:
        return False
    node.input[0] = bld.const(np.full(full, ident, dtype), "identity")
    node.attribute.append(helper.make_attribute(EMPTY_DIMS_ATTR, [int(d) for d in dims]))
    return True


def fold_empty(model: Any, shapes: dict[str, list[int]] | None = None) -> bool:
    """Answer at compile time what the nodes compute from empty data inputs (see the module
    docstring); refuse, by name, a node still reading one whose output may have elements.
    ``shapes``: the ``--shape`` dims (an input given a zero dim there is empty)."""
    from onnx import numpy_helper

    from compiler.dynshape import REDUCE_OPS
    from compiler.graphbuild import (
        Builder,
        _const_inputs,
        _drop_dead_nodes,
        _drop_unused_initializers,
        _eval_node,
        _opset,
        _replace_nodes,
    )

    sources = empty_inputs(model, shapes)
    if not sources:
        return False
    g = model.graph
    opset = _opset(model)
    dims, types = _inferred(model)
    inits = {t.name for t in g.initializer}
    runtime = {i.name for i in g.input if i.name not in inits}
    consts = _const_inputs(model)
    empty = set(sources)  # tensors known to be empty: the sources and what nodes make of them
    bld = Builder(model, "empty")
    new_nodes: list[Any] = []
    changed = False
    for node in g.node:
        reads = [p for p in _data_positions(node) if node.input[p] in empty]
        if not reads or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        empty.update(o for o in node.output if o and _is_empty(dims.get(o)))

        def value(name: str) -> np.ndarray | None:
            if not name:
                return None
            if name in empty and _is_empty(dims.get(name)) and name in types:
                return np.empty(dims[name], _np_dtype(types[name]))
            return consts.get(name)

        values = [value(i) for i in node.input]
        known = all(v is not None or not i for v, i in zip(values, node.input, strict=True))
        outs_empty = all(_is_empty(dims.get(o)) for o in node.output if o)
        if known and not outs_empty and not any(a.type in (5, 10) for a in node.attribute):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = _eval_node(node, opset, values)
            if got is not None and len(got) == len(node.output) and _no_new_nan(got, values) and \
                    all(r.size and r.size <= _MAX_FOLD and r.dtype != object for r in got):
                for name, r in zip(node.output, got, strict=True):
                    if name in types:  # the reference may widen (numpy's int64 sums)
                        r = r.astype(_np_dtype(types[name]))
                    consts[name] = r
                    bld.inits.append(numpy_helper.from_array(np.array(r, order="C"), name))
                changed = True
                continue
        if node.op_type in REDUCE_OPS and opset >= REDUCE_OPS[node.op_type] and reads == [0] and \
                len(node.input) > 1 and node.input[1] in runtime and node.input[0] in types and \
                (dims.get(node.input[1]) or [0])[0] > 0 and _is_empty(dims.get(node.input[0])):
            if _stand_in(bld, node, dims[node.input[0]], _np_dtype(types[node.input[0]]), opset):
                new_nodes.append(node)
                changed = True
                continue
        if node.op_type == "Concat" and not outs_empty:
            keep = [i for i in node.input if i not in empty]
            if keep:
                del node.input[:]
                node.input.extend(keep)
                changed = True
        new_nodes.append(node)
    if changed:
        _replace_nodes(g, new_nodes)
        g.initializer.extend(bld.inits)
        _drop_dead_nodes(model)
        _drop_unused_initializers(model)
    _check_reads(model, sources)
    return changed


def _check_reads(model: Any, sources: set[str]) -> None:
    """Refuse a node that still reads an empty tensor and may give elements from it."""
    dims, _ = _inferred(model)
    empty = set(sources)
    for idx, node in enumerate(model.graph.node):
        reads = [node.input[p] for p in _data_positions(node) if node.input[p] in empty]
        if not reads:
            continue
        outs = [o for o in node.output if o]
        if all(_is_empty(dims.get(o)) for o in outs) or \
                (node.op_type in SHRINKING and node.domain in ("", "ai.onnx")):
            empty.update(outs)
            continue
        shape = dims.get(reads[0])
        raise ModelError(f"{_where(node, idx)} reads the empty tensor {reads[0]!r} (shape {shape}) and its "
                         "output is not empty: what it computes from no elements is not supported",
                         hint="give that input at least one element along every dimension")
