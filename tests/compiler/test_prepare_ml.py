"""compiler.prepare_ml: the ai.onnx.ml operators lowered to standard ONNX, checked against onnxruntime.

Each conversion is checked twice over: the lowered graph (standard ops only) and the original
(onnxruntime's own ai.onnx.ml kernels) run in onnxruntime on the same data, NaN included where the
operator defines it; then a real sensor-style pipeline (StandardScaler + RandomForest trained with
scikit-learn, written as Scaler + TreeEnsembleClassifier by hand: skl2onnx is not a dependency)
goes through `fractal compile --target native` and matches onnxruntime on held-out data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh

from compiler.errors import ModelError
from compiler.prepare_ml import CONVERTED_ML_OPS, lower_ml

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], ml: int = 3,
           default: int | None = 17) -> onnx.ModelProto:
    ops = [oh.make_opsetid("ai.onnx.ml", ml)] + ([oh.make_opsetid("", default)] if default else [])
    m = oh.make_model(oh.make_graph(nodes, "g", inputs, outputs), opset_imports=ops)
    m.ir_version = 8
    return m


def _run(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[Any]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))


def _same_as_ort(m: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 1e-5) -> onnx.ModelProto:
    lowered = onnx.ModelProto()
    lowered.CopyFrom(m)
    assert lower_ml(lowered) is True
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    onnx.checker.check_model(lowered, full_check=True)
    want, got = _run(m, feeds), _run(lowered, feeds)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6)
    return lowered


def _vi(name: str, t: int, shape: list[Any]) -> Any:
    return oh.make_tensor_value_info(name, t, shape)


RNG = np.random.default_rng(0)
X = RNG.standard_normal((6, 4)).astype(np.float32)
XNAN = X.copy()
XNAN[1, 2] = XNAN[4, 0] = np.nan


def _ml(op: str, inputs: list[str], outputs: list[str], **attrs: Any) -> Any:
    return oh.make_node(op, inputs, outputs, domain="ai.onnx.ml", **attrs)


CASES: dict[str, Callable[[], tuple[onnx.ModelProto, dict[str, np.ndarray]]]] = {
    "binarizer": lambda: (_model([_ml("Binarizer", ["x"], ["y"], threshold=0.3)],
                                 [_vi("x", F, ["N", 4])], [_vi("y", F, ["N", 4])]), {"x": X}),
    "scaler": lambda: (_model([_ml("Scaler", ["x"], ["y"], offset=[0.1, -0.2, 0.3, 0.0],
                                   scale=[2.0, 0.5, 1.5, -1.0])],
                              [_vi("x", F, ["N", 4])], [_vi("y", F, ["N", 4])]), {"x": X}),
    "scaler_int_scalar": lambda: (_model([_ml("Scaler", ["x"], ["y"], offset=[1.5], scale=[0.25])],
                                         [_vi("x", I64, ["N", 3])], [_vi("y", F, ["N", 3])]),
                                  {"x": RNG.integers(-9, 9, (5, 3))}),
    **{f"normalizer_{n}": (lambda n=n: (_model([_ml("Normalizer", ["x"], ["y"], norm=n)],
                                               [_vi("x", F, ["N", 4])], [_vi("y", F, ["N", 4])]), {"x": X}))
       for n in ("MAX", "L1", "L2")},
    "imputer_nan": lambda: (_model([_ml("Imputer", ["x"], ["y"], imputed_value_floats=[1.0, 2.0, 3.0, 4.0],
                                        replaced_value_float=float("nan"))],
                                   [_vi("x", F, ["N", 4])], [_vi("y", F, ["N", 4])]), {"x": XNAN}),
    "imputer_int": lambda: (_model([_ml("Imputer", ["x"], ["y"], imputed_value_int64s=[7],
                                        replaced_value_int64=0)],
                                   [_vi("x", I64, ["N", 3])], [_vi("y", I64, ["N", 3])]),
                            {"x": RNG.integers(-2, 3, (6, 3))}),
    "feature_vectorizer": lambda: (_model([_ml("FeatureVectorizer", ["a", "b", "c"], ["y"],
                                               inputdimensions=[2, 3, 1])],
                                          [_vi("a", F, [5, 3]), _vi("b", F, [5, 2]), _vi("c", F, [5, 1])],
                                          [_vi("y", F, [5, 6])]),
                                   {"a": X[:5, :3], "b": X[:5, 2:], "c": X[:5, :1]}),
    "array_feature_extractor": lambda: (_model([_ml("ArrayFeatureExtractor", ["x", "i"], ["y"])],
                                               [_vi("x", F, [6, 4]), _vi("i", I64, [3])],
                                               [_vi("y", F, [6, 3])]), {"x": X, "i": np.array([3, 0, 3])}),
    "label_encoder_int_float": lambda: (_model([_ml("LabelEncoder", ["x"], ["y"], keys_int64s=[3, 1, 7],
                                                    values_floats=[0.5, -1.0, 2.5], default_float=9.0)],
                                               [_vi("x", I64, ["N"])], [_vi("y", F, ["N"])], ml=2),
                                        {"x": np.array([1, 2, 3, 7, 7, 0])}),
    "label_encoder_float_int": lambda: (_model([_ml("LabelEncoder", ["x"], ["y"], keys_floats=[0.5, 1.5],
                                                    values_int64s=[10, 20])],
                                               [_vi("x", F, ["N", 2])], [_vi("y", I64, ["N", 2])],
                                               ml=2),
                                        {"x": np.array([[0.5, 1.5], [2.0, 0.5]], np.float32)}),
    "one_hot_encoder": lambda: (_model([_ml("OneHotEncoder", ["x"], ["y"], cats_int64s=[4, 1, 9], zeros=1)],
                                       [_vi("x", I64, ["N", 2])], [_vi("y", F, ["N", 2, 3])]),
                                {"x": np.array([[1, 9], [4, 5], [0, 1]])}),
    "linear_regressor": lambda: (_model([_ml("LinearRegressor", ["x"], ["y"],
                                             coefficients=list(RNG.standard_normal(8)),
                                             intercepts=[0.5, -1.0], targets=2)],
                                        [_vi("x", F, ["N", 4])], [_vi("y", F, ["N", 2])]), {"x": X}),
    **{f"linear_classifier_{pt.lower()}": (lambda pt=pt: (_model(
        [_ml("LinearClassifier", ["x"], ["label", "scores"], coefficients=list(RNG.standard_normal(12)),
             intercepts=[0.1, 0.2, -0.3], classlabels_ints=[5, 6, 7], post_transform=pt)],
        [_vi("x", F, ["N", 4])], [_vi("label", I64, ["N"]), _vi("scores", F, ["N", 3])]), {"x": X}))
       for pt in ("NONE", "SOFTMAX", "LOGISTIC")},
    "linear_classifier_two_rows": lambda: (_model(
        [_ml("LinearClassifier", ["x"], ["label", "scores"], coefficients=list(RNG.standard_normal(8)),
             intercepts=[0.1, -0.2], classlabels_ints=[3, 8], post_transform="NONE")],
        [_vi("x", F, ["N", 4])], [_vi("label", I64, ["N"]), _vi("scores", F, ["N", 2])]), {"x": X}),
    "linear_classifier_binary": lambda: (_model(
        [_ml("LinearClassifier", ["x"], ["label", "scores"], coefficients=list(RNG.standard_normal(4)),
             intercepts=[0.1], classlabels_ints=[0, 1], post_transform="LOGISTIC")],
        [_vi("x", F, ["N", 4])], [_vi("label", I64, ["N"]), _vi("scores", F, ["N", 2])]), {"x": X}),
}


def _tree_regressor(aggregate: str, nan_track: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Two trees over 4 features, mixed comparison modes, two targets."""
    nodes = dict(
        nodes_treeids=[0, 0, 0, 0, 0, 1, 1, 1],
        nodes_nodeids=[0, 1, 2, 3, 4, 0, 1, 2],
        nodes_featureids=[0, 2, 0, 0, 0, 3, 0, 0],
        nodes_modes=["BRANCH_LEQ", "BRANCH_GT", "LEAF", "LEAF", "LEAF", "BRANCH_LT", "LEAF", "LEAF"],
        nodes_values=[0.1, -0.3, 0, 0, 0, 0.5, 0, 0],
        nodes_truenodeids=[1, 2, 0, 0, 0, 1, 0, 0],
        nodes_falsenodeids=[4, 3, 0, 0, 0, 2, 0, 0],
        nodes_missing_value_tracks_true=[1, 0, 0, 0, 0, 1, 0, 0] if nan_track else [0] * 8,
        target_treeids=[0, 0, 0, 0, 1, 1], target_nodeids=[2, 3, 4, 4, 1, 2], target_ids=[0, 0, 1, 0, 1, 0],
        target_weights=[1.0, 2.0, 3.0, -1.0, 4.0, 5.0], n_targets=2, aggregate_function=aggregate,
        base_values=[0.5, -0.5] if aggregate in ("SUM", "AVERAGE") else [])
    if not nodes["base_values"]:
        del nodes["base_values"]
    m = _model([_ml("TreeEnsembleRegressor", ["x"], ["y"], **nodes)], [_vi("x", F, ["N", 4])],
               [_vi("y", F, ["N", 2])])
    return m, {"x": XNAN if nan_track else X}


