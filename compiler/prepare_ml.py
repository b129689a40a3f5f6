"""The ``ai.onnx.ml`` operators sensor pipelines use, lowered to standard ONNX before TVM import.

TVM's Relax ONNX frontend converts no operator of the classical-ML domain. ``lower_ml`` (a step of
``compiler.prepare``) rewrites each one into default-domain operators the frontend handles, or
``check_ml_node`` refuses it by name with the reason, before any work is done:

* Binarizer, Scaler, Normalizer, Imputer, FeatureVectorizer, ArrayFeatureExtractor: elementwise
  arithmetic, reductions, Gather / Concat.
* LabelEncoder (numeric keys and values), OneHotEncoder (integer categories): Equal against the
  key vector, ArgMax of the match, Gather of the value, Where for the default.
* LinearRegressor, LinearClassifier: MatMul + Add, post transform, ArgMax + Gather for labels.
* TreeEnsemble (ai.onnx.ml 5), TreeEnsembleRegressor, TreeEnsembleClassifier
  (compiler/prepare_ml_trees.py): tree traversal as tensors. Every node of every tree is one row
  of constant tables (feature, threshold, comparison, true / false successor; a leaf is its own
  successor); ``depth`` rounds of Gather -> compare ->
  Where move all trees of all samples one level down at once, then a Gather of the leaf values
  and a reduction over the trees aggregate. Memory is linear in the number of nodes.

String keys and values (LabelEncoder, CategoryMapper) never get here: they run on the host
(compiler/hoststage.py, cut out by compiler/hostsplit.py). Refused: string class labels (the
compiled CPU path carries floats and integers only), ZipMap (its output is a sequence of maps), and
the operators not converted (SVM*, DictVectorizer, ...), each with one line naming the operator.
The emitter, type information and shared helpers are in compiler/prepare_ml_base.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from compiler.prepare_ml_base import (
    _DOUBLE,
    _FLOAT,
    _STRING,
    _attrs,
    _Emit,
    _floats,
    _Info,
    _labels,
    _np_float,
    _post_transform,
    _refuse,
)
from compiler.prepare_ml_trees import _tree_classifier, _tree_ensemble, _tree_regressor

__all__ = ["ML_DOMAIN", "CONVERTED_ML_OPS", "check_ml_node", "lower_ml"]

ML_DOMAIN = "ai.onnx.ml"
_NEW_OPSET = 17  # the default-domain opset given to a model that has only ai.onnx.ml nodes
_MIN_OPSET = 13  # the emitted nodes use opset-13 signatures (and the Reduce* change of 18)

_REFUSED = {
    "ZipMap": "its output is a sequence of maps, which compiled code cannot return; export the "
              "classifier without ZipMap (skl2onnx: options={'zipmap': False})",
    "DictVectorizer": "its input is a map, which compiled code cannot take",
    "CastMap": "its input is a map, which compiled code cannot take",
    "SVMClassifier": "not converted (support vector machines); export a linear or tree model",
    "SVMRegressor": "not converted (support vector machines); export a linear or tree model",
}

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
