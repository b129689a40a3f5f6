"""Tree ensembles (TreeEnsemble of ai.onnx.ml 5, TreeEnsembleRegressor, TreeEnsembleClassifier)
lowered to standard ONNX: tree traversal as tensors (see compiler/prepare_ml.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.prepare_ml_base import (
    _DOUBLE,
    _FLOAT,
    _FLOAT16,
    _Emit,
    _floats,
    _Info,
    _labels,
    _post_transform,
    _refuse,
)

# TreeEnsemble comparison modes (ai.onnx.ml 5 numbering; the older operators' strings map to them)
_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_OLD_MODES = {"BRANCH_LEQ": _LEQ, "BRANCH_LT": _LT, "BRANCH_GTE": _GTE, "BRANCH_GT": _GT,
              "BRANCH_EQ": _EQ, "BRANCH_NEQ": _NEQ}


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