for _agg in ("SUM", "AVERAGE", "MIN", "MAX"):
    CASES[f"tree_regressor_{_agg.lower()}"] = lambda a=_agg: _tree_regressor(a, False)
CASES["tree_regressor_nan_tracks_true"] = lambda: _tree_regressor("SUM", True)


def _tree_v5() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """ai.onnx.ml 5 TreeEnsemble with a set-membership node and NaN inputs."""
    from onnx import numpy_helper as nh

    node = _ml("TreeEnsemble", ["x"], ["y"], aggregate_function=1, n_targets=2, tree_roots=[0, 2],
               nodes_featureids=[0, 1, 1], nodes_modes=nh.from_array(np.array([6, 0, 3], np.uint8)),
               nodes_splits=nh.from_array(np.array([0.0, 0.2, -0.1], np.float32)),
               membership_values=nh.from_array(np.array([1.0, 2.0, np.nan], np.float32)),
               nodes_truenodeids=[0, 0, 3], nodes_trueleafs=[1, 1, 1], nodes_falsenodeids=[1, 1, 2],
               nodes_falseleafs=[0, 1, 1], nodes_missing_value_tracks_true=[0, 1, 0],
               leaf_targetids=[0, 1, 0, 1],
               leaf_weights=nh.from_array(np.array([1, 10, 100, 1000], np.float32)))
    x = np.array([[1, 0], [2, 5], [3, -1], [np.nan, np.nan], [0, 0.3], [2, np.nan]], np.float32)
    return _model([node], [_vi("x", F, ["N", 2])], [_vi("y", F, ["N", 2])], ml=5, default=None), {"x": x}


