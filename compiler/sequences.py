"""Sequences inside a graph resolved in the preparation stage, before TVM's import (issue 29).

A sequence whose length is known at compile time is a list of tensors: each sequence value becomes
the list of its elements' names, and the sequence operators become tensor operators or nothing:

- ``SequenceEmpty`` / ``SequenceConstruct``: the list; ``SequenceInsert`` / ``SequenceErase`` with
  a constant (or no) position: the list edited (negative positions count from the end);
- ``SequenceAt`` with a constant position: an Identity of that element; ``SequenceLength``: a
  constant;
- ``SplitToSequence`` with a static input dim along ``axis`` and a constant (or no) split: a Split
  (plus a Squeeze per piece for ``keepdims=0`` without split);
- ``ConcatFromSequence``: a Concat (``new_axis=1``: of the elements unsqueezed at ``axis``);
- ``SequenceMap``: its body copied once per element (compiler.unroll's copier), the outputs
  collected into lists; ``Identity`` of a sequence: the same list.

All or nothing: when a sequence comes from a model input, reaches a model output or an operator
not listed (a Loop carrying it), or a position / split is known only at run time, the graph is
left as it is, and TVM's converters or the compiler's refusals deal with it (sequence model inputs
and outputs cannot be expressed in the Open Inference Protocol: refused in one line).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.graphbuild import _const_inputs, _static_shapes, node_attr

__all__ = ["SEQUENCE_OPS", "lower_sequences"]

SEQUENCE_OPS = frozenset({"SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase",
                          "SequenceAt", "SequenceLength", "SplitToSequence", "ConcatFromSequence",
                          "SequenceMap"})
_MAX_ROUNDS = 4  # a SequenceMap body's own sequence operators are lowered in the next round


class _Unknown(Exception):
    """A sequence this module cannot resolve at compile time: leave the graph alone."""


def lower_sequences(model: Any) -> bool:
    """Lower every sequence operator of the main graph (see the module doc); False if none or if
    some sequence cannot be resolved (the graph is then unchanged)."""
    changed = False
    for round_ in range(_MAX_ROUNDS):
        g = model.graph
        if not any(n.op_type in SEQUENCE_OPS and n.domain in ("", "ai.onnx") for n in g.node):
            return changed
        try:
            nodes, inits = _lower(model, f"seq{round_}")
        except _Unknown:
            return changed
        del g.node[:]
        g.node.extend(nodes)
        g.initializer.extend(inits)
        del g.value_info[:]
        changed = True
    return changed


def _position(consts: dict[str, np.ndarray], name: str, length: int, insert: bool) -> int:
    if name not in consts or consts[name].size != 1:
        raise _Unknown
    pos = int(consts[name].reshape(()))
    high = length if insert else length - 1
    if not -length <= pos <= high:
        raise _Unknown  # onnxruntime refuses it at run time
    return pos + length if pos < 0 else pos


def _lower(model: Any, prefix: str) -> tuple[list[Any], list[Any]]:
    import onnx

    from compiler.unroll import _Emitter

    g = model.graph
    consts = _const_inputs(model)
    shapes = _static_shapes(model)
    seqs: dict[str, list[str]] = {}
    em = _Emitter(model, prefix)
    outputs = {o.name for o in g.output}

    def seq(name: str) -> list[str]:
        if name not in seqs:
            raise _Unknown
        return seqs[name]

    for node in g.node:
        op = node.op_type
        ins = list(node.input)
        lowered = op in SEQUENCE_OPS or (op == "Identity" and ins[0] in seqs)
        if node.domain not in ("", "ai.onnx") or not lowered:
            if any(i in seqs for i in ins):
                raise _Unknown  # an operator this module does not resolve takes a sequence
            em.nodes.append(node)
            continue
        res = node.output[0]
        if op == "Identity":
            seqs[res] = seq(ins[0])
        elif op == "SequenceEmpty":
            seqs[res] = []
        elif op == "SequenceConstruct":
            seqs[res] = ins
        elif op == "SequenceInsert":
            items = list(seq(ins[0]))
            pos = _position(consts, ins[2], len(items), True) if len(ins) > 2 and ins[2] else len(items)
            items.insert(pos, ins[1])
            seqs[res] = items
        elif op == "SequenceErase":
            items = list(seq(ins[0]))
            if not items:
                raise _Unknown
            pos = _position(consts, ins[1], len(items), False) if len(ins) > 1 and ins[1] else len(items) - 1
            del items[pos]
            seqs[res] = items
        elif op == "SequenceAt":
            items = seq(ins[0])
            em.op("Identity", [items[_position(consts, ins[1], len(items), False)]], out=res)
        elif op == "SequenceLength":
            em.nodes.append(onnx.helper.make_node("Constant", [], [res], name=em.name("length"),
                                                  value=onnx.numpy_helper.from_array(
                                                      np.array(len(seq(ins[0])), np.int64))))
        elif op == "ConcatFromSequence":
            items = seq(ins[0])
            if not items or node_attr(node, "axis") is None:
                raise _Unknown
            axis = int(node_attr(node, "axis"))
            parts = [em.unsqueeze(x, axis) for x in items] if node_attr(node, "new_axis", 0) else items
            if len(parts) > 1:
                em.op("Concat", parts, out=res, axis=axis)
            else:
                em.op("Identity", parts, out=res)
        elif op == "SplitToSequence":
            seqs[res] = _split(em, node, consts, shapes)
        else:  # SequenceMap
            seqs.update(_map(em, node, seqs))
    if any(o in seqs for o in outputs):
        raise _Unknown  # a sequence model output: refused by the importer's output check
    return em.nodes, em.inits


def _split(em: Any, node: Any, consts: dict[str, np.ndarray], shapes: dict[str, list[int]]) -> list[str]:
    import onnx

    x = node.input[0]
    split = node.input[1] if len(node.input) > 1 else ""
    dims = shapes.get(x)
    axis = int(node_attr(node, "axis", 0))
    if split and split not in consts:
        raise _Unknown
    if dims is None or not -len(dims) <= axis < len(dims):
        raise _Unknown
    axis %= len(dims)
    dim = dims[axis]
    if dim <= 0:
        raise _Unknown
    if not split:
        sizes = [1] * dim
    elif consts[split].ndim == 0:
        step = int(consts[split])
        if step <= 0:
            raise _Unknown
        sizes = [min(step, dim - s) for s in range(0, dim, step)]
    else:
        sizes = [int(s) for s in consts[split].reshape(-1)]
        if sum(sizes) != dim or any(s < 0 for s in sizes):
            raise _Unknown
    pieces = [em.name("piece") for _ in sizes]
    if len(pieces) == 1:
        em.op("Identity", [x], out=pieces[0])
    elif em.opset >= 13:
        sizes_in = em.const(np.array(sizes, np.int64), "split")
        em.nodes.append(onnx.helper.make_node("Split", [x, sizes_in], pieces, name=em.name("Split"),
                                              axis=axis))
    else:
        em.nodes.append(onnx.helper.make_node("Split", [x], pieces, name=em.name("Split"), axis=axis,
                                              split=sizes))
    if not split and not node_attr(node, "keepdims", 1):
        if em.opset >= 13:
            axes = em.const(np.array([axis], np.int64), "axes")
            return [em.op("Squeeze", [p, axes]) for p in pieces]
        return [em.op("Squeeze", [p], axes=[axis]) for p in pieces]
    return pieces


def _map(em: Any, node: Any, seqs: dict[str, list[str]]) -> dict[str, list[str]]:
    body = node_attr(node, "body")
    ins = list(node.input)
    if not ins or ins[0] not in seqs or body is None or len(body.input) != len(ins) \
            or len(body.output) != len(node.output):
        raise _Unknown
    length = len(seqs[ins[0]])
    if any(i in seqs and len(seqs[i]) != length for i in ins):
        raise _Unknown  # onnxruntime refuses sequences of different lengths
    results: dict[str, list[str]] = {o: [] for o in node.output}
    for k in range(length):
        bound = {formal.name: (seqs[actual][k] if actual in seqs else actual)
                 for formal, actual in zip(body.input, ins, strict=True)}
        got = em.body(body, bound, f"{node.name or 'map'}_{k}")
        for formal, actual in zip(body.output, node.output, strict=True):
            results[actual].append(got[formal.name])
    return results
