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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compiler.errors import ModelError
from compiler.graphbuild import dtype_only_inputs, node_attr
from compiler.manifest import NonFinite, TensorSpec
from compiler.nonfinite import nonfinite_blockers

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
    prepared_steps: list[str] = field(default_factory=list)  # prepare steps that changed the graph
    batched: bool = True  # False: the inputs share no leading batch dimension (fixed shapes)
    nonfinite: NonFinite = field(default_factory=NonFinite)  # NaN / inf inputs (compiler/nonfinite.py)


def supported_ops() -> set[str]:
    """The ONNX op types the Relax frontend of this TVM can convert."""
    from tvm.relax.frontend.onnx import onnx_frontend

    from compiler.convert_ops import OWN_CONVERTERS

    return set(onnx_frontend._get_convert_map()) | {"Constant", "If"} | set(OWN_CONVERTERS)


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
    # before the checker, which would only say "no schema" without the node
    _check_ops(model, extra=_decomposed())
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"{path.name} failed ONNX validation: {str(exc).splitlines()[0]}",
                         hint="fix or re-export the model (onnx.checker.check_model shows the details)"
                         ) from None
    return model


def _decomposed() -> frozenset[str]:
    from compiler.prepare import DECOMPOSED_OPS

    return DECOMPOSED_OPS


# onnxruntime's QOperator format (quantize_static(quant_format=QOperator)): TVM has no converter
# for these; compiler.qoperator rewrites most into their QDQ form (then compiler.integer's integer
# kernels), the rest are refused by name
_QOPERATOR = frozenset({"QLinearConv", "QLinearMatMul", "ConvInteger", "QGemm", "QLinearAdd", "QLinearMul",
                        "QLinearGlobalAveragePool", "QLinearAveragePool", "QLinearConcat", "QLinearSigmoid",
                        "QLinearLeakyRelu", "QLinearSoftmax", "QLinearReduceMean", "QLinearWhere",
                        "QAttention", "QEmbedLayerNormalization", "QOrderedMatMul",
                        "DynamicQuantizeMatMul", "MatMulIntegerToFloat"})


def _check_ops(model: Any, extra: frozenset[str] = frozenset()) -> None:
    from compiler.hostsplit import runs_on_host
    from compiler.lower_training import TRAINING_DOMAIN
    from compiler.prepare_ml import ML_DOMAIN, check_ml_node
    from compiler.qoperator import handled as qoperator_handled

    supported = supported_ops() | extra
    for idx, node in enumerate(model.graph.node):
        if qoperator_handled(node):  # their QDQ form (compiler.qoperator, a preparation step)
            continue
        if runs_on_host(node):  # string operators: the host stage (compiler.hostsplit) takes or refuses them
            continue
        if node.domain == ML_DOMAIN:  # lowered by compiler.prepare_ml, or refused here with the reason
            check_ml_node(node, {i.name: i.type.tensor_type.elem_type for i in model.graph.input})
            continue
        if node.domain == TRAINING_DOMAIN:  # optimizers lowered by compiler.lower_training, the rest refused
            continue
        if node.op_type in _QOPERATOR and node.op_type not in supported:
            raise ModelError(f"{node.op_type} at node {node.name or f'#{idx}'!r}: this QOperator-format "
                             "quantized operator is not compiled",
                             hint="quantize in QDQ format (quantize_static quant_format=QDQ), or compile "
                                  "the float model with --quantize int8 --calibration DATA.npz")
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


def _type_name(tp: Any) -> str:
    """``tensor``, ``sequence(tensor)``, ``optional(sequence(tensor))``, ... of a TypeProto."""
    kind = tp.WhichOneof("value") or "unknown"
    name = kind.removesuffix("_type")
    if kind in ("sequence_type", "optional_type"):
        return f"{name}({_type_name(getattr(tp, kind).elem_type)})"
    return name


