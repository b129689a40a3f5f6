"""ONNX loading, validation and import into a Relax module whose weights are runtime inputs.

Pipeline: read bytes -> parse/check (ModelError on a corrupt file) -> refuse unsupported ops and
dynamic shapes by name -> split initializers into trainable params and constants -> fix the batch
dimension -> ``from_onnx(keep_params_in_input=True)`` -> ``detach_params``.

Only float initializers feeding a weight position (Conv/Gemm/MatMul weights and biases, BN scale
and bias, Add/Mul/Sub/Div operands, ...) stay parameters. Everything else (shapes, axes, QDQ
scales, BN running statistics, Clip bounds) becomes an ONNX ``Constant`` node first: the Relax
frontend needs those as compile-time constants, and they are not something a swarm should train.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import ModelError
from compiler.manifest import TensorSpec

__all__ = ["ImportedModel", "TensorSpec", "load_onnx", "import_model", "supported_ops"]

# (op_type -> input positions that are trainable weights). None = every input position.
_TRAINABLE_POSITIONS: dict[str, tuple[int, ...] | None] = {
    "Conv": (1, 2),
    "ConvTranspose": (1, 2),
    "Gemm": (0, 1, 2),
    "MatMul": None,
    "Add": None,
    "Sub": None,
    "Mul": None,
    "Div": (0,),
    "BatchNormalization": (1, 2),
    "PRelu": (1,),
    "LayerNormalization": (1, 2),
    "InstanceNormalization": (1, 2),
}
_FLOAT_TYPES = {1, 10, 11, 16}  # onnx TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16


@dataclass
class ImportedModel:
    """A model imported into Relax: ``mod["main"](*inputs, *params)``."""

    mod: Any  # tvm.IRModule
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    param_names: list[str]
    params: list[np.ndarray]
    batch: int


def supported_ops() -> set[str]:
    """The ONNX op types the Relax frontend of this TVM can convert."""
    from tvm.relax.frontend.onnx import onnx_frontend

    return set(onnx_frontend._get_convert_map()) | {"Constant", "If"}


def load_onnx(path: str | Path) -> Any:
    """Read and validate an ONNX file; ModelError with a fix hint on anything unreadable."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"ONNX model {str(path)!r} not found", hint="check the path")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf DecodeError and friends: the file is not ONNX
        raise ModelError(f"{path.name} is not a readable ONNX model ({type(exc).__name__}: {exc})",
                         hint="re-export the model with onnx/torch.onnx.export") from None
    if len(model.graph.node) == 0 and len(model.graph.output) == 0:
        # protobuf happily parses many random byte strings into an empty message
        raise ModelError(f"{path.name} is not a valid ONNX model (empty graph)",
                         hint="re-export the model; the file may be truncated or not ONNX")
    _check_ops(model)  # before the checker, which would only say "no schema" without the node
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"{path.name} failed ONNX validation: {str(exc).splitlines()[0]}",
                         hint="fix or re-export the model (onnx.checker.check_model shows the details)"
                         ) from None
    return model


def _check_ops(model: Any) -> None:
    supported = supported_ops()
    for idx, node in enumerate(model.graph.node):
        if node.domain not in ("", "ai.onnx"):
            raise ModelError(f"unsupported operator {node.domain}::{node.op_type} at node "
                             f"{node.name or f'#{idx}'!r}",
                             hint="only the default ONNX domain is supported; replace the custom op")
        if node.op_type not in supported:
            raise ModelError(f"unsupported operator {node.op_type!r} at node {node.name or f'#{idx}'!r}",
                             hint="rewrite the model without this op (TVM's Relax ONNX frontend lacks it)")


def _graph_inputs(model: Any) -> list[Any]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _elem_dtype(value_info: Any) -> str:
    import onnx

    return str(onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type))


def _input_shapes(model: Any, batch: int | None) -> tuple[list[TensorSpec], int]:
    """Static input specs; the leading dim may be symbolic (it becomes ``batch``)."""
    specs: list[TensorSpec] = []
    model_batch: int | None = None
    for inp in _graph_inputs(model):
        tt = inp.type.tensor_type
        if not tt.HasField("shape"):
            raise ModelError(f"input {inp.name!r} has an unknown rank",
                             hint="export the model with static input shapes")
        dims: list[int] = []
        for axis, d in enumerate(tt.shape.dim):
            static = d.HasField("dim_value") and d.dim_value > 0
            if axis == 0:
                if static:
                    model_batch = model_batch or d.dim_value
                dims.append(d.dim_value if static else -1)
            elif not static:
                label = d.dim_param or "?"
                raise ModelError(f"input {inp.name!r} has a dynamic dimension {axis} ({label!r}); only "
                                 "the leading batch dimension may be dynamic",
                                 hint="export the model with fixed sizes for all but the batch dimension")
            else:
                dims.append(d.dim_value)
        specs.append(TensorSpec(inp.name, tuple(dims), _elem_dtype(inp)))
    base = model_batch or 1
    target = batch or base
    out = [TensorSpec(s.name, (target, *s.shape[1:]) if s.shape else s.shape, s.dtype) for s in specs]
    return out, base


