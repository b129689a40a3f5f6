"""Operators TVM's Relax importer lacks (or imports wrongly) but ONNX defines as functions: replace
each node by the function body ONNX's schema gives for it, which uses only standard operators.

The body is ONNX's own definition of the operator (the same one its ``*_expanded`` test cases
use), so the rewrite adds no semantics of its own; what it can get wrong is the inlining: names
are prefixed per node, attribute references (``ref_attr_name``) are bound to the node's attributes
or the schema's defaults, subgraphs (``If`` branches) are renamed the same way.

Variants whose body TVM cannot compute correctly are refused here, with the operator and the
reason on one line (``_refusal``), never passed on to give a wrong answer.
"""

from __future__ import annotations

from typing import Any

from compiler.errors import ModelError

__all__ = ["EXPANDED_OPS", "EXPANDED_WHEN", "KEPT_WHEN_RUNTIME", "expand_functions"]

# Attention: TVM's converter is com.microsoft's (reads ``num_heads``), wrong for ai.onnx Attention.
# The others have no converter. SoftmaxCrossEntropyLoss's body calls NegativeLogLikelihoodLoss,
# whose body is expanded in turn. LinearAttention's body is a Scan (unrolled by compiler/unroll.py).
# The window functions' bodies take Range over their size (a model input: compiler.dynshape_flow).
EXPANDED_OPS = frozenset({"Attention", "Celu", "CenterCropPad", "SoftmaxCrossEntropyLoss",
                          "NegativeLogLikelihoodLoss", "RotaryEmbedding", "CausalConvWithState", "Swish",
                          "LinearAttention", "BlackmanWindow", "HammingWindow", "HannWindow"})
_MAX_DEPTH = 4  # function bodies calling functions (SoftmaxCrossEntropyLoss -> NegativeLogLikelihoodLoss)

_GRAPH, _GRAPHS = 5, 10  # AttributeProto types holding subgraphs


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _types(model: Any) -> dict[str, Any]:
    """Value name -> TypeProto (inputs, initializers, inferred intermediates)."""
    import onnx
    from onnx import helper

    try:
        typed = onnx.shape_inference.infer_shapes(model).graph
    except Exception:
        typed = model.graph
    out = {vi.name: vi.type for vi in [*typed.input, *typed.value_info, *typed.output]}
    for t in model.graph.initializer:
        out[t.name] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return out


def _version(versions: Any, opset: int) -> int:
    """The newest function version at or below the model's opset (else the oldest there is)."""
    below = [v for v in versions if v <= opset]
    return max(below) if below else min(versions)


def _body(schema: Any, node: Any, types: dict[str, Any], label: str, opset: int) -> Any:
    """The FunctionProto ONNX defines ``node`` as (the newest at or below the node's opset)."""
    from onnx import FunctionProto

    fn = FunctionProto()
    if schema.has_function:
        version = _version(schema.function_opset_versions, opset)
        fn.ParseFromString(schema.get_function_with_opset_version(version))
        return fn
    missing = [i for i in node.input if i and i not in types]
    if missing:
        raise ModelError(f"{label}: the type of input {missing[0]!r} is unknown, so ONNX's definition of the "
                         "operator cannot be expanded",
                         hint="run onnx.shape_inference on the model or give its inputs types")
    from onnx import TypeProto

    in_types = [(types[i] if i else TypeProto()).SerializeToString() for i in node.input]
    version = _version(schema.context_dependent_function_opset_versions, opset)
    try:
        fn.ParseFromString(schema.get_context_dependent_function_with_opset_version(
            version, node.SerializeToString(), in_types))
    except Exception as exc:
        raise ModelError(f"{label}: ONNX could not define this variant of the operator "
                         f"({' '.join(str(exc).split())[:160]})",
                         hint="check the node's attributes") from None
    if not fn.node:
        raise ModelError(f"{label}: ONNX gives no definition of this variant of the operator",
                         hint="rewrite the model without it")
    return fn