CASES["tree_ensemble_v5_membership"] = _tree_v5


@pytest.mark.parametrize("case", sorted(CASES))
def test_lowered_graph_matches_onnxruntime(case: str) -> None:
    model, feeds = CASES[case]()
    _same_as_ort(model, feeds)


def test_every_converted_operator_is_exercised() -> None:
    used = {n.op_type for c in CASES.values() for n in c()[0].graph.node}
    assert CONVERTED_ML_OPS - {"TreeEnsembleClassifier"} <= used  # the classifier: the sklearn test below


@pytest.mark.parametrize(("node", "inputs", "says"), [
    (_ml("LinearClassifier", ["x"], ["y"], classlabels_strings=["a", "b"], coefficients=[1.0, 2.0, 3.0, 4.0]),
     [_vi("x", F, ["N", 2])], "LinearClassifier at node 'y': string classlabels_strings"),
    (_ml("ZipMap", ["x"], ["y"], classlabels_int64s=[0, 1]), [_vi("x", F, ["N", 2])],
     "ZipMap at node 'y': its output is a sequence of maps"),
    (_ml("SVMRegressor", ["x"], ["y"]), [_vi("x", F, ["N", 2])], "SVMRegressor at node 'y': not converted"),
    (_ml("OneHotEncoder", ["x"], ["y"], cats_int64s=[1, 2], zeros=0), [_vi("x", I64, ["N"])],
     "OneHotEncoder at node 'y': zeros=0"),
])
def test_refused_by_name_at_compile(tmp_path: Path, run_cli: Any, node: Any, inputs: list[Any],
                                    says: str) -> None:
    """What the compiled float/integer code cannot do is refused in one line naming the operator."""
    m = _model([node], inputs, [oh.make_tensor_value_info("y", F, None)])
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    res = run_cli("compile", path, "--target", "x86_64", "--out", tmp_path / "art")
    assert res.code != 0 and "Traceback" not in res.err
    assert says in res.error_line, res.error_line


def test_array_feature_extractor_indices_stay_in_the_row() -> None:
    """Negative indices count from the end (ONNX); out-of-range ones are clamped, never read outside."""
    m, _ = CASES["array_feature_extractor"]()
    assert lower_ml(m)
    got = _run(m, {"x": X, "i": np.array([-1, 9, 0])})[0]
    np.testing.assert_array_equal(got, X[:, [3, 3, 0]])


