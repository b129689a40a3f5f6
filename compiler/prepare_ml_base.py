"""Shared by the ai.onnx.ml lowerings (compiler/prepare_ml.py, compiler/prepare_ml_trees.py): the
node emitter, the graph's types and shapes, attribute reading, refusals, post transforms and labels."""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.errors import ModelError

_STRING = 8  # onnx TensorProto.STRING
_FLOAT, _DOUBLE, _FLOAT16 = 1, 11, 10

def _refuse(node: Any, why: str) -> ModelError:
    where = node.name or node.output[0]
    return ModelError(f"ai.onnx.ml::{node.op_type} at node {where!r}: {why}",
                      hint="rewrite this part of the model with standard ONNX operators, or run it "
                           "outside the compiled model")


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper, numpy_helper

    out: dict[str, Any] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if a.type == a.TENSOR:
            v = (None if v.data_type == _STRING else numpy_helper.to_array(v), v.data_type)
        elif isinstance(v, bytes):
            v = v.decode()
        out[a.name] = v
    return out


# ------------------------------------------------------------------------------------ emitting
class _Emit:
    """Collects the standard-ONNX nodes that replace one ai.onnx.ml node."""

    def __init__(self, prefix: str, opset: int) -> None:
        self.prefix, self.opset, self.n = prefix, opset, 0
        self.nodes: list[Any] = []

    def _name(self) -> str:
        self.n += 1
        return f"{self.prefix}_{self.n}"

    def const(self, value: Any, dtype: Any = None) -> str:
        from onnx import helper, numpy_helper

        out = self._name()
        arr = np.asarray(value, dtype=dtype)
        self.nodes.append(helper.make_node("Constant", [], [out], name=out,
                                           value=numpy_helper.from_array(arr, out)))
        return out

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        from onnx import helper

        out = out or self._name()
        name = f"{self.prefix}_{op_type}_{self.n}_{out}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=name, **attrs))
        return out

    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int, out: str | None = None) -> str:
        if op_type == "ReduceSum" or self.opset >= 18:
            return self.op(op_type, [x, self.const(axes, np.int64)], out, keepdims=keepdims)
        return self.op(op_type, [x], out, axes=axes, keepdims=keepdims)

    def cast(self, x: str, to: int, out: str | None = None) -> str:
        return self.op("Cast", [x], out, to=to)


class _Info:
    """Element types and ranks of the graph's tensors (shape inference)."""

    def __init__(self, model: Any) -> None:
        import onnx

        try:
            typed = onnx.shape_inference.infer_shapes(model).graph
        except Exception:
            typed = model.graph
        self.types: dict[str, int] = {}
        self.dims: dict[str, list[int]] = {}  # -1: not known
        for vi in [*typed.input, *typed.value_info, *typed.output]:
            tt = vi.type.tensor_type
            if tt.elem_type:
                self.types[vi.name] = tt.elem_type
            if tt.HasField("shape"):
                self.dims[vi.name] = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        for t in model.graph.initializer:
            self.types[t.name] = t.data_type
            self.dims[t.name] = list(t.dims)

    def float_input(self, e: _Emit, x: str, node: Any, allow_double: bool = True) -> tuple[str, int]:
        """``x`` as a float tensor (integers cast to float32); (name, onnx float type)."""
        t = self.types.get(x, _FLOAT)
        if t == _FLOAT or (t == _DOUBLE and allow_double):
            return x, t
        if t in (_DOUBLE, 6, 7, 5, 3, 2, 4, 12, 13):  # double (when not allowed), integers
            return e.cast(x, _FLOAT), _FLOAT
        if t == _FLOAT16:
            return e.cast(x, _FLOAT), _FLOAT
        raise _refuse(node, f"input {x!r} has element type {t}, which this operator does not take")

    def rank(self, x: str, node: Any) -> int:
        if x not in self.dims:
            raise _refuse(node, f"the rank of {x!r} is unknown; fix the input shapes with --shape")
        return len(self.dims[x])

    def last_dim(self, x: str, node: Any) -> int:
        d = self.dims.get(x, [-1])
        if not d or d[-1] < 1:
            raise _refuse(node, f"the last dimension of {x!r} is unknown; fix the input shapes with --shape")
        return d[-1]


def _np_float(t: int) -> type[np.floating[Any]]:
    return np.float64 if t == _DOUBLE else np.float32


def _floats(a: dict[str, Any], name: str, default: list[float] | None = None) -> np.ndarray:
    """A float list attribute, or its ``*_as_tensor`` twin (float64 then)."""
    if f"{name}_as_tensor" in a:
        return np.asarray(a[f"{name}_as_tensor"][0], dtype=np.float64).ravel()
    return np.asarray(a.get(name, default if default is not None else []), dtype=np.float64)


def _post_transform(e: _Emit, node: Any, scores: str, how: str) -> str:
    if how in ("NONE", 0):
        return scores
    if how in ("LOGISTIC", 2):
        return e.op("Sigmoid", [scores])
    if how in ("SOFTMAX", 1):
        return e.op("Softmax", [scores], axis=-1)
    raise _refuse(node, f"post_transform={how!r} not converted (NONE, LOGISTIC and SOFTMAX are)")


def _labels(e: _Emit, node: Any, a: dict[str, Any], scores: str, out: str) -> None:
    labels = a.get("classlabels_ints", a.get("classlabels_int64s"))
    if labels is None:
        raise _refuse(node, "class labels are strings (string tensors are not supported)")
    best = e.op("ArgMax", [scores], axis=1, keepdims=0)
    e.op("Gather", [e.const(np.asarray(labels, np.int64)), best], out, axis=0)
