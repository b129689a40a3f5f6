"""Shape operands computed in the graph from model inputs' values (see :mod:`compiler.dynshape`).

:mod:`compiler.dynshape` converts a node whose shape operand *is* a model input. A function body
expanded by :mod:`compiler.expand` (CenterCropPad's, AffineGrid's) computes such operands from
one instead: ``pads = Concat(Sub(Max(Shape(x), shape), ...))`` with ``shape`` a model input. After
constant folding (which turns every ``Shape`` of a statically shaped tensor into a constant),
:func:`mark_runtime_operands` follows the values of the model inputs through the graph:

- a *run-time value* is a model input, or the output of a node reading one (a ``Shape`` / ``Size``
  reads only its input's dims: its output is a run-time value when those dims are);
- a tensor has *run-time dims* when a node made it from a run-time shape operand
  (:data:`compiler.dynshape.SHAPE_OPERANDS`), or from a tensor with run-time dims.

It marks (attribute :data:`RUNTIME_ATTR`) the nodes whose shape operand is a run-time value, which
the importer then converts like those taking a model input, and the ``Shape`` nodes of tensors
with run-time dims, converted to an int64 tensor of the dims (TVM's frontend gives a ShapeExpr of
symbolic dims, which its elementwise converters refuse). A shape computed from ``Shape`` alone (a
symbolic batch dim) is neither: it stays with the frontend, which keeps such shapes symbolic.
"""

from __future__ import annotations

from typing import Any

from compiler.dynshape import RUNTIME_ATTR, SHAPE_OPERANDS, marked  # dynshape reads the marks: defined there

__all__ = ["RUNTIME_ATTR", "marked", "mark_runtime_operands", "runtime_values"]

_READS_DIMS = frozenset({"Shape", "Size"})
_GRAPH, _GRAPHS = 5, 10  # AttributeProto types holding subgraphs


def _flow(model: Any) -> tuple[set[str], set[str]]:
    """(run-time values, tensors with run-time dims) of ``model``'s main graph."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    values = {i.name for i in g.input if i.name not in inits}
    dims: set[str] = set()
    for node in g.node:
        ins = [i for i in node.input if i]
        subgraphs = [sub for a in node.attribute
                     for sub in ([a.g] if a.type == _GRAPH else list(a.graphs) if a.type == _GRAPHS else [])]
        if subgraphs:  # its outputs: run-time values if it reads one (or its subgraphs do)
            read = {i for sub in subgraphs for n in sub.node for i in n.input}
            if any(i in values or i in dims for i in [*ins, *read]):
                values.update(o for o in node.output if o)
                dims.update(o for o in node.output if o)
            continue
        if node.op_type in _READS_DIMS:
            if any(i in dims for i in ins):
                values.update(o for o in node.output if o)
            continue
        shape_ops = [node.input[p] for p in SHAPE_OPERANDS.get(node.op_type, ()) if p < len(node.input)]
        if any(i in dims for i in ins) or any(i in values for i in shape_ops):
            dims.update(o for o in node.output if o)
        if any(i in values or i in dims for i in ins):
            values.update(o for o in node.output if o)
    return values, dims


def runtime_values(model: Any) -> set[str]:
    """The names of ``model``'s run-time values (model inputs and what is computed from them)."""
    return _flow(model)[0]


def mark_runtime_operands(model: Any) -> bool:
    """Mark the nodes whose shape operand is a run-time value computed in the graph, and the
    ``Shape`` nodes of tensors with run-time dims; returns whether any was marked."""
    import onnx

    g = model.graph
    inputs = {i.name for i in g.input}
    values, dims = _flow(model)
    changed = False
    for node in g.node:
        if node.domain not in ("", "ai.onnx") or marked(node):
            continue
        if node.op_type == "Shape":
            hit = bool(node.input) and node.input[0] in dims
        else:
            ops = [node.input[p] for p in SHAPE_OPERANDS.get(node.op_type, ()) if p < len(node.input)]
            hit = any(i in values and i not in inputs for i in ops)  # (model inputs: compiler.dynshape)
        if hit:
            node.attribute.append(onnx.helper.make_attribute(RUNTIME_ATTR, 1))
            changed = True
    return changed
