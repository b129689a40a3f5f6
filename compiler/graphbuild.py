"""Helpers the preparation stage's rewrites share: fresh-named ONNX nodes and constants, a
node's attribute by name, constant folding and the graph queries (opset, static shapes, element
types, constant inputs). Imports nothing of the compiler, so every rewrite module (prepare,
unroll, lower_ops, lower_training) and the importer can use it without an import cycle."""

from __future__ import annotations

from typing import Any

import numpy as np


class Builder:
    """Emits nodes and initializers with fresh names under ``prefix``."""

    def __init__(self, model: Any, prefix: str) -> None:
        self.model, self.prefix, self.n = model, prefix, 0
        self.nodes: list[Any] = []
        self.inits: list[Any] = []

    def name(self, hint: str) -> str:
        self.n += 1
        return f"{self.prefix}/{hint}_{self.n}"

    def const(self, arr: np.ndarray, hint: str = "c") -> str:
        from onnx import numpy_helper

        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.array(arr, order="C"), name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        import onnx

        out = out or self.name(op_type.lower())
        self.nodes.append(onnx.helper.make_node(op_type, inputs, [out], name=self.name(op_type), **attrs))
        return out


def node_attr(node: Any, name: str, default: Any = None) -> Any:
    """The value of ``node``'s attribute ``name`` (bytes decoded to str), or ``default``."""
    import onnx

    for a in node.attribute:
        if a.name == name:
            value = onnx.helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


_FOLD_MAX_ELEMENTS = 1 << 16  # do not materialise big tensors (weights stay where they are)
_NO_FOLD = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                      "Bernoulli", "If", "Loop", "Scan", "Dropout"})


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _const_inputs(model: Any) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    vals = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            v = _constant_value(n)
            if v is not None:
                vals[n.output[0]] = v
    return vals


def _elem_types(model: Any) -> dict[str, int]:
    import onnx

    try:
        typed = onnx.shape_inference.infer_shapes(model).graph
    except Exception:
        typed = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*typed.input, *typed.value_info, *typed.output]
             if vi.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def _constant_value(node: Any) -> np.ndarray | None:
    from onnx import numpy_helper

    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None


def dtype_only_inputs(model: Any) -> set[str]:
    """Model inputs whose values no node reads: consumed by nothing, or only as CastLike's ``target_type``
    (which carries just a dtype). Such an input may be empty (ONNX's CastLike cases give a [0] tensor)."""
    inits = {t.name for t in model.graph.initializer}
    names = {i.name for i in model.graph.input if i.name not in inits}
    for node in model.graph.node:
        for pos, name in enumerate(node.input):
            if name in names and not (node.op_type == "CastLike" and pos == 1):
                names.discard(name)
    for out in model.graph.output:
        names.discard(out.name)
    return names


def _static_shapes(model: Any) -> dict[str, list[int]]:
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:
        return {}
    out: dict[str, list[int]] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        out[vi.name] = dims
    return out


def _known(shapes: dict[str, list[int]], name: str) -> bool:
    return name in shapes and all(d > 0 for d in shapes[name])


def _eval_node(node: Any, opset: int, values: list[np.ndarray | None]) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    try:
        ref = ReferenceEvaluator(node, opsets={"": opset})
        feeds = {name: v for name, v in zip(node.input, values, strict=True) if name}
        return [np.asarray(r) for r in ref.run(None, feeds)]
    except Exception:
        return None


