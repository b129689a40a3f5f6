"""Cut a model with string tensors into its host stage and the numeric rest TVM compiles.

A node runs on the host (:mod:`compiler.hoststage`) when it is one of the host operators and
touches a string tensor (LabelEncoder / CategoryMapper with string keys or values, Equal on
strings, StringConcat, StringSplit, StringNormalizer, RegexFullMatch). The host nodes reading only
the model's inputs, string constants and each other are the ``head``; those whose outputs go only
to the model's outputs (through other such nodes) are the ``tail``. The rest of the graph is a
model of its own whose inputs are the numeric values the head hands over (with the shapes ONNX's
shape inference gives them) and whose outputs include what the tail reads. A string operator
between numeric ones, or any other operator on strings, is refused in one line.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.errors import ModelError
from compiler.hoststage import HOST_OPS, STRING, HostNode, HostStage, tensor_to_json
from compiler.manifest import TensorSpec

__all__ = ["HostSplit", "split_host_stage", "runs_on_host"]

_ONNX_STRING = 8
_ML = "ai.onnx.ml"
_STRING_ONLY = frozenset({"StringConcat", "StringSplit", "StringNormalizer", "RegexFullMatch",
                          "CategoryMapper"})
_HINT = "run this part of the pipeline before or after the model (docs/compile.md, string tensors)"


def _domain_ok(node: Any) -> bool:
    want = _ML if node.op_type in ("LabelEncoder", "CategoryMapper") else ""
    return node.domain in (want, "ai.onnx" if want == "" else want)


def runs_on_host(node: Any) -> bool:
    """Whether ``node`` runs on the host whatever its types (a string operator, or a LabelEncoder
    with string keys or values); Equal on strings is decided by the types (:func:`split_host_stage`)."""
    if not _domain_ok(node) or node.op_type not in HOST_OPS:
        return False
    if node.op_type in _STRING_ONLY:
        return True
    if node.op_type == "LabelEncoder":
        names = {a.name for a in node.attribute}
        if names & {"keys_strings", "values_strings", "default_string"}:
            return True
        return any(a.name in ("keys_tensor", "values_tensor") and a.t.data_type == _ONNX_STRING
                   for a in node.attribute)
    return False


@dataclass
class HostSplit:
    """The host stage, the numeric rest (None: nothing to compile) and the model's own inputs and
    outputs as users see them (a dim decided at run time is -1; a dynamic leading dim too)."""

    stage: HostStage
    numeric: Any  # onnx.ModelProto | None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


def _attr_json(node: Any) -> dict[str, Any]:
    from onnx import helper, numpy_helper

    where = f"{node.op_type} at node {node.name or node.output[0]!r}"
    out: dict[str, Any] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        try:
            if a.type == a.TENSOR:
                arr = numpy_helper.to_array(v)
                v = tensor_to_json(_texts(arr, where) if arr.dtype.kind in "OSU" else arr)
            elif isinstance(v, bytes):
                v = v.decode("utf-8")
            elif isinstance(v, list) and v and isinstance(v[0], bytes):
                v = [s.decode("utf-8") for s in v]
            elif isinstance(v, list | int | float | str):
                pass
            else:
                raise ModelError(f"{where}: attribute {a.name!r} is of a kind the host stage does not take",
                                 hint=_HINT)
        except UnicodeDecodeError:
            raise ModelError(f"{where}: attribute {a.name!r} is not UTF-8 text",
                             hint="give UTF-8 strings") from None
        out[a.name] = v
    return out


def _may_have_strings(model: Any) -> bool:
    """Whether a string tensor can arise in ``model``: a string input, output, initializer or
    constant, a Cast to string, or an operator of the host stage."""
    g = model.graph
    if any(v.type.tensor_type.elem_type == _ONNX_STRING for v in [*g.input, *g.output]) or \
            any(t.data_type == _ONNX_STRING for t in g.initializer):
        return True
    for node in g.node:
        if runs_on_host(node):
            return True
        for a in node.attribute:
            if (node.op_type == "Cast" and a.name == "to" and a.i == _ONNX_STRING) or \
                    (node.op_type == "Constant" and (a.name in ("value_string", "value_strings") or
                                                     (a.name == "value" and a.t.data_type == _ONNX_STRING))):
                return True
    return False


def _texts(arr: np.ndarray, where: str) -> np.ndarray:
    """A string tensor of the model (bytes or str elements) as an object array of str."""
    out = np.empty(arr.size, dtype=object)
    for i, s in enumerate(np.asarray(arr).ravel().tolist()):
        try:
            out[i] = s.decode("utf-8") if isinstance(s, bytes) else str(s)
        except UnicodeDecodeError:
            raise ModelError(f"{where}: a string that is not UTF-8 text", hint="give UTF-8 strings") from None
    return out.reshape(np.shape(arr))


def _types(model: Any) -> dict[str, Any]:
    """name -> TypeProto of every value ONNX's shape inference knows (inputs with user shapes)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    g = inferred.graph
    out = {vi.name: vi.type for vi in [*g.input, *g.value_info, *g.output]}
    for t in g.initializer:
        out[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return out


def _elem(types: dict[str, Any], name: str) -> int:
    t = types.get(name)
    return int(t.tensor_type.elem_type) if t is not None and t.WhichOneof("value") == "tensor_type" else 0


def _spec(types: dict[str, Any], name: str) -> TensorSpec:
    from onnx import helper

    t = types[name].tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
    dtype = STRING if t.elem_type == _ONNX_STRING else \
        np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).name
    return TensorSpec(name, dims, dtype)