def _check_input_types(model: Any) -> None:
    """Refuse graph inputs that are not tensors (optional, sequence, map) before any step reads
    their shapes (an optional input made the preparation stage fail with a KeyError)."""
    inits = {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        kind = inp.type.WhichOneof("value")
        if inp.name not in inits and kind != "tensor_type":
            raise ModelError(f"input {inp.name!r} is of type {_type_name(inp.type)}: only tensor inputs are "
                             "compiled (the Open Inference Protocol has no sequences or optionals)",
                             hint="export the model with plain tensor inputs")


def _input_shapes(model: Any, batch: int | None, exact: bool = False,
                  carriers: frozenset[str] = frozenset()) -> tuple[list[TensorSpec], int, bool]:
    """Static input specs, the model's own batch and whether the inputs share a leading batch
    dimension. The leading dim may be symbolic (it becomes ``batch``). ``exact``: a node takes a
    shape operand from a model input (:mod:`compiler.dynshape`): no batch dimension, and such an
    input may have length 0. Inputs whose static leading
    dims differ (``mm``: [2, 3] and [3, 4]) have no batch dimension: they are compiled for exactly
    their shapes (``batched`` False) and inference takes exactly those shapes. ``carriers``: inputs
    that only carry a dtype (``graphbuild.dtype_only_inputs`` of the model before preparation), which
    may be empty too; a model with an empty input is compiled for exactly its shapes."""
    from compiler.dynshape import shape_operand_inputs

    specs: list[TensorSpec] = []
    model_batch: int | None = None
    empty_ok = (shape_operand_inputs(model) if exact else set()) | carriers
    for inp in _graph_inputs(model):
        tt = inp.type.tensor_type
        if not tt.HasField("shape"):
            raise ModelError(f"input {inp.name!r} has an unknown rank",
                             hint="export the model with static input shapes")
        dims: list[int] = []
        for axis, d in enumerate(tt.shape.dim):
            static = d.HasField("dim_value") and (d.dim_value > 0 or inp.name in empty_ok)
            if axis == 0:
                if static:
                    model_batch = model_batch or d.dim_value
                dims.append(d.dim_value if static else -1)
            elif not static:
                label = d.dim_param or "?"
                raise ModelError(f"input {inp.name!r} has a dynamic dimension {axis} ({label!r}); only "
                                 "the leading batch dimension may be dynamic",
                                 hint=f"fix it with --shape {inp.name}=D0,D1,... (see `fractal inspect`)")
            else:
                dims.append(d.dim_value)
        specs.append(TensorSpec(inp.name, tuple(dims), _elem_dtype(inp)))
    if exact and not any(d < 0 for s in specs for d in s.shape):
        return specs, 1, False
    if any(d == 0 for s in specs for d in s.shape):  # an empty input (a dtype carrier) is no batch
        if any(s.shape and s.shape[0] < 0 for s in specs):
            raise ModelError("an input is empty and another has a dynamic leading dimension; a model with "
                             "an empty input compiles for exactly its input shapes",
                             hint="fix every input's shape with --shape NAME=D0,D1,...")
        return specs, 1, False
    leading = {s.name: s.shape[0] for s in specs if s.shape and s.shape[0] > 0}
    # a rank-0 input (Clip's bounds, a threshold) has no batch dimension to share
    scalars = {s.name: 0 for s in specs if not s.shape}
    if len(set(leading.values())) > 1 or scalars:
        leading.update(scalars)
        shown = ", ".join(f"{k}: {v}" for k, v in leading.items())
        dynamic = [s.name for s in specs if s.shape and s.shape[0] < 0]
        if dynamic:
            raise ModelError(f"input {dynamic[0]!r} has a dynamic leading dimension and the other inputs "
                             f"disagree on theirs ({shown}), so there is no batch dimension to give it",
                             hint=f"fix it with --shape {dynamic[0]}=D0,D1,...")
        if batch is not None:
            raise ModelError(f"the inputs have no common batch dimension ({shown}); the model compiles "
                             f"for exactly these shapes, not for batch {batch}",
                             hint="compile without --train/--batch, or export the model with a "
                                  "leading batch dimension on every input")
        return specs, 1, False
    base = model_batch or 1
    target = batch or base
    out = [TensorSpec(s.name, (target, *s.shape[1:]) if s.shape else s.shape, s.dtype) for s in specs]
    return out, base, True


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


def _model_batch(model: Any, shapes: dict[str, list[int]] | None) -> int | None:
    """The first static leading dim among the inputs (user shapes first)."""
    for inp in _graph_inputs(model):
        user = (shapes or {}).get(inp.name)
        if user and user[0] > 0:
            return user[0]
        dims = inp.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return int(dims[0].dim_value)
    return None


def _static_leading(model: Any, shapes: dict[str, list[int]] | None) -> set[int]:
    """The distinct static leading dims of the inputs (user shapes first)."""
    out = set()
    for inp in _graph_inputs(model):
        user = (shapes or {}).get(inp.name)
        dims = inp.type.tensor_type.shape.dim
        if user and user[0] > 0:
            out.add(user[0])
        elif dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            out.add(int(dims[0].dim_value))
    return out


def import_model(model: Any, *, batch: int | None = None,
                 shapes: dict[str, list[int]] | None = None, integer: bool = True,
                 target: Any = None) -> ImportedModel:
    """Prepare (compiler.prepare) and import an ONNX model into Relax with parameters as trailing
    inputs of ``main``.

    ``batch``: the leading dim to compile for (None: the model's own, 1 if it is symbolic).
    ``shapes``: input name -> dims fixing dynamic dimensions (-1 leaves one dynamic).
    ``integer``: a QDQ model's quantized convolutions / matmuls on int8 -> int32 kernels
    (:mod:`compiler.integer`; False: the frontend's dequantize -> float op -> quantize, to compare).
    ``target``: the ``tvm.target.Target`` built for; where it has an int8 dot-product instruction
    the integer kernels that fit use it (:mod:`compiler.int8_x86`).
    """
    from tvm.relax.frontend import detach_params

    from compiler.dynshape import data_dependent_node, from_onnx, has_runtime_shape_operand
    from compiler.dynshape_flow import mark_runtime_operands
    from compiler.empty import empty_inputs
    from compiler.expand import KEPT_WHEN_RUNTIME
    from compiler.prepare import prepare

    _check_input_types(model)
    own = _model_batch(model, shapes)
    # Inputs whose static leading dims differ have no batch dimension: a dynamic leading dim
    # among them is left dynamic here (and refused by name below) rather than guessed.
    fill = (batch or own or 1) if len(_static_leading(model, shapes)) <= 1 else batch
    carriers = frozenset(dtype_only_inputs(model))  # before preparation adds casts of them
    emptied = empty_inputs(model, shapes)  # data inputs given a zero dim (compiler/empty.py)
    if emptied and batch is not None:
        raise ModelError(f"input {sorted(emptied)[0]!r} is empty, so the model compiles for exactly its "
                         f"input shapes, not for batch {batch}", hint="compile without --train/--batch")
    carriers |= emptied
    model, steps = prepare(model, shapes=shapes, batch=fill)
    _check_ops(model, extra=frozenset(KEPT_WHEN_RUNTIME))  # kept whole for compiler.dynshape
    nonfinite = NonFinite(*nonfinite_blockers(model))
    _check_constructs(model)
    mark_runtime_operands(model)  # shape operands computed from model inputs (compiler.dynshape_flow)
    datadep = data_dependent_node(model)
    dynamic = has_runtime_shape_operand(model) or datadep is not None
    if dynamic and batch is not None:  # a shape operand is not a batch of samples
        why = (f"{datadep} has an output whose length depends on the data (not a batch of samples)"
               if datadep is not None else "a node takes a shape operand from a model input")
        raise ModelError(f"{why}, so the model compiles for exactly its input shapes, not for batch {batch}",
                         hint="compile without --train/--batch")
    specs, base, batched = _input_shapes(model, batch, exact=dynamic, carriers=carriers)
    batched = batched and not dynamic
    # outputs computed from run-time shape operands are the run-time code's (checked there), even
    # where the model declares them empty
    empty = [] if dynamic else _take_empty_outputs(model)
    _drop_empty_operands(model)
    if empty:  # produced by the artifact without compiled code (compiler.artifact)
        if batch is not None or any(d < 0 for s in specs for d in s.shape):
            spec0 = empty[0][1]
            raise ModelError(f"output {spec0.name!r} is empty (shape {list(spec0.shape)}), so the model "
                             "compiles for exactly its input shapes, not for a batch",
                             hint="compile without --train/--batch, or fix every input with --shape")
        batched = False
    keep = _trainable(model)
    param_names = [t.name for t in model.graph.initializer if t.name in keep]
    prepared = _constants_to_nodes(model, keep)
    if batched:
        prepared = _rebatch(prepared, specs, base, batch or base)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = from_onnx(prepared, shape_dict={s.name: list(s.shape) for s in specs},
                            opset=opset, keep_params_in_input=True)
    except Exception as exc:
        first = " ".join(str(exc).split())[:300]
        where = _failing_node(prepared, specs, opset)
        raise ModelError(f"TVM could not import {where or 'the model'} at batch {batch or base}: "
                         f"{first}",
                         hint="rewrite that part of the model, or fix input shapes with --shape") from None
    mod, detached = detach_params(mod)
    if dynamic:
        # Kernel fusion sees data dependencies only, not the run-time dims a match_cast binds
        # (compiler.dynshape): in a dataflow block it may move a fused kernel that allocates with
        # such dims above their binding (the VM fails: "has not been computed"). Plain binding
        # blocks keep the order.
        from tvm import relax

        mod = relax.transform.ToNonDataflow()(mod)
    if integer and any(n.op_type == "DequantizeLinear" for n in model.graph.node):
        from compiler.integer import integer_kernels

        rewrite = integer_kernels(mod, target)
        if rewrite.conv2d or rewrite.matmul:
            mod, steps = rewrite.mod, [*steps, rewrite.describe()]
        if rewrite.dot:
            steps = [*steps, rewrite.describe_dot()]
    params = [p.numpy() for p in detached.get("main", [])]
    if len(params) != len(param_names):
        raise ModelError(f"internal: {len(params)} imported parameters but {len(param_names)} initializers",
                         hint="report this model as a bug")
    outputs = _output_specs(mod, model, dynamic)
    late = [s for s in outputs if 0 in s.shape]
    if empty and late:  # the artifact tells the outputs it answers by their zero dims: all or none
        raise ModelError(f"internal: output {late[0].name!r} is empty (shape {list(late[0].shape)}) but "
                         "compiled, beside empty outputs that are not", hint="report this model as a bug")
    for at, spec in empty:
        outputs.insert(at, spec)
    return ImportedModel(mod=mod, inputs=specs, outputs=outputs, param_names=param_names,
                         params=params, batch=batch or base, prepared_steps=steps, batched=batched,
                         nonfinite=nonfinite)


def _check_constructs(model: Any) -> None:
    """Refuse, with the node named, constructs TVM's frontend cannot import or imports wrongly
    (found by the conformance test)."""
    from onnx import numpy_helper

    from compiler.dynshape import SHAPE_OPERANDS, runtime_operand_refusal
    from compiler.dynshape_flow import runtime_values

    g = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    runtime_inputs = {i.name for i in g.input if i.name not in consts}
    computed = runtime_values(model) - runtime_inputs
    types = _value_types(model)
    for vi in g.output:
        kind = vi.type.WhichOneof("value")
        if kind not in (None, "tensor_type"):
            what = _type_name(vi.type)
            what = f"{'an' if what[0] in 'aeiou' else 'a'} {what}"
            raise ModelError(f"output {vi.name!r} is {what}, not a tensor; only "
                             "tensor outputs are supported",
                             hint="return the tensors themselves (e.g. SequenceAt / ConcatFromSequence)")
    for vi in [*g.input, *g.output]:
        elem = vi.type.tensor_type.elem_type
        if elem in _NO_DLPACK:  # numpy and DLPack have no such dtypes
            raise ModelError(f"{vi.name!r} is a {_NO_DLPACK[elem]} tensor, which is not supported as a "
                             "model input or output",
                             hint="give the model float32 (or float16, int8) inputs and outputs")
    for idx, node in enumerate(g.node):
        where = f"{node.op_type} at node {node.name or f'#{idx}'!r}"
        for pos in SHAPE_OPERANDS.get(node.op_type, ()):
            why = runtime_operand_refusal(node.op_type, pos)
            if pos < len(node.input) and node.input[pos] in runtime_inputs and why is not None:
                raise ModelError(f"{where} takes its shape operand from the model input {node.input[pos]!r}: "
                                 f"{why}", hint="make that value a constant (initializer) in the model")
            if pos < len(node.input) and node.input[pos] in computed and why is not None:
                raise ModelError(f"{where} takes its shape operand {node.input[pos]!r} computed from "
                                 f"model inputs: {why}", hint="make that value a constant of the model")
        if node.op_type == "SequenceInsert" and len(node.input) > 2 and node.input[2]:
            pos_value = consts.get(node.input[2])
            if pos_value is None or int(pos_value) < 0:
                kind = "run-time" if pos_value is None else "negative"
                raise ModelError(f"{where} has a {kind} position (TVM inserts at the wrong place)",
                                 hint="use a constant non-negative position")
        if node.op_type == "PRelu" and len(node.input) > 1 and node.input[1] in consts:
            _check_prelu(model, node, where, consts[node.input[1]].shape)
        refusal = _refusal(node, types, consts)
        if refusal is not None:
            raise ModelError(f"{where} {refusal[0]}", hint=refusal[1])


_attr = node_attr


_NO_DLPACK = {16: "bfloat16", 17: "float8", 18: "float8", 19: "float8", 20: "float8", 21: "uint4", 22: "int4",
              23: "float4", 24: "float8", 25: "uint2", 26: "int2"}


def _value_types(model: Any) -> dict[str, tuple[int, int]]:
    """name -> (ONNX element type, rank or -1) of every value shape inference knows."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    g = inferred.graph
    out = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        out[vi.name] = (tt.elem_type, len(tt.shape.dim) if tt.HasField("shape") else -1)
    for t in g.initializer:
        out[t.name] = (t.data_type, len(t.dims))
    return out


def _const_false(consts: dict[str, np.ndarray], name: str) -> bool:
    return name in consts and not bool(np.any(consts[name]))


def _const_zero(consts: dict[str, np.ndarray], name: str) -> bool:
    return bool(name) and name in consts and bool(np.all(consts[name] == 0))


def _refusal(node: Any, types: dict[str, tuple[int, int]],
             consts: dict[str, np.ndarray]) -> tuple[str, str] | None:
    """(reason, hint) for operators and attributes TVM's frontend imports wrongly or crashes on
    (each found by ONNX's operator suite, see tests/compiler/test_conformance.py), else None."""
    op = node.op_type
    outputs = [o for o in node.output]
    if op == "LayerNormalization" and any(outputs[1:]):
        return ("asks for the Mean/InvStdDev outputs, which TVM's converter does not compute",
                "use only the first output (Y), or compute the statistics with ReduceMean")
    if op == "BatchNormalization" and _attr(node, "training_mode", 0):
        return ("is in training mode (batch statistics), which is not supported",
                "export the model in inference mode (model.eval() before torch.onnx.export)")
    if op == "ConvTranspose" and _attr(node, "output_shape") is not None:
        return ("sets output_shape, which TVM's converter ignores",
                "give the equivalent pads / output_padding instead of output_shape")
    if op == "RoiAlign" and _attr(node, "mode", "avg") != "avg":
        return ("uses mode 'max', which TVM's converter computes wrongly", "use mode 'avg'")
    if op == "SpaceToDepth" and _attr(node, "mode", "DCR") != "DCR":
        return ("uses mode 'CRD', which TVM's converter ignores",
                "use mode 'DCR' or express it with Reshape/Transpose")
    if op == "Dropout" and len(node.input) > 2 and node.input[2] and \
            not (_const_false(consts, node.input[2]) or _const_zero(consts, node.input[1])):
        return ("may run in training mode (random masks), which is not supported",
                "export the model in inference mode (model.eval() before torch.onnx.export)")
    if op in ("Scatter", "ScatterElements"):
        return ("is not supported (TVM fails to schedule it)", "use ScatterND")
    if op == "RMSNormalization" and _attr(node, "axis", -1) in (0, -types.get(node.input[0], (0, 0))[1]):
        return ("normalizes over every axis (axis 0), which TVM's converter fails on",
                "normalize over the trailing axes (axis >= 1) or expand it into ReduceMean/Sqrt/Div")
    if op == "BitCast" and 9 in (types.get(node.input[0], (0, 0))[0], _attr(node, "to")):
        return ("reinterprets a bool tensor, whose bits the compiled code does not fix",
                "Cast the bool tensor to uint8 instead")
    return None



def _check_prelu(model: Any, node: Any, where: str, slope: tuple[int, ...]) -> None:
    """ONNX PRelu broadcasts the slope to X unidirectionally (numpy rules from the right)."""
    x = next((i for i in model.graph.input if i.name == node.input[0]), None)
    if x is None:
        return
    dims = [d.dim_value for d in x.type.tensor_type.shape.dim]
    if len(slope) > len(dims) or any(s not in (1, d) for s, d in zip(reversed(slope), reversed(dims),
                                                                     strict=False) if d > 0):
        raise ModelError(f"{where}: slope shape {list(slope)} does not broadcast to the input shape {dims}",
                         hint="give the slope the shape [C, 1, 1] (per channel) or re-export the model")


def _failing_node(model: Any, specs: list[TensorSpec], opset: int | None) -> str | None:
    """Name the first node whose import fails (binary search over graph prefixes), or None."""
    import onnx

    from compiler.dynshape import from_onnx

    nodes = list(model.graph.node)
    if not nodes or len(nodes) > 4096:
        return None

    def fails(k: int) -> bool:
        sub = copy.deepcopy(model)
        del sub.graph.node[k:]
        del sub.graph.output[:]
        sub.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in nodes[k - 1].output if o)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from_onnx(sub, shape_dict={s.name: list(s.shape) for s in specs}, opset=opset,
                          keep_params_in_input=True)
        except Exception:
            return True
        return False

    lo, hi = 1, len(nodes)
    if not fails(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    node = nodes[lo - 1]
    if node.op_type == "Constant":
        return None
    return f"node {node.name or f'#{lo - 1}'!r} ({node.op_type})"


def _take_empty_outputs(model: Any) -> list[tuple[int, TensorSpec]]:
    """Remove the outputs of static shape with a zero dim (CausalConvWithState's present_state at
    kernel size 1) from the graph, with the nodes only they used: TVM cannot store an empty constant
    in a library ("Invalid DLTensor file format" at load). Returns (position, spec) of each; the
    artifact answers them as empty arrays (every output empty: the compiled code returns nothing)."""
    from onnx import helper

    from compiler.graphbuild import _drop_dead_nodes, _static_shapes

    g = model.graph
    declared = {o.name: [d.dim_value if d.HasField("dim_value") else -1 for d in o.type.tensor_type.shape.dim]
                for o in g.output if o.type.tensor_type.HasField("shape")}
    # shape inference costs seconds on big models: only where an empty tensor is in sight
    empty_in = any(d.HasField("dim_value") and d.dim_value == 0
                   for i in g.input for d in i.type.tensor_type.shape.dim)
    if not any(0 in dims for dims in declared.values()) and not any(0 in t.dims for t in g.initializer) \
            and not empty_in:
        return []
    shapes = {**declared, **_static_shapes(model)}
    empty = []
    for at, out in enumerate(g.output):
        dims = shapes.get(out.name)
        if dims is not None and 0 in dims and all(d >= 0 for d in dims):
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(out.type.tensor_type.elem_type)).name
            empty.append((at, TensorSpec(out.name, tuple(dims), dtype)))
    if not empty:
        return []
    names = {spec.name for _, spec in empty}
    kept = [o for o in g.output if o.name not in names]
    del g.output[:]
    g.output.extend(kept)
    _drop_dead_nodes(model)
    return empty


def _drop_empty_operands(model: Any) -> None:
    """Concat operands of static zero size (CausalConvWithState's zero-column padding at kernel
    size 1) add nothing: removed, since TVM cannot store such a constant in a library (it failed at
    load, "Invalid DLTensor file format"). Other empty constants stay: an empty shape operand
    (Reshape to a scalar, inside CumProd's lowering) compiles."""
    from compiler.graphbuild import _drop_dead_nodes, _drop_unused_initializers, _static_shapes

    g = model.graph
    if not any(0 in t.dims for t in g.initializer):
        return
    shapes = _static_shapes(model)
    sizes = {t.name: int(np.prod(t.dims)) for t in g.initializer}
    for name, dims in shapes.items():
        if name not in sizes and dims and all(d >= 0 for d in dims):
            sizes[name] = int(np.prod(dims))
    changed = False
    for node in g.node:
        if node.op_type == "Concat" and node.domain in ("", "ai.onnx"):
            keep = [i for i in node.input if sizes.get(i, 1) != 0]
            if keep and len(keep) != len(node.input):
                del node.input[:]
                node.input.extend(keep)
                changed = True
    if changed:
        _drop_dead_nodes(model)
        _drop_unused_initializers(model)


def _output_specs(mod: Any, model: Any, dynamic: bool = False) -> list[TensorSpec]:
    """The outputs' specs; with ``dynamic`` (a shape operand is a model input) a dim decided at
    run time is -1 (the rank must still be known)."""
    from tvm import relax, tirx

    ret = mod["main"].ret_ty
    if dynamic:  # the body's type keeps the static dims the return type erases with the run-time ones
        ret = getattr(getattr(mod["main"].body, "body", None), "ty", None) or ret
    infos = list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]
    names = [o.name for o in model.graph.output]
    specs = []
    for name, info in zip(names, infos, strict=True):
        if dynamic and isinstance(info, relax.TensorType) and info.ndim >= 0:
            dims = getattr(info.shape, "values", None) or [None] * info.ndim  # (a shape var: no values)
            shape = tuple(int(d) if isinstance(d, tirx.IntImm) else -1 for d in dims)
            specs.append(TensorSpec(name, shape, str(info.dtype)))
            continue
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