def _sequence_lengths(model: Any, consts: dict[str, np.ndarray],
                      shapes: dict[str, list[int]]) -> dict[str, int]:
    """Statically known lengths of sequence values (SequenceConstruct, SplitToSequence)."""
    out: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "SequenceConstruct":
            out[node.output[0]] = len(node.input)
        elif node.op_type == "SplitToSequence" and _known(shapes, node.input[0]):
            split = node.input[1] if len(node.input) > 1 else ""
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = shapes[node.input[0]]
            if not split:
                out[node.output[0]] = dims[axis]
            elif split in shapes and len(shapes[split]) == 1 and shapes[split][0] > 0:
                out[node.output[0]] = shapes[split][0]  # a 1-D split: one piece per entry
            elif split in consts and consts[split].ndim == 0 and int(consts[split]) > 0:
                out[node.output[0]] = -(-dims[axis] // int(consts[split]))
    return out


def fold_constants(model: Any, max_rounds: int = 8) -> bool:
    """Replace statically known values by initializers, until nothing more folds."""
    import onnx
    from onnx import numpy_helper

    g = model.graph
    opset = _opset(model)
    graph_outputs = {o.name for o in g.output}
    changed = False
    for _ in range(max_rounds):
        keep_dq = _weight_dequantizers(g)
        consts: dict[str, np.ndarray] = {}
        for t in g.initializer:
            consts[t.name] = numpy_helper.to_array(t)
        shapes = _static_shapes(model)
        seq_lengths = _sequence_lengths(model, consts, shapes)
        new_nodes = []
        folded: dict[str, np.ndarray] = {}
        round_changed = False
        for node in g.node:
            if node.domain not in ("", "ai.onnx") or node.op_type in _NO_FOLD or \
                    (node.op_type == "DequantizeLinear" and node.output[0] in keep_dq) or \
                    (node.op_type == "Constant" and node.output[0] in graph_outputs) or \
                    any(a.type in (5, 10) for a in node.attribute):  # GRAPH / GRAPHS attributes
                new_nodes.append(node)
                continue
            result: list[np.ndarray] | None = None
            if node.op_type == "Constant":
                v = _constant_value(node)
                result = [v] if v is not None else None
            elif node.op_type == "Shape" and _known(shapes, node.input[0]):
                result = _eval_node(node, opset, [np.zeros(shapes[node.input[0]], np.float32)]) \
                    if np.prod(shapes[node.input[0]]) <= 1 << 22 else None
                if result is None:
                    dims = np.array(shapes[node.input[0]], dtype=np.int64)
                    start = next((a.i for a in node.attribute if a.name == "start"), 0)
                    end = next((a.i for a in node.attribute if a.name == "end"), None)
                    result = [dims[start:end]]
            elif node.op_type == "SequenceLength" and node.input[0] in seq_lengths:
                result = [np.array(seq_lengths[node.input[0]], dtype=np.int64)]
            elif node.op_type == "Size" and _known(shapes, node.input[0]):
                result = [np.array(int(np.prod(shapes[node.input[0]])), dtype=np.int64)]
            elif all((not i) or i in consts for i in node.input) and node.input:
                sizes = [consts[i].size for i in node.input if i]
                if max(sizes, default=0) <= _FOLD_MAX_ELEMENTS:
                    result = _eval_node(node, opset, [consts[i] if i else None for i in node.input])
            if result is None or len(result) != len([o for o in node.output]) or \
                    any(r.size > _FOLD_MAX_ELEMENTS or r.dtype == object for r in result):
                new_nodes.append(node)
                continue
            if any(o in graph_outputs for o in node.output):  # an output stays a node: a Constant
                if len(node.output) != 1:
                    new_nodes.append(node)
                    continue
                new_nodes.append(onnx.helper.make_node("Constant", [], [node.output[0]],
                                                       value=numpy_helper.from_array(result[0]),
                                                       name=node.name or f"folded_{node.output[0]}"))
                consts[node.output[0]] = result[0]
                round_changed = True
                continue
            for name, r in zip(node.output, result, strict=True):
                if name:
                    consts[name] = folded[name] = r
            # a Constant given as value_float/value_ints/...: TVM's importer reads only `value`
            if node.op_type != "Constant" or not any(a.name == "value" for a in node.attribute):
                round_changed = True
        if not round_changed:
            break
        del g.node[:]
        g.node.extend(new_nodes)
        for name, arr in folded.items():
            g.initializer.append(numpy_helper.from_array(np.array(arr, order="C"), name))
        changed = True
    if changed:
        _drop_dead_nodes(model)
        _drop_unused_initializers(model)
        del g.value_info[:]
    return changed


def _weight_dequantizers(g: Any) -> set[str]:
    """Outputs of the DequantizeLinear nodes whose outputs only feed Conv / Gemm / MatMul: they stay
    unfolded so the int8 weights, the bias and their scales reach the integer-kernel rewrite
    (compiler.integer) as constants; folded, they would be float weights like any other."""
    users: dict[str, set[str]] = {}
    for node in g.node:
        for i in node.input:
            users.setdefault(i, set()).add(node.op_type)
    return {n.output[0] for n in g.node if n.op_type == "DequantizeLinear" and
            users.get(n.output[0]) and users[n.output[0]] <= {"Conv", "Gemm", "MatMul"}}


def _drop_dead_nodes(model: Any) -> None:
    """Remove nodes none of whose outputs is used (folding can leave whole chains unused)."""
    g = model.graph
    needed = {o.name for o in g.output}
    keep = []
    for node in reversed(list(g.node)):
        subgraph_inputs = {i for a in node.attribute
                           for sub in ([a.g] if a.type == 5 else list(a.graphs) if a.type == 10 else [])
                           for sn in sub.node for i in sn.input}
        if any(o in needed for o in node.output if o):
            keep.append(node)
            needed.update(i for i in node.input if i)
            needed.update(subgraph_inputs)
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(reversed(keep))


def _replace_nodes(g: Any, nodes: list[Any]) -> None:
    """The end of every rewrite step: the graph's nodes become ``nodes`` and the inferred
    value_info, stale now, is dropped (shape inference fills it again)."""
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]


def _drop_unused_initializers(model: Any) -> None:
    g = model.graph
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for n in g.node:  # names used inside subgraphs
        for a in n.attribute:
            for sub in ([a.g] if a.type == 5 else list(a.graphs) if a.type == 10 else []):
                used |= {i for sn in sub.node for i in sn.input}
    keep = [t for t in g.initializer if t.name in used]
    if len(keep) != len(g.initializer):
        dropped = {t.name for t in g.initializer} - {t.name for t in keep}
        del g.initializer[:]
        g.initializer.extend(keep)
        inputs = [i for i in g.input if i.name not in dropped]
        del g.input[:]
        g.input.extend(inputs)


def static_dims(shapes: dict[str, list[int]], name: str, label: str, what: str) -> list[int]:
    """The static shape of ``name`` (every dim known and > 0), or a ModelError naming the node
    (``label``) and the operand (``what``): the rewrites that unroll over a shape need one."""
    from compiler.errors import ModelError

    dims = shapes.get(name)
    if dims is None or any(d <= 0 for d in dims):
        raise ModelError(
            f"{label}: the {what} {name!r} has no static shape ({dims})",
            hint="fix the input shapes with --shape NAME=D0,D1,...",
        )
    return dims