def _with_shapes(model: Any, shapes: dict[str, list[int]] | None) -> Any:
    """A copy of ``model`` whose inputs have the user's fixed dims (``--shape``; -1 keeps one)."""
    model = copy.deepcopy(model)
    for inp in model.graph.input:
        user = (shapes or {}).get(inp.name)
        if not user or len(user) != len(inp.type.tensor_type.shape.dim):
            continue
        for d, v in zip(inp.type.tensor_type.shape.dim, user, strict=True):
            if v >= 0:
                d.Clear()
                d.dim_value = v
    return model


def split_host_stage(model: Any, shapes: dict[str, list[int]] | None = None) -> HostSplit | None:
    """The host stage of ``model`` and its numeric rest, or None when no string tensor is in it.
    ModelError (one line) for strings the host stage cannot take."""
    from onnx import numpy_helper

    if not _may_have_strings(model):  # (shape inference costs seconds on big models)
        return None
    model = _with_shapes(model, shapes)
    g = model.graph
    types = _types(model)
    strings = {n for n in types if _elem(types, n) == _ONNX_STRING}
    if not strings and not any(runs_on_host(n) for n in g.node):
        return None
    inits = {t.name: t for t in g.initializer}
    graph_inputs = [i.name for i in g.input if i.name not in inits]
    constants: dict[str, np.ndarray] = {}
    host: list[Any] = []
    numeric: list[Any] = []
    for idx, node in enumerate(g.node):
        where = f"{node.op_type} at node {node.name or f'#{idx}'!r}"
        touches = any(n in strings for n in [*node.input, *node.output] if n)
        if node.op_type == "Constant" and all(o in strings for o in node.output):
            arr = numpy_helper.to_array(next(a.t for a in node.attribute if a.name == "value")) \
                if any(a.name == "value" for a in node.attribute) else None
            if arr is None:
                raise ModelError(f"{where}: a string constant not given as a tensor 'value'", hint=_HINT)
            constants[node.output[0]] = _texts(arr, where)
        elif runs_on_host(node) or (touches and node.op_type == "Equal" and _domain_ok(node)):
            host.append(node)
        elif touches:
            raise ModelError(f"{where} takes or gives a string tensor; strings are handled only by "
                             f"{', '.join(sorted(HOST_OPS))}, at the model's inputs and outputs", hint=_HINT)
        else:
            numeric.append(node)
    for name, t in inits.items():
        if t.data_type == _ONNX_STRING:
            constants[name] = _texts(numpy_helper.to_array(t), f"initializer {name!r}")
    # head: host nodes reading only inputs, constants and other head nodes (graph order is topological)
    known = set(graph_inputs) | set(constants)
    head: list[Any] = []
    for node in host:
        if all(not i or i in known for i in node.input):
            head.append(node)
            known.update(node.output)
    # tail: the other host nodes, whose outputs go only to the model's outputs and other tail nodes
    consumers: dict[str, list[Any]] = {}
    for node in g.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    rest = [n for n in host if n not in head]
    tail: list[Any] = []
    for node in reversed(rest):
        if all(c in tail for o in node.output for c in consumers.get(o, [])):
            tail.insert(0, node)
    for node in rest:
        if node not in tail:
            raise ModelError(f"{node.op_type} at node {node.name or node.output[0]!r} works on strings "
                             "between numeric operators; string operators run only at the model's inputs and "
                             "outputs",
                             hint=_HINT)
    stage = HostStage(tuple(_host_node(n) for n in head), tuple(_host_node(n) for n in tail), constants)
    stage.kernels()  # refuses attributes the host stage cannot honour, now rather than at run time
    user_inputs = [_spec(types, n) for n in graph_inputs]
    user_outputs = [_runtime_dims(_spec(types, o.name), [*head, *tail]) for o in g.output]
    num = _numeric_model(model, numeric, head, tail, types) if numeric else None
    if num is None:
        host_made = {o for n in [*head, *tail] for o in n.output} | set(graph_inputs)
        lost = [o.name for o in g.output if o.name not in host_made]
        if lost:
            raise ModelError(f"output {lost[0]!r} is computed by no operator", hint="check the model")
    return HostSplit(stage, num, user_inputs, user_outputs)