def _bind(attrs: Any, given: dict[str, Any], defaults: dict[str, Any]) -> list[Any]:
    """A body node's attributes with ``ref_attr_name`` replaced by the caller's value (or the
    schema default; an unset optional attribute is dropped)."""
    out = []
    for a in attrs:
        if not a.ref_attr_name:
            out.append(a)
            continue
        src = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
        if src is None:
            continue
        bound = type(a)()
        bound.CopyFrom(src)
        bound.name = a.name
        out.append(bound)
    return out


def _rename_graph(g: Any, rename: Any, given: dict[str, Any], defaults: dict[str, Any]) -> None:
    for vi in [*g.input, *g.output, *g.value_info]:
        vi.name = rename(vi.name)
    for t in g.initializer:
        t.name = rename(t.name)
    for n in g.node:
        _rename_node(n, rename, given, defaults)


def _rename_node(n: Any, rename: Any, given: dict[str, Any], defaults: dict[str, Any]) -> None:
    for k, name in enumerate(n.input):
        n.input[k] = rename(name)
    for k, name in enumerate(n.output):
        n.output[k] = rename(name)
    bound = _bind(n.attribute, given, defaults)
    del n.attribute[:]
    n.attribute.extend(bound)
    for a in n.attribute:
        for sub in ([a.g] if a.type == _GRAPH else list(a.graphs) if a.type == _GRAPHS else []):
            _rename_graph(sub, rename, given, defaults)


def _inline(node: Any, fn: Any, schema: Any, prefix: str) -> list[Any]:
    from onnx import NodeProto

    io = {formal: (node.input[k] if k < len(node.input) else "") for k, formal in enumerate(fn.input)}
    for k, formal in enumerate(fn.output):
        if k < len(node.output) and node.output[k]:
            io[formal] = node.output[k]

    def rename(name: str) -> str:
        if not name:
            return ""
        return io[name] if name in io else f"{prefix}/{name}"

    given = {a.name: a for a in node.attribute}
    defaults = {k: v.default_value for k, v in schema.attributes.items()
                if v.default_value is not None and v.default_value.type}
    out = []
    for k, body_node in enumerate(fn.node):
        n = NodeProto()
        n.CopyFrom(body_node)
        n.name = f"{prefix}/{n.name or n.op_type}_{k}"
        _rename_node(n, rename, given, defaults)
        out.append(n)
    return out


def _attr_int(node: Any, name: str, default: int = 0) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _rank(types: dict[str, Any], name: str) -> int | None:
    t = types.get(name)
    if t is None or not t.tensor_type.HasField("shape"):
        return None
    return len(t.tensor_type.shape.dim)


def _extra_outputs(node: Any, types: dict[str, Any]) -> bool:
    return any(node.output[1:])


def _normalizes_every_axis(node: Any, types: dict[str, Any]) -> bool:
    rank = _rank(types, node.input[0])
    return _attr_int(node, "axis", -1) == 0 or (rank is not None and _attr_int(node, "axis", -1) == -rank)


# Operators TVM converts, expanded only in the variants its converter gets wrong or crashes on:
# LayerNormalization asked for Mean / InvStdDev (TVM computes only Y), RMSNormalization over every
# axis (TVM's converter fails to schedule it).
EXPANDED_WHEN = {"LayerNormalization": _extra_outputs, "RMSNormalization": _normalizes_every_axis}


