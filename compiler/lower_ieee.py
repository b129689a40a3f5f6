"""IEEE edge cases TVM's converters get wrong, rewritten in the preparation stage (issue 29).

Inference takes NaN and infinities (compiler.artifact._convert), so the results ONNX defines for
them must come out. Found by ONNX's operator suite:

* IsInf with ``detect_positive=0`` or ``detect_negative=0``: TVM ignores both attributes (every
  infinity was reported). The sign is tested as ``x < -x``, which needs no constant of x's type.
* Float Mod by an infinite divisor: TVM computes ``x - floor(x / y) * y`` (``trunc`` for
  ``fmod=1``), and ``0 * inf`` is NaN; ONNX (numpy, C's fmod) gives ``x`` for a finite x (and, for
  ``fmod=0`` with signs that differ, ``y``). Other IEEE cases already come out right (a NaN or
  infinite x, a zero divisor: NaN).
"""

from __future__ import annotations

from typing import Any

from compiler.graphbuild import node_attr

__all__ = ["lower_ieee"]

_FLOATS = frozenset({1, 10, 11, 16})  # float, float16, double, bfloat16


def _wanted(node: Any, types: dict[str, int]) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "IsInf":
        return not (node_attr(node, "detect_positive", 1) and node_attr(node, "detect_negative", 1))
    return node.op_type == "Mod" and types.get(node.input[0]) in _FLOATS


def _is_inf(bld: Any, node: Any) -> None:
    x = node.input[0]
    pos, neg = bool(node_attr(node, "detect_positive", 1)), bool(node_attr(node, "detect_negative", 1))
    if not pos and not neg:  # nothing is detected: x < x is false everywhere, NaN included
        bld.op("Less", [x, x], out=node.output[0])
        return
    sign = bld.op("Less", [x, bld.op("Neg", [x])]) if neg else bld.op("Greater", [x, bld.op("Neg", [x])])
    bld.op("And", [bld.op("IsInf", [x]), sign], out=node.output[0])


def _mod(bld: Any, node: Any) -> None:
    x, y = node.input[:2]
    fmod = int(node_attr(node, "fmod", 0))
    plain = bld.op("Mod", [x, y], fmod=fmod)
    finite_x = bld.op("Not", [bld.op("Or", [bld.op("IsInf", [x]), bld.op("IsNaN", [x])])])
    mask = bld.op("And", [bld.op("IsInf", [y]), finite_x])
    if fmod:  # C's fmod(x, +-inf) = x
        bld.op("Where", [mask, x, plain], out=node.output[0])
        return
    # floor mod: x when x is zero or has y's sign, else y (x + y rounds to the infinity y)
    x_neg = bld.op("Less", [x, bld.op("Neg", [x])])
    y_neg = bld.op("Less", [y, bld.op("Neg", [y])])
    same_sign = bld.op("Not", [bld.op("Xor", [x_neg, y_neg])])
    keep_x = bld.op("Or", [same_sign, bld.op("Equal", [x, bld.op("Neg", [x])])])
    bld.op("Where", [mask, bld.op("Where", [keep_x, x, y]), plain], out=node.output[0])


def lower_ieee(model: Any) -> bool:
    """Rewrite the nodes listed in the module docstring; True if any was."""
    from compiler.graphbuild import Builder, _elem_types, _replace_nodes

    g = model.graph
    types = _elem_types(model)
    if not any(_wanted(n, types) for n in g.node):
        return False
    new_nodes = []
    for i, node in enumerate(g.node):
        if not _wanted(node, types):
            new_nodes.append(node)
            continue
        bld = Builder(model, f"{node.name or node.op_type}_ieee{i}")
        (_is_inf if node.op_type == "IsInf" else _mod)(bld, node)
        new_nodes.extend(bld.nodes)
    _replace_nodes(g, new_nodes)
    return True
