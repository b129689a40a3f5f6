"""Which non-finite float inputs (NaN, +-inf) a compiled model takes at inference.

ONNX defines results for NaN and infinities and onnxruntime gives them, but TVM's ``max`` / ``min``
pick the other operand when one is NaN: Relu(NaN) is 0, Clip(NaN) the lower bound, ReduceMax skips
NaN, Sign(NaN) is 0, where ONNX says NaN. Measured operator by operator against onnxruntime on
[NaN, +-1, +-inf, +-0.5, 2] (compile a one-node model of each; keep the table in step with that
check). A model takes NaN only when every operator that sees a float tensor is in ``_NAN_OK``, and
infinities when every such operator is in ``_INF_OK``; otherwise the first other operator is named
and inference refuses such inputs in one line (a refusal, never a wrong answer).
"""

from __future__ import annotations

from typing import Any

__all__ = ["nonfinite_blockers"]

# Same result as onnxruntime for NaN and infinities (IEEE arithmetic, comparisons, selects, data
# movement, and operators measured so).
_NAN_OK = frozenset({
    "Abs", "Add", "And", "AveragePool", "BatchNormalization", "Cast", "CastLike", "Ceil", "Concat",
    "Constant", "ConstantOfShape", "Conv", "Cos", "Div", "Dropout", "Einsum", "Equal", "Erf", "Exp",
    "Expand", "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gemm", "GlobalAveragePool",
    "Greater", "GreaterOrEqual", "HardSwish", "Identity", "IsInf", "IsNaN", "LayerNormalization",
    "LeakyRelu", "Less", "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Mod", "Mul", "Neg", "Not",
    "Or", "PRelu", "Pad", "Reciprocal", "ReduceMean", "ReduceProd", "ReduceSum", "ReduceSumSquare",
    "Reshape", "Round", "Shape", "Shrink", "Sigmoid", "Sin", "Size", "Slice", "Softmax", "Softplus",
    "Split", "Sqrt", "Squeeze", "Sub", "Sum", "Tanh", "Tile", "Transpose", "Trilu", "Unsqueeze",
    "Where", "Xor",
})
# Right for infinities, wrong for NaN (TVM's max / min / comparisons-as-select drop it).
_INF_ONLY = frozenset({
    "ArgMax", "ArgMin", "Celu", "Clip", "Elu", "GlobalMaxPool", "HardSigmoid", "Max", "MaxPool", "Min",
    "ReduceMax", "ReduceMin", "Relu", "Selu", "Sign", "TopK",
})
_INF_OK = _NAN_OK | _INF_ONLY
_FLOATS = frozenset({1, 10, 11, 16})  # float, float16, double, bfloat16


def nonfinite_blockers(model: Any) -> tuple[str, str]:
    """(the first operator that refuses NaN, the first that refuses infinities) of a prepared
    model, ``""`` where none does. An operator whose inputs are all non-float (integer indices,
    booleans) sees no NaN and blocks nothing."""
    from compiler.graphbuild import _elem_types

    types = _elem_types(model)
    nan = inf = ""
    for node in model.graph.node:
        if not any(types.get(i, 1) in _FLOATS for i in node.input if i):  # unknown type: assume float
            continue
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        if not nan and op not in _NAN_OK:
            nan = op
        if not inf and op not in _INF_OK:
            inf = op
        if nan and inf:
            break
    return nan, inf