def test_tree_feature_out_of_range_refused() -> None:
    m, _ = _tree_regressor("SUM", False)
    next(a for a in m.graph.node[0].attribute if a.name == "nodes_featureids").ints[0] = 4
    with pytest.raises(ModelError, match="tests feature 4, but 'x' has 4 features"):
        lower_ml(m)


def test_one_score_binary_linear_refused() -> None:
    """onnxruntime answers [1 - s, s] for NONE and SOFTMAX alike: only LOGISTIC is converted."""
    m = _model([_ml("LinearClassifier", ["x"], ["y"], coefficients=[1.0, 2.0], intercepts=[0.5],
                    classlabels_ints=[0, 1])], [_vi("x", F, ["N", 2])], [_vi("y", I64, ["N"])])
    with pytest.raises(ModelError, match="LinearClassifier at node 'y': a one-score binary classifier"):
        lower_ml(m)


def test_binary_forest_refused() -> None:
    """onnxruntime's two-class TreeEnsembleClassifier labels are not the argmax of its scores."""
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.preprocessing import StandardScaler

    x = RNG.standard_normal((60, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(int)
    forest = RandomForestClassifier(n_estimators=2, max_depth=2).fit(x, y)
    m = _forest_model(StandardScaler().fit(x), forest, 3)
    with pytest.raises(ModelError, match="TreeEnsembleClassifier.*two-class"):
        lower_ml(m)


def test_old_default_opset_refused() -> None:
    m, _ = CASES["binarizer"]()
    m.opset_import[1].version = 11
    with pytest.raises(ModelError, match="Binarizer.*opset is 11"):
        lower_ml(m)


# ------------------------------------------------------------------ a scikit-learn sensor pipeline
def _forest_model(scaler: Any, forest: Any, n_features: int) -> onnx.ModelProto:
    """StandardScaler + RandomForestClassifier as Scaler + TreeEnsembleClassifier (what skl2onnx
    writes, built here by hand from the fitted trees)."""
    a: dict[str, list[Any]] = {k: [] for k in (
        "nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_modes", "nodes_values",
        "nodes_truenodeids", "nodes_falsenodeids", "class_treeids", "class_nodeids", "class_ids",
        "class_weights")}
    n_trees = len(forest.estimators_)
    for t, est in enumerate(forest.estimators_):
        tree = est.tree_
        for i in range(tree.node_count):
            leaf = tree.children_left[i] < 0
            a["nodes_treeids"].append(t)
            a["nodes_nodeids"].append(i)
            a["nodes_featureids"].append(0 if leaf else int(tree.feature[i]))
            a["nodes_modes"].append("LEAF" if leaf else "BRANCH_LEQ")
            a["nodes_values"].append(0.0 if leaf else float(tree.threshold[i]))
            a["nodes_truenodeids"].append(0 if leaf else int(tree.children_left[i]))
            a["nodes_falsenodeids"].append(0 if leaf else int(tree.children_right[i]))
            if leaf:
                p = tree.value[i, 0] / tree.value[i, 0].sum()
                for c, w in enumerate(p):
                    a["class_treeids"].append(t)
                    a["class_nodeids"].append(i)
                    a["class_ids"].append(c)
                    a["class_weights"].append(float(w) / n_trees)
    nodes = [_ml("Scaler", ["x"], ["scaled"], offset=[float(v) for v in scaler.mean_],
                 scale=[float(1 / v) for v in scaler.scale_]),
             _ml("TreeEnsembleClassifier", ["scaled"], ["label", "probabilities"],
                 classlabels_int64s=[int(c) for c in forest.classes_], post_transform="NONE", **a)]
    return _model(nodes, [_vi("x", F, ["N", n_features])],
                  [_vi("label", I64, ["N"]),
                   _vi("probabilities", F, ["N", len(forest.classes_)])],
                  ml=1, default=15)


@pytest.mark.slow
def test_sklearn_forest_pipeline_compiles_native_and_matches(tmp_path: Path, run_cli: Any) -> None:
    """A scikit-learn StandardScaler + RandomForest on the digits data (64 sensor-like features,
    10 classes): `fractal compile --target native` picks this machine's preset, says so, records it,
    and the artifact matches onnxruntime (and scikit-learn's labels) on held-out samples."""
    from sklearn.datasets import load_digits
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.preprocessing import StandardScaler

    from compiler.artifact import load_artifact
    from compiler.targets import native_preset

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32)
    train, held = slice(0, 1400), slice(1400, None)
    scaler = StandardScaler().fit(x[train])
    forest = RandomForestClassifier(n_estimators=12, max_depth=8, random_state=0).fit(
        scaler.transform(x[train]), y[train])
    path = tmp_path / "digits_forest.onnx"
    path.write_bytes(_forest_model(scaler, forest, x.shape[1]).SerializeToString())
    res = run_cli("compile", path, "--target", "native", "--out", tmp_path / "art", "--shape", "x=1,64")
    assert res.code == 0, res.err
    want_preset, why = native_preset()
    assert f"--target native: {want_preset} ({why})" in res.err
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert want_preset in json.dumps(manifest) and "native" not in json.dumps(manifest.get("target", ""))
    art = load_artifact(tmp_path / "art")
    sess = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
    labels, probs = [], []
    for row in x[held]:
        got = art.infer({"x": row[None]})
        labels.append(int(got["label"][0]))
        probs.append(got["probabilities"][0])
    want_labels, want_probs = sess.run(None, {"x": x[held]})
    np.testing.assert_allclose(np.array(probs), want_probs, rtol=1e-4, atol=1e-5)
    assert labels == want_labels.tolist()
    assert (np.array(labels) == y[held]).mean() > 0.85  # a real model, not a constant


@pytest.mark.slow
def test_every_lowering_compiles_and_matches(tmp_path: Path) -> None:
    """The lowered operators through TVM (compile_model + inference), not only onnxruntime: one model
    with a branch per operator, each output against onnxruntime's own ai.onnx.ml kernels."""
    from compiler.artifact import load_artifact
    from compiler.build import compile_model

    tree, _ = _tree_regressor("MIN", False)
    tree_node = tree.graph.node[0]
    tree_node.output[0] = "tree_min"
    nodes = [
        _ml("Scaler", ["x"], ["scaled"], offset=[0.1, -0.2, 0.3, 0.0], scale=[2.0, 0.5, 1.5, -1.0]),
        _ml("Normalizer", ["scaled"], ["l2"], norm="L2"),
        _ml("Binarizer", ["x"], ["bin"], threshold=0.3),
        _ml("FeatureVectorizer", ["x", "scaled"], ["fv"], inputdimensions=[3, 6]),
        _ml("LinearRegressor", ["x"], ["reg"], coefficients=[float(v) for v in RNG.standard_normal(8)],
            intercepts=[0.5, -1.0], targets=2),
        _ml("LinearClassifier", ["x"], ["lab", "probs"],
            coefficients=[float(v) for v in RNG.standard_normal(12)], intercepts=[0.1, 0.2, -0.3],
            classlabels_ints=[5, 6, 7], post_transform="SOFTMAX"),
        tree_node,
        _ml("LabelEncoder", ["k"], ["enc"], keys_int64s=[3, 1, 7], values_floats=[0.5, -1.0, 2.5],
            default_float=9.0),
        _ml("OneHotEncoder", ["k"], ["onehot"], cats_int64s=[4, 1, 9], zeros=1),
        _ml("Imputer", ["k"], ["imp"], imputed_value_int64s=[7], replaced_value_int64=0),
    ]
    outs = [_vi("l2", F, [6, 4]), _vi("bin", F, [6, 4]), _vi("fv", F, [6, 9]), _vi("reg", F, [6, 2]),
            _vi("lab", I64, [6]), _vi("probs", F, [6, 3]), _vi("tree_min", F, [6, 2]), _vi("enc", F, [6, 1]),
            _vi("onehot", F, [6, 1, 3]), _vi("imp", I64, [6, 1])]
    m = _model(nodes, [_vi("x", F, [6, 4]), _vi("k", I64, [6, 1])], outs, ml=2)
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    feeds = {"x": X, "k": np.array([[1], [2], [3], [7], [0], [9]], np.int64)}
    compile_model(path, target="x86_64", out_dir=tmp_path / "art", progress=False)
    got = load_artifact(tmp_path / "art").infer(feeds)
    want = dict(zip([o.name for o in outs], _run(m, feeds), strict=True))
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=name)


def test_inspect_counts_lowered_operators_as_rewritten(tmp_path: Path) -> None:
    """`fractal inspect` lists converted ai.onnx.ml operators as rewritten and the others as unsupported."""
    from compiler.inspect import inspect_model

    m, _ = CASES["scaler"]()
    m.graph.node.append(_ml("SVMRegressor", ["y"], ["z"]))
    m.graph.output.append(_vi("z", F, ["N", 1]))
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    report = inspect_model(path)
    assert report.decomposed == {"ai.onnx.ml::Scaler": 1}
    assert report.unsupported == {"ai.onnx.ml::SVMRegressor": 1}