def _known_type(types: dict[str, Any], name: str) -> Any:
    """The inferred type of a value crossing between the host stage and the library."""
    t = types.get(name)
    if t is None or not t.tensor_type.HasField("shape"):
        raise ModelError(f"the shape of {name!r}, which crosses between the string operators and the "
                         "compiled code, is unknown", hint="export the model with static shapes")
    return t


def _runtime_dims(spec: TensorSpec, host: list[Any]) -> TensorSpec:
    """-1 for the dims the data decides: StringSplit's substrings, StringNormalizer's kept strings."""
    for node in host:
        if (node.op_type == "StringSplit" and node.output[0] == spec.name) or \
                (node.op_type == "StringNormalizer" and spec.name in node.output):
            return TensorSpec(spec.name, (*spec.shape[:-1], -1), spec.dtype)
    return spec


def _host_node(node: Any) -> HostNode:
    return HostNode(node.op_type, node.name, tuple(node.input), tuple(node.output), _attr_json(node))


def _numeric_model(model: Any, numeric: list[Any], head: list[Any], tail: list[Any],
                   types: dict[str, Any]) -> Any:
    """The model of the numeric nodes: inputs are the model's numeric inputs they read and the head's
    outputs they read; outputs are the model's outputs they make and what the tail reads of theirs."""
    from onnx import helper

    g = model.graph
    made = {o for n in numeric for o in n.output}
    read = {i for n in numeric for i in n.input if i}
    inits = {t.name for t in g.initializer}
    ins = [i for i in g.input if i.name in read and i.name not in inits]
    ins += [helper.make_value_info(o, _known_type(types, o)) for n in head for o in n.output if o in read]
    outs = [o for o in g.output if o.name in made]
    named = {o.name for o in outs}
    for node in tail:
        for i in node.input:
            if i in made and i not in named:
                outs.append(helper.make_value_info(i, _known_type(types, i)))
                named.add(i)
    num = copy.deepcopy(model)
    ng = num.graph
    del ng.node[:]
    ng.node.extend(numeric)
    del ng.input[:]
    ng.input.extend([*ins, *[i for i in g.input if i.name in inits and i.name in read]])
    del ng.output[:]
    ng.output.extend(outs)
    keep = [t for t in ng.initializer if t.name in read]
    del ng.initializer[:]
    ng.initializer.extend(keep)
    del ng.value_info[:]
    return num