def _trainable(model: Any) -> set[str]:
    """Names of float initializers used only at weight positions."""
    consumers: dict[str, list[tuple[str, int]]] = {}
    for node in model.graph.node:
        for pos, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, pos))
    keep = set()
    for init in model.graph.initializer:
        uses = consumers.get(init.name, [])
        if init.data_type not in _FLOAT_TYPES or not uses:
            continue
        ok = True
        for op, pos in uses:
            allowed = _TRAINABLE_POSITIONS.get(op, ())
            if allowed is not None and pos not in allowed:
                ok = False
        if ok:
            keep.add(init.name)
    return keep


def _constants_to_nodes(model: Any, keep: set[str]) -> Any:
    """Turn every initializer not in ``keep`` into a Constant node (see module docstring)."""
    import onnx

    model = copy.deepcopy(model)
    g = model.graph
    const_nodes = []
    kept = []
    for init in g.initializer:
        if init.name in keep:
            kept.append(init)
        else:
            const_nodes.append(onnx.helper.make_node("Constant", [], [init.name], value=init,
                                                     name=f"const_{init.name}"))
    del g.initializer[:]
    g.initializer.extend(kept)
    moved = {n.output[0] for n in const_nodes}
    inputs = [i for i in g.input if i.name not in moved]
    del g.input[:]
    g.input.extend(inputs)
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(const_nodes + nodes)
    return model


def _rebatch(model: Any, specs: list[TensorSpec], base: int, batch: int) -> Any:
    """Set every input's leading dim to ``batch``; fix Reshape targets that hard-code ``base``."""
    import onnx
    from onnx import numpy_helper

    g = model.graph
    by_name = {s.name: s for s in specs}
    for inp in g.input:
        if inp.name in by_name and len(inp.type.tensor_type.shape.dim) > 0:
            d0 = inp.type.tensor_type.shape.dim[0]
            d0.Clear()
            d0.dim_value = batch
    # Shapes below the inputs are re-inferred by the frontend; drop stale annotations.
    del g.value_info[:]
    for out in g.output:
        if out.type.tensor_type.HasField("shape") and out.type.tensor_type.shape.dim:
            d0 = out.type.tensor_type.shape.dim[0]
            d0.Clear()
            d0.dim_param = "N"
    if batch == base:
        return model
    producers = {n.output[0]: n for n in g.node if n.op_type == "Constant"}
    for node in g.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or node.input[1] not in producers:
            continue
        cnode = producers[node.input[1]]
        tensor = next(a.t for a in cnode.attribute if a.name == "value")
        shape = numpy_helper.to_array(tensor).copy()
        if shape.ndim == 1 and shape.size > 0 and shape[0] == base:
            # 0 = "copy this dim from the input" in ONNX Reshape: the batch passes through.
            shape[0] = 0
            new = numpy_helper.from_array(shape.astype(np.int64), tensor.name)
            del cnode.attribute[:]
            cnode.attribute.append(onnx.helper.make_attribute("value", new))
    return model


def import_model(model: Any, *, batch: int | None = None) -> ImportedModel:
    """Import a validated ONNX model into Relax with parameters as trailing inputs of ``main``.

    ``batch``: the leading dim to compile for (None: the model's own, 1 if it is symbolic).
    """
    from tvm.relax.frontend import detach_params
    from tvm.relax.frontend.onnx import from_onnx

    _check_ops(model)
    specs, base = _input_shapes(model, batch)
    keep = _trainable(model)
    param_names = [t.name for t in model.graph.initializer if t.name in keep]
    prepared = _rebatch(_constants_to_nodes(model, keep), specs, base, batch or base)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = from_onnx(prepared, shape_dict={s.name: list(s.shape) for s in specs},
                            opset=opset, keep_params_in_input=True)
    except Exception as exc:
        first = " ".join(str(exc).split())[:300]
        raise ModelError(f"TVM could not import the model at batch {batch or base}: {first}",
                         hint="simplify the model (onnxsim) or export it with static shapes") from None
    mod, detached = detach_params(mod)
    params = [p.numpy() for p in detached.get("main", [])]
    if len(params) != len(param_names):
        raise ModelError(f"internal: {len(params)} imported parameters but {len(param_names)} initializers",
                         hint="report this model as a bug")
    outputs = _output_specs(mod, model)
    return ImportedModel(mod=mod, inputs=specs, outputs=outputs, param_names=param_names,
                         params=params, batch=batch or base)


def _output_specs(mod: Any, model: Any) -> list[TensorSpec]:
    from tvm import relax

    ret = mod["main"].ret_ty
    infos = list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]
    names = [o.name for o in model.graph.output]
    specs = []
    for name, info in zip(names, infos, strict=True):
        if not isinstance(info, relax.TensorType) or info.shape is None:
            raise ModelError(f"output {name!r} is not a tensor of known shape",
                             hint="export the model with static shapes")
        try:
            shape = tuple(int(d) for d in info.shape.values)
        except TypeError:
            raise ModelError(f"output {name!r} has a dynamic shape {info.shape}",
                             hint="export the model with static shapes") from None
        specs.append(TensorSpec(name, shape, str(info.dtype)))
    return specs