def _refusal(node: Any, label: str, consts: set[str], types: dict[str, Any]) -> None:
    """Variants the expanded body cannot compile to: refused by name, with the reason."""
    if node.op_type == "CenterCropPad" and len(node.input) > 1 and node.input[1] not in consts:
        # (a model input keeps the node whole: KEPT_WHEN_RUNTIME)
        raise ModelError(f"{label}: the target shape {node.input[1]!r} is computed in the graph; only a "
                         "constant or a model input is supported",
                         hint="make the shape a constant (an initializer) or an input of the model")
    if node.op_type == "Attention":
        ranks = [_rank(types, name) for name in node.input[:3]]
        if ranks[0] not in (3, 4) or len(set(ranks)) != 1:
            raise ModelError(f"{label}: Q, K and V have ranks {ranks}; ONNX's Attention takes all three 3-D "
                             "or all three 4-D with known ranks", hint="fix the input shapes with --shape")
        heads = {a.name for a in node.attribute}
        if ranks[0] == 3 and not {"q_num_heads", "kv_num_heads"} <= heads:
            raise ModelError(f"{label}: 3-D inputs without q_num_heads and kv_num_heads",
                             hint="give the node both head counts (ONNX requires them for 3-D inputs)")
        mode = _attr_int(node, "qk_matmul_output_mode")
        if len(node.output) > 3 and node.output[3] and mode not in (0, 1, 2, 3):
            raise ModelError(f"{label}: qk_matmul_output_mode={mode} is not defined by ONNX",
                             hint="use 0 (Q K^T), 1 (plus mask), 2 (softcapped) or 3 (softmax)")


def _model_inputs(model: Any) -> frozenset[str]:
    """The graph inputs that are not initializers (values known only at run time)."""
    inits = {t.name for t in model.graph.initializer}
    return frozenset(i.name for i in model.graph.input if i.name not in inits)


# Operators kept whole when their shape operand is a model input: compiler.dynshape converts them
# (the function body would compute that operand in the graph, where TVM needs a constant).
KEPT_WHEN_RUNTIME = {"CenterCropPad": 1}


def _wanted(node: Any, ops: frozenset[str], types: dict[str, Any] | None,
            runtime: frozenset[str] = frozenset()) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    pos = KEPT_WHEN_RUNTIME.get(node.op_type)
    if pos is not None and pos < len(node.input) and node.input[pos] in runtime:
        return False
    if node.op_type in ops:
        return True
    when = EXPANDED_WHEN.get(node.op_type)
    return when is not None and types is not None and when(node, types)


def expand_functions(model: Any, ops: frozenset[str] = EXPANDED_OPS) -> bool:
    """Replace every default-domain node of ``ops`` (and of ``EXPANDED_WHEN``'s variants) by ONNX's
    function body for it, again in the bodies (a function calling a function), up to a fixed depth."""
    changed = False
    for _ in range(_MAX_DEPTH):
        if not _expand_once(model, ops):
            return changed
        changed = True
    runtime = _model_inputs(model)
    left = next((n.op_type for n in model.graph.node if _wanted(n, ops, _types(model), runtime)), None)
    if left is not None:
        raise ModelError(f"{left}: ONNX's definition of the operator is nested more than {_MAX_DEPTH} deep",
                         hint="rewrite the model with standard operators")
    return changed


def _expand_once(model: Any, ops: frozenset[str]) -> bool:
    import onnx

    g = model.graph
    if not any(n.op_type in ops or n.op_type in EXPANDED_WHEN for n in g.node):
        return False
    opset = _opset(model)
    types = _types(model)
    runtime = _model_inputs(model)
    if not any(_wanted(n, ops, types, runtime) for n in g.node):
        return False
    consts = {t.name for t in g.initializer} | {n.output[0] for n in g.node if n.op_type == "Constant"}
    new_nodes = []
    used_opsets = {o.domain: o for o in model.opset_import}
    for i, node in enumerate(g.node):
        if not _wanted(node, ops, types, runtime):
            new_nodes.append(node)
            continue
        label = f"{node.op_type} at node {node.name or f'#{i}'!r}"
        _refusal(node, label, consts, types)
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except Exception:
            raise ModelError(f"{label}: ONNX defines no {node.op_type} at opset {opset}",
                             hint="export the model with a newer opset") from None
        fn = _body(schema, node, types, label, opset)
        for o in fn.opset_import:  # the body's own operator sets (e.g. a newer default opset)
            if o.domain not in used_opsets:
                used_opsets[o.domain] = model.opset_import.add(domain=o.domain, version=o.version)
        new_nodes.extend(_inline(node, fn, schema, f"{node.name or node.op_type}_{i}"))
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]
    return True
