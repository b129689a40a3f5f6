"""The ``ai.onnx.ml`` operators sensor pipelines use, lowered to standard ONNX before TVM import.

TVM's Relax ONNX frontend converts no operator of the classical-ML domain. ``lower_ml`` (a step of
``compiler.prepare``) rewrites each one into default-domain operators the frontend handles, or
``check_ml_node`` refuses it by name with the reason, before any work is done:

* Binarizer, Scaler, Normalizer, Imputer, FeatureVectorizer, ArrayFeatureExtractor: elementwise
  arithmetic, reductions, Gather / Concat.
* LabelEncoder (numeric keys and values), OneHotEncoder (integer categories): Equal against the
  key vector, ArgMax of the match, Gather of the value, Where for the default.
* LinearRegressor, LinearClassifier: MatMul + Add, post transform, ArgMax + Gather for labels.
* TreeEnsemble (ai.onnx.ml 5), TreeEnsembleRegressor, TreeEnsembleClassifier: tree traversal as
  tensors. Every node of every tree is one row of constant tables (feature, threshold, comparison,
  true / false successor; a leaf is its own successor); ``depth`` rounds of Gather -> compare ->
  Where move all trees of all samples one level down at once, then a Gather of the leaf values
  and a reduction over the trees aggregate. Memory is linear in the number of nodes.

Refused: string tensors (the compiled CPU path carries floats and integers only), ZipMap (its
output is a sequence of maps), and the operators not converted (SVM*, DictVectorizer,
CategoryMapper, ...), each with one line naming the operator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from compiler.errors import ModelError

__all__ = ["ML_DOMAIN", "CONVERTED_ML_OPS", "check_ml_node", "lower_ml"]

ML_DOMAIN = "ai.onnx.ml"
_STRING = 8  # onnx TensorProto.STRING
_FLOAT, _DOUBLE, _FLOAT16 = 1, 11, 10
_NEW_OPSET = 17  # the default-domain opset given to a model that has only ai.onnx.ml nodes
_MIN_OPSET = 13  # the emitted nodes use opset-13 signatures (and the Reduce* change of 18)

_REFUSED = {
    "ZipMap": "its output is a sequence of maps, which compiled code cannot return; export the "
              "classifier without ZipMap (skl2onnx: options={'zipmap': False})",
    "DictVectorizer": "its input is a map, which compiled code cannot take",
    "CastMap": "its input is a map, which compiled code cannot take",
    "CategoryMapper": "it maps strings to integers (string tensors are not supported)",
    "SVMClassifier": "not converted (support vector machines); export a linear or tree model",
    "SVMRegressor": "not converted (support vector machines); export a linear or tree model",
}

# TreeEnsemble comparison modes (ai.onnx.ml 5 numbering; the older operators' strings map to them)
_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_OLD_MODES = {"BRANCH_LEQ": _LEQ, "BRANCH_LT": _LT, "BRANCH_GTE": _GTE, "BRANCH_GT": _GT,
              "BRANCH_EQ": _EQ, "BRANCH_NEQ": _NEQ}


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


def _string_attrs(a: dict[str, Any]) -> list[str]:
    names = [k for k, v in a.items() if isinstance(v, list) and v and isinstance(v[0], bytes)]
    names += [k for k, v in a.items() if isinstance(v, tuple) and v[1] == _STRING]
    return names


def check_ml_node(node: Any, elem_types: dict[str, int] | None = None) -> None:
    """ModelError (one line naming the operator and the reason) unless ``lower_ml`` converts ``node``."""
    if node.op_type in _REFUSED:
        raise _refuse(node, _REFUSED[node.op_type])
    if node.op_type not in _CONVERTERS:
        raise _refuse(node, "not converted by the compiler (no TVM converter for this operator)")
    a = _attrs(node)
    strings = [k for k in _string_attrs(a) if k not in ("nodes_modes", "post_transform", "aggregate_function",
                                                        "norm", "multi_class")]
    if strings:
        raise _refuse(node, f"string {'/'.join(sorted(strings))} (string tensors cannot be represented "
                            "by the compiled float/integer code)")
    if node.op_type == "OneHotEncoder" and not a.get("zeros", 1):
        raise _refuse(node, "zeros=0 makes an unknown category an error at run time, which compiled code "
                            "cannot raise")
    for name in [*node.input, *node.output]:
        if name and (elem_types or {}).get(name) == _STRING:
            raise _refuse(node, f"{name!r} is a string tensor (string tensors cannot be represented by the "
                                "compiled float/integer code)")


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


# -------------------------------------------------------------------------------- simple operators
def _binarizer(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    x = node.input[0]
    t = info.types.get(x, _FLOAT)
    xc = x if t in (_FLOAT, _DOUBLE) else e.cast(x, _DOUBLE)  # integers compare exactly in double
    thr = e.const(a.get("threshold", 0.0), np.float64 if t != _FLOAT else np.float32)
    from onnx import helper

    npt = helper.tensor_dtype_to_np_dtype(t)
    e.op("Where", [e.op("Greater", [xc, thr]), e.const(1, npt), e.const(0, npt)], node.output[0])


def _per_feature(values: np.ndarray) -> np.ndarray:
    return values if values.size != 1 else values.reshape(())


def _scaler(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    x, t = info.float_input(e, node.input[0], node)
    npt = _np_float(t)
    y = e.op("Mul", [e.op("Sub", [x, e.const(_per_feature(_floats(a, "offset", [0.0])), npt)]),
                     e.const(_per_feature(_floats(a, "scale", [1.0])), npt)])
    e.cast(y, _FLOAT, node.output[0])


def _normalizer(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    x, t = info.float_input(e, node.input[0], node)
    norm = a.get("norm", "MAX")
    axis = info.rank(node.input[0], node) - 1
    if norm == "MAX":  # X / max(X), as the operator's definition and onnxruntime (not max |X|)
        e.cast(e.op("Div", [x, e.reduce("ReduceMax", x, [axis], 1)]), _FLOAT, node.output[0])
        return
    if norm == "L1":
        div = e.reduce("ReduceSum", e.op("Abs", [x]), [axis], 1)
    elif norm == "L2":
        div = e.op("Sqrt", [e.reduce("ReduceSum", e.op("Mul", [x, x]), [axis], 1)])
    else:
        raise _refuse(node, f"norm={norm!r} is none of MAX, L1, L2")
    div = e.op("Max", [div, e.const(1e-30 if t == _DOUBLE else np.float32(1e-30), _np_float(t))])
    e.cast(e.op("Div", [x, div]), _FLOAT, node.output[0])


def _imputer(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    x = node.input[0]
    t = info.types.get(x, _FLOAT)
    if a.get("imputed_value_floats"):
        values = np.asarray(a["imputed_value_floats"], np.float32)
        replaced = float(a.get("replaced_value_float", 0.0))
        npt: Any = np.float32
    elif a.get("imputed_value_int64s"):
        values = np.asarray(a["imputed_value_int64s"], np.int64)
        replaced = float(a.get("replaced_value_int64", 0))
        npt = np.int64
    else:
        raise _refuse(node, "no imputed values")
    if (npt is np.float32) != (t == _FLOAT):
        raise _refuse(node, f"imputed values of another type than the input (element type {t})")
    if np.isnan(replaced):
        hit = e.op("IsNaN", [x])
    else:
        hit = e.op("Equal", [x, e.const(replaced, npt)])
    e.op("Where", [hit, e.const(_per_feature(values.astype(npt))), x], node.output[0])


def _feature_vectorizer(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    dims = list(a.get("inputdimensions", []))
    if len(dims) != len(node.input):
        raise _refuse(node, f"{len(dims)} inputdimensions for {len(node.input)} inputs")
    parts = []
    for x, d in zip(node.input, dims, strict=True):
        xf, _ = info.float_input(e, x, node, allow_double=False)
        r = info.rank(x, node)
        if r == 1:
            xf = e.op("Reshape", [xf, e.const([-1, 1], np.int64)])
        elif r != 2:
            raise _refuse(node, f"input {x!r} has rank {r}; FeatureVectorizer takes rank 1 or 2")
        parts.append(_fit_width(e, xf, 1 if r == 1 else info.last_dim(x, node), d))
    e.op("Concat", parts, node.output[0], axis=1)


def _fit_width(e: _Emit, x: str, have: int, width: int) -> str:
    """``x`` [N, have] cut or zero-padded to [N, width]."""
    if have > width:
        return e.op("Slice", [x, e.const([0], np.int64), e.const([width], np.int64), e.const([1], np.int64)])
    if have < width:
        return e.op("Pad", [x, e.const([0, 0, 0, width - have], np.int64)])
    return x


def _array_feature_extractor(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    x, idx = node.input[0], node.input[1]
    r = info.rank(x, node)
    width = info.last_dim(x, node)
    # TVM's Gather does not check its indices (an out-of-range one reads or faults anywhere):
    # negative ones count from the end as ONNX says, the rest are clamped into the row
    flat = e.op("Reshape", [idx, e.const([-1], np.int64)])
    flat = e.op("Where", [e.op("Less", [flat, e.const(0, np.int64)]),
                          e.op("Add", [flat, e.const(width, np.int64)]), flat])
    flat = e.op("Clip", [flat, e.const(0, np.int64), e.const(width - 1, np.int64)])
    if r == 1:
        e.op("Reshape", [e.op("Gather", [x, flat], axis=0), e.const([1, -1], np.int64)], node.output[0])
    else:
        e.op("Gather", [x, flat], node.output[0], axis=r - 1)


def _lookup(e: _Emit, x: str, keys: np.ndarray, values: np.ndarray, default: Any, out: str) -> None:
    """out = values[i] where x == keys[i] (the first such i; NaN keys match NaN), else default."""
    xk = e.op("Unsqueeze", [x, e.const([-1], np.int64)])
    hit = e.op("Equal", [xk, e.const(keys)])
    if keys.dtype.kind == "f" and np.isnan(keys).any():
        nan_keys = e.const(np.isnan(keys))
        hit = e.op("Or", [hit, e.op("And", [e.op("IsNaN", [xk]), nan_keys])])
    hit_i = e.cast(hit, 7)
    first = e.op("ArgMax", [hit_i], axis=-1, keepdims=0)
    found = e.op("Greater", [e.reduce("ReduceMax", hit_i, [-1], 0), e.const(0, np.int64)])
    hit_value = e.op("Gather", [e.const(values), first], axis=0)
    e.op("Where", [found, hit_value, e.const(default, values.dtype)], out)


def _label_encoder(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    x = node.input[0]
    if "keys_tensor" in a:
        keys = np.asarray(a["keys_tensor"][0]).ravel()
    elif "keys_floats" in a:
        keys = np.asarray(a["keys_floats"], np.float32)
    else:
        keys = np.asarray(a.get("keys_int64s", []), np.int64)
    if "values_tensor" in a:
        values = np.asarray(a["values_tensor"][0]).ravel()
        default: Any = a["default_tensor"][0].ravel()[0] if "default_tensor" in a else 0
    elif "values_floats" in a:
        values, default = np.asarray(a["values_floats"], np.float32), a.get("default_float", -0.0)
    else:
        values, default = np.asarray(a.get("values_int64s", []), np.int64), a.get("default_int64", -1)
    if keys.size == 0 or keys.size != values.size:
        raise _refuse(node, f"{keys.size} keys for {values.size} values")
    from onnx import helper

    xt = info.types.get(x)
    if xt is not None and helper.tensor_dtype_to_np_dtype(xt) != keys.dtype:
        keys = keys.astype(helper.tensor_dtype_to_np_dtype(xt))
    _lookup(e, x, keys, values, default, node.output[0])


def _one_hot_encoder(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    if not a.get("cats_int64s"):
        raise _refuse(node, "no integer categories (cats_int64s)")
    x = node.input[0]
    if info.types.get(x, 7) != 7:
        x = e.cast(x, 7)
    hit = e.op("Equal", [e.op("Unsqueeze", [x, e.const([-1], np.int64)]),
                         e.const(np.asarray(a["cats_int64s"], np.int64))])
    e.cast(hit, _FLOAT, node.output[0])


# --------------------------------------------------------------------------- linear models
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


def _linear_scores(e: _Emit, node: Any, a: dict[str, Any], info: _Info, targets: int) -> tuple[str, Any]:
    x, t = info.float_input(e, node.input[0], node)
    npt = _np_float(t)
    coef = np.asarray(a.get("coefficients", []), np.float64)
    if targets < 1 or coef.size % targets:
        raise _refuse(node, f"{coef.size} coefficients for {targets} targets")
    if info.rank(node.input[0], node) == 1:
        x = e.op("Reshape", [x, e.const([1, -1], np.int64)])
    scores = e.op("MatMul", [x, e.const(coef.reshape(targets, -1).T.astype(npt))])
    if a.get("intercepts"):
        scores = e.op("Add", [scores, e.const(np.asarray(a["intercepts"], npt))])
    return scores, npt


def _linear_regressor(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    if a.get("post_transform", "NONE") != "NONE":
        raise _refuse(node, f"post_transform={a['post_transform']!r} not converted (NONE is)")
    scores, _ = _linear_scores(e, node, a, info, int(a.get("targets", 1)))
    e.cast(scores, _FLOAT, node.output[0])


def _linear_classifier(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    n_classes = len(a.get("classlabels_ints", a.get("classlabels_strings", [])))
    coef = np.asarray(a.get("coefficients", []))
    rows = coef.size // info.last_dim(node.input[0], node)
    scores, npt = _linear_scores(e, node, a, info, rows)
    if rows == 1 and n_classes == 2:  # binary: one score s becomes [-s, s]
        if a.get("post_transform", "NONE") != "LOGISTIC":
            # onnxruntime answers [1 - s, s] for NONE and SOFTMAX alike (measured): not guessed
            raise _refuse(node, "a one-score binary classifier is converted with post_transform=LOGISTIC "
                                "only")
        scores = e.op("Concat", [e.op("Neg", [scores]), scores], axis=1)
    elif rows < 2 or rows != n_classes:
        raise _refuse(node, f"{rows} score column(s) for {n_classes} classes is not converted")
    scores = e.cast(_post_transform(e, node, scores, a.get("post_transform", "NONE")), _FLOAT)
    _labels(e, node, a, scores, node.output[0])
    if len(node.output) > 1 and node.output[1]:
        e.op("Identity", [scores], node.output[1])


# ------------------------------------------------------------------------------------ tree ensembles
class _Forest:
    """Every node of every tree as rows of flat tables; leaves point at themselves."""

    def __init__(self, n: int, n_targets: int) -> None:
        self.feature = np.zeros(n, np.int64)
        self.threshold = np.zeros(n, np.float64)
        self.mode = np.full(n, _LEQ, np.int64)
        self.missing_true = np.zeros(n, bool)
        self.true = np.arange(n, dtype=np.int64)
        self.false = np.arange(n, dtype=np.int64)
        self.leaf = np.zeros(n, bool)
        self.values: np.ndarray = np.zeros((n, n_targets), np.float64)
        self.hit = np.zeros((n, n_targets), bool)  # whether a leaf gives a value to the target
        self.roots = np.zeros(0, np.int64)

    def depth(self, node: Any) -> int:
        """The longest root-to-leaf path (number of comparisons); refuses cycles."""
        best = 0
        for r in self.roots:
            stack = [(int(r), 0)]
            while stack:
                i, d = stack.pop()
                if d > len(self.feature):
                    raise _refuse(node, "a tree has a cycle")
                if self.leaf[i]:
                    best = max(best, d)
                    continue
                stack.extend([(int(self.true[i]), d + 1), (int(self.false[i]), d + 1)])
        return best


def _aggregate_leaf(f: _Forest, i: int, target: int, w: float, how: str) -> None:
    if not f.hit[i, target]:
        f.values[i, target], f.hit[i, target] = w, True
    elif how == "MIN":
        f.values[i, target] = min(f.values[i, target], w)
    elif how == "MAX":
        f.values[i, target] = max(f.values[i, target], w)
    else:
        f.values[i, target] += w


def _old_forest(node: Any, a: dict[str, Any], prefix: str, n_targets: int, how: str) -> _Forest:
    """TreeEnsembleRegressor / TreeEnsembleClassifier attributes (nodes keyed by (tree, node id))."""
    tree, nid = list(a.get("nodes_treeids", [])), list(a.get("nodes_nodeids", []))
    modes = [m.decode() if isinstance(m, bytes) else m for m in a.get("nodes_modes", [])]
    n = len(tree)
    if not n or any(len(a.get(k, [])) != n for k in ("nodes_nodeids", "nodes_featureids", "nodes_modes",
                                                      "nodes_truenodeids", "nodes_falsenodeids")):
        raise _refuse(node, "the nodes_* attributes do not have one entry per node")
    index = {(t, i): k for k, (t, i) in enumerate(zip(tree, nid, strict=True))}
    f = _Forest(n, n_targets)
    values = _floats(a, "nodes_values", [0.0] * n)
    mtt = list(a.get("nodes_missing_value_tracks_true", [])) or [0] * n
    for k in range(n):
        if modes[k] == "LEAF":
            f.leaf[k] = True
            continue
        if modes[k] not in _OLD_MODES:
            raise _refuse(node, f"node mode {modes[k]!r} is not a comparison")
        try:
            f.true[k] = index[tree[k], a["nodes_truenodeids"][k]]
            f.false[k] = index[tree[k], a["nodes_falsenodeids"][k]]
        except KeyError:
            raise _refuse(node, f"node {nid[k]} of tree {tree[k]} points at a node that does not "
                                "exist") from None
        f.mode[k] = _OLD_MODES[modes[k]]
        f.feature[k], f.threshold[k], f.missing_true[k] = a["nodes_featureids"][k], values[k], bool(mtt[k])
    firsts: dict[int, int] = {}
    for k, t in enumerate(tree):
        firsts.setdefault(t, k)
    f.roots = np.asarray([firsts[t] for t in sorted(firsts)], np.int64)
    ids, nodes_, trees_ = (a.get(f"{prefix}_{k}", []) for k in ("ids", "nodeids", "treeids"))
    weights = _floats(a, f"{prefix}_weights")
    if not (len(ids) == len(nodes_) == len(trees_) == len(weights)):
        raise _refuse(node, f"the {prefix}_* attributes differ in length")
    for t, i, target, w in zip(trees_, nodes_, ids, weights, strict=True):
        at = index.get((t, i))
        if at is None or not f.leaf[at] or not 0 <= target < n_targets:
            raise _refuse(node, f"a leaf weight names node {i} of tree {t} / target {target}, which is "
                                "no leaf")
        _aggregate_leaf(f, at, target, float(w), how)
    return f


def _new_forest(node: Any, a: dict[str, Any]) -> _Forest:
    """TreeEnsemble (ai.onnx.ml 5): interior nodes and leaves in separate tables; set membership
    nodes become chains of equality nodes."""
    splits = np.asarray(a["nodes_splits"][0], np.float64).ravel()
    modes = np.asarray(a["nodes_modes"][0]).ravel().astype(np.int64)
    n_nodes, n_targets = splits.size, int(a.get("n_targets", 1))
    feats = list(a.get("nodes_featureids", []))
    tl, fl = list(a.get("nodes_trueleafs", [])), list(a.get("nodes_falseleafs", []))
    tn, fn = list(a.get("nodes_truenodeids", [])), list(a.get("nodes_falsenodeids", []))
    mtt = list(a.get("nodes_missing_value_tracks_true", [])) or [0] * n_nodes
    leaf_w = np.asarray(a["leaf_weights"][0], np.float64).ravel()
    leaf_t = list(a.get("leaf_targetids", []))
    if any(len(v) != n_nodes for v in (feats, tl, fl, tn, fn, modes, mtt)) or len(leaf_t) != leaf_w.size:
        raise _refuse(node, "the nodes_* / leaf_* attributes do not have one entry per node / leaf")
    members = (np.asarray(a["membership_values"][0], np.float64).ravel() if "membership_values" in a
               else np.zeros(0))
    sets: list[list[float]] = [[]]
    for v in members:
        if np.isnan(v):
            sets.append([])
        else:
            sets[-1].append(float(v))
    member_nodes = [k for k in range(n_nodes) if modes[k] == _MEMBER]
    if len(sets) - 1 < len(member_nodes):
        raise _refuse(node, "fewer membership sets than set-membership nodes")
    extra = sum(max(len(sets[j]) - 1, 0) for j in range(len(member_nodes)))
    n_leaves = leaf_w.size
    total = n_nodes + extra + n_leaves
    f = _Forest(total, n_targets)
    leaf0 = n_nodes + extra
    f.leaf[leaf0:] = True
    agg = {0: "SUM", 1: "SUM", 2: "MIN", 3: "MAX"}.get(int(a.get("aggregate_function", 1)), "SUM")
    for j, (t, w) in enumerate(zip(leaf_t, leaf_w, strict=True)):
        if not 0 <= t < n_targets:
            raise _refuse(node, f"leaf {j} names target {t} of {n_targets}")
        _aggregate_leaf(f, leaf0 + j, t, float(w), agg)

    def succ(k: int, is_leaf: int, target: int) -> int:
        bound = n_leaves if is_leaf else n_nodes
        if not 0 <= target < bound:
            kind = "leaf" if is_leaf else "node"
            raise _refuse(node, f"node {k} points at {kind} {target}, which does not exist")
        return leaf0 + target if is_leaf else target

    next_extra, member_i = n_nodes, 0
    for k in range(n_nodes):
        t_to, f_to = succ(k, tl[k], tn[k]), succ(k, fl[k], fn[k])
        f.feature[k], f.missing_true[k] = feats[k], bool(mtt[k])
        if modes[k] == _MEMBER:
            # an empty set matches nothing (NaN never compares equal)
            values = sets[member_i] or [float("nan")]
            member_i += 1
            chain = [k] + list(range(next_extra, next_extra + len(values) - 1))
            next_extra += len(values) - 1
            for c, (at, member) in enumerate(zip(chain, values, strict=True)):
                f.mode[at], f.threshold[at], f.feature[at] = _EQ, member, feats[k]
                # NaN input: only the first test of the chain may follow missing_tracks_true
                f.missing_true[at] = bool(mtt[k]) if c == 0 else False
                f.true[at] = t_to
                f.false[at] = chain[c + 1] if c + 1 < len(chain) else f_to
        elif 0 <= modes[k] <= _NEQ:
            f.mode[k], f.threshold[k], f.true[k], f.false[k] = modes[k], splits[k], t_to, f_to
        else:
            raise _refuse(node, f"node mode {modes[k]} is not a comparison")
    roots = []
    for r in a.get("tree_roots", []):
        degenerate = tl[r] and fl[r] and tn[r] == fn[r]
        roots.append(leaf0 + r if degenerate else r)  # as the reference: a leaf tree's root is its leaf index
    f.roots = np.asarray(roots, np.int64)
    return f


def _compare(e: _Emit, x: str, thr: str, mode: int) -> str:
    op = {_LEQ: "LessOrEqual", _LT: "Less", _GTE: "GreaterOrEqual", _GT: "Greater", _EQ: "Equal"}
    if mode == _NEQ:
        return e.op("Not", [e.op("Equal", [x, thr])])
    return e.op(op[mode], [x, thr])


def _traverse(e: _Emit, node: Any, f: _Forest, x: str, npt: Any, nan_rule: str) -> str:
    """Leaf index [N, trees] reached by every sample in every tree. ``nan_rule``: "track" (a NaN
    feature goes where missing_tracks_true says: the older operators) or "or" (comparison OR
    (NaN and missing_tracks_true): TreeEnsemble 5)."""
    inner = ~f.leaf
    modes = sorted(set(f.mode[inner].tolist())) or [_LEQ]
    use_nan = bool(f.missing_true.any()) or (nan_rule == "track" and _NEQ in modes)
    idx: str | None = None
    tables = {"feature": f.feature, "threshold": f.threshold.astype(npt), "mode": f.mode,
              "missing": f.missing_true, "true": f.true, "false": f.false}
    consts = {k: e.const(v) for k, v in tables.items()} if f.depth(node) > 1 else {}
    for _ in range(max(f.depth(node), 1)):
        if idx is None:  # first level: the roots are known, so their rows are constants
            at: dict[str, str] = {k: e.const(v[f.roots]) for k, v in tables.items()}
            feat = e.op("Gather", [x, at["feature"]], axis=1)
        else:
            at = {k: e.op("Gather", [c, idx], axis=0) for k, c in consts.items()}
            feat = e.op("GatherElements", [x, at["feature"]], axis=1)
        cond = _compare(e, feat, at["threshold"], modes[0])
        for m in modes[1:]:  # And/Or rather than a boolean Where (which onnxruntime lacks)
            is_m = e.op("Equal", [at["mode"], e.const(m, np.int64)])
            cond = e.op("Or", [e.op("And", [is_m, _compare(e, feat, at["threshold"], m)]),
                               e.op("And", [e.op("Not", [is_m]), cond])])
        if use_nan:
            nan = e.op("IsNaN", [feat])
            if nan_rule == "track":
                cond = e.op("Or", [e.op("And", [nan, at["missing"]]),
                                   e.op("And", [e.op("Not", [nan]), cond])])
            else:
                cond = e.op("Or", [cond, e.op("And", [nan, at["missing"]])])
        idx = e.op("Where", [cond, at["true"], at["false"]])
    assert idx is not None
    return idx


def _forest_scores(e: _Emit, node: Any, f: _Forest, x: str, npt: Any, how: str, nan_rule: str,
                   base: np.ndarray | None = None) -> str:
    """[N, targets] aggregated over the trees (SUM, AVERAGE, MIN, MAX), plus ``base``; a target no
    reached leaf gives a value to is 0 (without the base), as onnxruntime does."""
    idx = _traverse(e, node, f, x, npt, nan_rule)
    table = f.values.copy()
    if how in ("MIN", "MAX"):
        table[~f.hit] = np.inf if how == "MIN" else -np.inf
    vals = e.op("Gather", [e.const(table.astype(npt)), idx], axis=0)  # [N, trees, targets]
    if how in ("SUM", "AVERAGE"):
        out = e.reduce("ReduceSum", vals, [1], 0)
        if how == "AVERAGE":
            out = e.op("Div", [out, e.const(float(len(f.roots)), npt)])
    elif how in ("MIN", "MAX"):
        out = e.reduce("ReduceMin" if how == "MIN" else "ReduceMax", vals, [1], 0)
    else:
        raise _refuse(node, f"aggregate_function={how!r} is none of SUM, AVERAGE, MIN, MAX")
    if base is not None and base.size:
        out = e.op("Add", [out, e.const(base.astype(npt))])
    if f.hit[f.leaf].all():
        return out
    hits = e.op("Gather", [e.const(f.hit.astype(np.int64)), idx], axis=0)
    scored = e.op("Greater", [e.reduce("ReduceMax", hits, [1], 0), e.const(0, np.int64)])
    return e.op("Where", [scored, out, e.const(0, npt)])


def _tree_input(e: _Emit, node: Any, info: _Info, double: bool, features: list[int]) -> tuple[str, Any]:
    """The input as a float tensor; refuses feature ids outside its rows (the gathers do not check)."""
    x = node.input[0]
    if info.rank(x, node) != 2:
        raise _refuse(node, f"input {x!r} has rank {info.rank(x, node)}; tree ensembles take [N, features]")
    width = info.last_dim(x, node)
    bad = [f for f in features if not 0 <= f < width]
    if bad:
        raise _refuse(node, f"a node tests feature {bad[0]}, but {x!r} has {width} features")
    t = info.types.get(x, _FLOAT)
    if double or t == _DOUBLE:
        return (x if t == _DOUBLE else e.cast(x, _DOUBLE)), np.float64
    return (x if t == _FLOAT else e.cast(x, _FLOAT)), np.float32


def _tree_ensemble(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    if int(a.get("post_transform", 0)) != 0:
        raise _refuse(node, f"post_transform={a['post_transform']} not converted (NONE is)")
    how = {0: "AVERAGE", 1: "SUM", 2: "MIN", 3: "MAX"}.get(int(a.get("aggregate_function", 1)))
    if how is None:
        raise _refuse(node, f"aggregate_function={a['aggregate_function']} is none of 0-3")
    t = info.types.get(node.input[0], _FLOAT)
    if t not in (_FLOAT, _DOUBLE, _FLOAT16):
        raise _refuse(node, f"input element type {t} (TreeEnsemble takes float, double, float16)")
    x, npt = _tree_input(e, node, info, t == _DOUBLE, list(a.get("nodes_featureids", [])))
    scores = _forest_scores(e, node, _new_forest(node, a), x, npt, how, "or")
    e.cast(scores, t, node.output[0])


def _tree_regressor(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    if a.get("post_transform", "NONE") != "NONE":
        raise _refuse(node, f"post_transform={a['post_transform']!r} not converted (NONE is)")
    how = a.get("aggregate_function", "SUM")
    n_targets = int(a.get("n_targets", 1))
    double = "nodes_values_as_tensor" in a or "target_weights_as_tensor" in a
    x, npt = _tree_input(e, node, info, double, list(a.get("nodes_featureids", [])))
    scores = _forest_scores(e, node, _old_forest(node, a, "target", n_targets, how), x, npt, how, "track",
                            _floats(a, "base_values"))
    e.cast(scores, _FLOAT, node.output[0])


def _tree_classifier(e: _Emit, node: Any, a: dict[str, Any], info: _Info) -> None:
    labels = a.get("classlabels_int64s")
    if labels is None:
        raise _refuse(node, "class labels are strings (string tensors are not supported)")
    n_classes = len(labels)
    ids = set(a.get("class_ids", []))
    double = "nodes_values_as_tensor" in a or "class_weights_as_tensor" in a
    x, npt = _tree_input(e, node, info, double, list(a.get("nodes_featureids", [])))
    if len(ids) <= 1 or n_classes == 2:
        # onnxruntime's two-class labels do not follow the argmax of its scores (measured: 184 of 397
        # digits samples), and its one-class-weights form has its own score rules: refused, not guessed
        raise _refuse(node, "two-class (binary) tree classifiers are not converted")
    forest = _old_forest(node, a, "class", n_classes, "SUM")
    if not forest.hit[forest.leaf].all():
        raise _refuse(node, "a leaf gives no weight to some class (only leaves weighting every class are "
                            "converted)")
    scores = _forest_scores(e, node, forest, x, npt, "SUM", "track", _floats(a, "base_values"))
    scores = e.cast(_post_transform(e, node, scores, a.get("post_transform", "NONE")), _FLOAT)
    _labels(e, node, a, scores, node.output[0])
    if len(node.output) > 1 and node.output[1]:
        e.op("Identity", [scores], node.output[1])


_CONVERTERS: dict[str, Callable[[_Emit, Any, dict[str, Any], _Info], None]] = {
    "Binarizer": _binarizer,
    "Scaler": _scaler,
    "Normalizer": _normalizer,
    "Imputer": _imputer,
    "FeatureVectorizer": _feature_vectorizer,
    "ArrayFeatureExtractor": _array_feature_extractor,
    "LabelEncoder": _label_encoder,
    "OneHotEncoder": _one_hot_encoder,
    "LinearRegressor": _linear_regressor,
    "LinearClassifier": _linear_classifier,
    "TreeEnsemble": _tree_ensemble,
    "TreeEnsembleRegressor": _tree_regressor,
    "TreeEnsembleClassifier": _tree_classifier,
}
CONVERTED_ML_OPS = frozenset(_CONVERTERS)


def lower_ml(model: Any) -> bool:
    """Replace every ai.onnx.ml node by standard ONNX nodes (ModelError naming the operator when one
    cannot be); the model gets a default-domain opset when it had none."""
    from onnx import helper

    g = model.graph
    if not any(n.domain == ML_DOMAIN for n in g.node):
        return False
    default = next((o for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if default is None:
        model.opset_import.append(helper.make_opsetid("", _NEW_OPSET))
        opset = _NEW_OPSET
    else:
        opset = default.version
    old_nodes = list(g.node)
    new_nodes: list[Any] = []
    for k, node in enumerate(old_nodes):
        if node.domain != ML_DOMAIN:
            new_nodes.append(node)
            continue
        # types and shapes again with the nodes lowered so far (inference knows little of ai.onnx.ml)
        del g.node[:]
        g.node.extend(new_nodes + old_nodes[k:])
        info = _Info(model)
        check_ml_node(node, info.types)
        if opset < _MIN_OPSET:
            raise _refuse(node, f"the model's default-domain opset is {opset}; the conversion needs "
                                f"{_MIN_OPSET} or newer (re-export with a newer target opset)")
        e = _Emit(f"ml{k}_{node.op_type}", opset)
        _CONVERTERS[node.op_type](e, node, _attrs(node), info)
        new_nodes.extend(e.nodes)
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]
    keep = [o for o in model.opset_import if o.domain != ML_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return True
