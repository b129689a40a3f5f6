"""``inspect_model``: what an ONNX file holds and whether this compiler can take it, before any compile.

Inputs/outputs (dynamic dims by name), opsets, IR version, operator histogram, and the operators
this compiler cannot handle (not in TVM's Relax ONNX frontend and not decomposed by
``compiler.prepare``), plus the inputs that need ``--shape``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.errors import ModelError

__all__ = ["ModelReport", "inspect_model", "format_report"]


@dataclass
class ModelReport:
    file: str
    ir_version: int
    opsets: dict[str, int]
    producer: str
    inputs: list[dict[str, Any]]  # {"name", "dtype", "shape": [int | str]}
    outputs: list[dict[str, Any]]
    params: int  # number of initializer elements
    ops: dict[str, int]  # op type (domain-qualified when not default) -> count
    unsupported: dict[str, int] = field(default_factory=dict)
    decomposed: dict[str, int] = field(default_factory=dict)
    needs_shape: list[str] = field(default_factory=list)  # inputs with a dynamic non-batch dim
    host: dict[str, int] = field(default_factory=dict)  # string operators run on the host (hoststage.py)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _dims(vi: Any) -> list[int | str]:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return ["?rank"]
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?")
            for d in tt.shape.dim]


def _dtype(vi: Any) -> str:
    import onnx

    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        return vi.type.WhichOneof("value") or "?"
    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
    except Exception:
        return onnx.TensorProto.DataType.Name(tt.elem_type).lower()


def _all_nodes(graph: Any) -> list[Any]:
    out = []
    for n in graph.node:
        out.append(n)
        for a in n.attribute:
            for sub in ([a.g] if a.type == 5 else list(a.graphs) if a.type == 10 else []):
                out.extend(_all_nodes(sub))
    return out


def inspect_model(path: str | Path) -> ModelReport:
    """Read ``path`` (no validation beyond parsing) and describe it; ModelError if unreadable."""
    import onnx

    from compiler.hostsplit import runs_on_host
    from compiler.importer import supported_ops
    from compiler.lower_training import TRAINING_DOMAIN, TRAINING_OPS
    from compiler.prepare import DECOMPOSED_OPS
    from compiler.prepare_ml import CONVERTED_ML_OPS, ML_DOMAIN
    from compiler.qoperator import MS_DOMAIN, MS_OPS, ONNX_OPS

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"ONNX model {str(path)!r} not found", hint="check the path")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"{path.name} is not a readable ONNX model ({type(exc).__name__})",
                         hint="re-export the model with onnx/torch.onnx.export") from None
    g = model.graph
    if len(g.node) == 0 and len(g.output) == 0:
        raise ModelError(f"{path.name} is not a valid ONNX model (empty graph)",
                         hint="re-export the model; the file may be truncated or not ONNX")
    inits = {t.name for t in g.initializer}
    inputs = [{"name": i.name, "dtype": _dtype(i), "shape": _dims(i)} for i in g.input if i.name not in inits]
    outputs = [{"name": o.name, "dtype": _dtype(o), "shape": _dims(o)} for o in g.output]
    ops: Counter[str] = Counter()
    host: Counter[str] = Counter()
    for n in _all_nodes(g):
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        ops[key] += 1
        if runs_on_host(n):
            host[key] += 1
    supported = supported_ops()
    # rewritten by the preparation stage: RNNs and loops unrolled, ai.onnx.ml lowered (prepare_ml.py),
    # the training optimizers lowered (compiler/lower_training.py), QOperator-format quantized
    # operators as their QDQ form (compiler/qoperator.py)
    rewritten = DECOMPOSED_OPS | {f"{ML_DOMAIN}::{op}" for op in CONVERTED_ML_OPS}
    rewritten |= ONNX_OPS | {f"{MS_DOMAIN}::{op}" for op in MS_OPS}
    rewritten |= {f"{TRAINING_DOMAIN}::{op}" for op in TRAINING_OPS}
    unsupported = {k: v for k, v in ops.items()
                   if k not in supported and k not in rewritten and k not in host}
    decomposed = {k: v - host[k] for k, v in ops.items() if k in rewritten and v > host[k]}
    needs = [i["name"] for i in inputs if any(isinstance(d, str) for d in i["shape"][1:])
             or i["shape"] == ["?rank"]]
    params = 0
    for t in g.initializer:
        n = 1
        for d in t.dims:
            n *= d
        params += n
    return ModelReport(file=path.name, ir_version=int(model.ir_version),
                       opsets={(o.domain or "ai.onnx"): int(o.version) for o in model.opset_import},
                       producer=f"{model.producer_name} {model.producer_version}".strip(),
                       inputs=inputs, outputs=outputs, params=params, ops=dict(ops.most_common()),
                       unsupported=unsupported, decomposed=decomposed, needs_shape=needs, host=dict(host))


def format_report(r: ModelReport) -> str:
    def shape(s: list[int | str]) -> str:
        return "[" + ", ".join(str(d) for d in s) + "]"

    lines = [f"{r.file}: IR {r.ir_version}, opsets " + ", ".join(f"{k} {v}" for k, v in r.opsets.items())
             + (f", producer {r.producer}" if r.producer else "") + f", {r.params:,} parameters"]
    lines.append("inputs:")
    lines += [f"  {i['name']}: {i['dtype']} {shape(i['shape'])}" for i in r.inputs]
    lines.append("outputs:")
    lines += [f"  {o['name']}: {o['dtype']} {shape(o['shape'])}" for o in r.outputs]
    lines.append(f"operators ({sum(r.ops.values())} nodes, {len(r.ops)} types):")
    lines += [f"  {k:<28} {v}" for k, v in r.ops.items()]
    if r.decomposed:
        lines.append("decomposed before import: " + ", ".join(f"{k} x{v}" for k, v in r.decomposed.items()))
    if r.host:
        lines.append("run on the host (string tensors): " + ", ".join(f"{k} x{v}" for k, v in r.host.items()))

    if r.unsupported:
        lines.append("UNSUPPORTED by this compiler: "
                     + ", ".join(f"{k} x{v}" for k, v in r.unsupported.items()))
    else:
        lines.append("all operators supported")
    if r.needs_shape:
        by_name = {i["name"]: i["shape"] for i in r.inputs}
        hints = " ".join(f"--shape {n}=" + ",".join(str(d) if isinstance(d, int) else "D" for d in by_name[n])
                         for n in r.needs_shape)
        lines.append(f"dynamic dimensions beyond the batch: compile with {hints}")
    return "\n".join(lines)
