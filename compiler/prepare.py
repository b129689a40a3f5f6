"""ONNX preparation before TVM import: rewrite what real exported models contain into what TVM takes.

Each step is a function ``step(model, ...) -> bool`` that edits the ModelProto in place and says
whether it changed the graph; ``prepare`` runs them in order and returns the names of the steps
that changed something (``fractal compile`` prints them).

1. ``normalize_ir``   -- IR < 4 lists initializers among graph inputs; drop them and raise ir_version.
1b. ``lower_training`` / ``unroll_scan8`` -- ai.onnx.preview.training's optimizers as standard ops
                         (compiler/lower_training.py); opset 8's batched Scan unrolled (compiler/unroll.py),
                         both before the upgrade.
2. ``upgrade_opset``  -- opsets older than ``MIN_OPSET`` go through onnx.version_converter.
3. ``apply_shapes``   -- the user's ``--shape NAME=D0,D1,..`` and the batch fix the input dimensions.
3b. ``qoperator_to_qdq`` -- QOperator-format quantized operators (QLinearConv, QLinearMatMul,
                         ConvInteger, onnxruntime's QGemm / QLinearAdd / ...) become their QDQ form,
                         DequantizeLinear -> op -> QuantizeLinear (compiler/qoperator.py).
4. ``fold_constants`` -- Shape of a static tensor, and every node whose inputs are all constants,
                         become constants (Shape -> Gather -> Concat -> Reshape chains collapse);
                         a QDQ weight's DequantizeLinear stays (compiler.integer needs its int8 values).
4b. ``expand_functions`` -- operators TVM lacks that ONNX defines as functions (Attention, Celu,
                         CenterCropPad, SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss,
                         RotaryEmbedding, CausalConvWithState, Swish; LayerNormalization asked for
                         Mean/InvStdDev, RMSNormalization over every axis) become their ONNX function
                         bodies (compiler/expand.py).
4c. ``unroll_loops`` -- Loop and Scan with a trip count / sequence length known at compile time are
                         unrolled (up to 256 iterations), an If on a constant condition becomes
                         the branch taken (compiler/unroll.py; opset 8's Scan before step 2).
4d. ``lower_sequences`` -- sequences inside the graph whose length is known at compile time become
                         lists of tensors: SplitToSequence -> Split, ConcatFromSequence -> Concat,
                         SequenceAt -> the element, SequenceMap -> its body once per element
                         (compiler/sequences.py).
5. ``decompose_rnn``  -- LSTM / GRU / RNN (missing in TVM's Relax frontend) unrolled over the fixed
                         sequence length into MatMul / Add / Mul / activations.
5b. ``decompose_ops`` -- CumProd (unrolled along its axis, every axis when it comes at run time),
                         Det (Leibniz expansion, up to 5x5) and LpNormalization become Slice / Mul /
                         Gather / Reduce / Div.
5c. ``lower_ops``     -- ScatterElements -> ScatterND, EyeLike with a dtype -> a constant, ReverseSequence
                         -> GatherElements, SpaceToDepth CRD, ConvTranspose's output_shape -> pads,
                         BatchNormalization in training mode, DFT, STFT, TensorScatter
                         (compiler/lower_ops.py); MaxPool's Indices, MaxUnpool, Col2Im, DeformConv
                         (compiler/lower_window.py); integer Pow, TfIdfVectorizer (compiler/lower_misc.py).
5d. ``cast_pow_exponent`` -- Pow of a float base by an integer exponent: the exponent is cast.
6. ``guard_bitshift`` -- BitShift by an amount that may be >= the bit width or negative gets ONNX's
                         result (0 or the sign) instead of LLVM's undefined shift.
6a. ``fold_empty``   -- what nodes compute from an empty data input (``--shape x=2,0,4``) becomes a
                         constant, or a run-time-axes Reduce's identity; other reads refused by name
                         (compiler/empty.py).
6b. ``lower_ieee``   -- IsInf with one sign only, float Mod by an infinite divisor: ONNX's IEEE
                         results (compiler/lower_ieee.py).
7. ``promote_float16`` -- a float16 model computes in float32 (inputs cast up, outputs cast back).
8. ``fix_reduce_extremes`` -- float ReduceMax/ReduceMin of a slice of only -inf/+inf gives the
                         infinity, not TVM's finite initial value (fully masked attention rows).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from compiler.empty import fold_empty
from compiler.errors import ModelError
from compiler.expand import EXPANDED_OPS, expand_functions
from compiler.graphbuild import (
    Builder,
    _const_inputs,
    _drop_unused_initializers,
    _elem_types,
    _opset,
    _replace_nodes,
    _static_shapes,
    dtype_only_inputs,
    fold_constants,
)
from compiler.lower_ieee import lower_ieee
from compiler.lower_ops import LOWERED_OPS, lower_ops
from compiler.lower_training import lower_training
from compiler.prepare_ml import lower_ml
from compiler.qoperator import qoperator_to_qdq
from compiler.sequences import lower_sequences
from compiler.unroll import LOOP_OPS, unroll_loops

__all__ = ["prepare", "normalize_ir", "upgrade_opset", "apply_shapes", "fold_constants", "expand_functions",
           "decompose_rnn", "decompose_ops", "cast_pow_exponent",
           "guard_bitshift", "fix_reduce_extremes", "promote_float16",
           "parse_shape", "DECOMPOSED_OPS", "MIN_OPSET"]

MIN_OPSET = 13  # below this, try onnx.version_converter (TVM's converters are best tested from here)
FLOOR_OPSET = 7  # below this, the upgrade must succeed
# ops the preparation rewrites into others (so the importer's op check lets them through)
_RNN_OPS = frozenset({"LSTM", "GRU", "RNN"})
_LOWERED_OPS = frozenset({"CumProd", "Det", "LpNormalization"})
_FLOAT_TYPES = frozenset({1, 11})  # float, double (float16 Pow is left to TVM and promote_float16)
DECOMPOSED_OPS = _RNN_OPS | _LOWERED_OPS | EXPANDED_OPS | LOOP_OPS | LOWERED_OPS | frozenset({"SequenceMap"})


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``NAME=D0,D1,...`` -> (name, dims); a dim of ``?``, ``N`` or ``-1`` stays dynamic (-1)."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name or not dims:
        raise ModelError(f"bad --shape {text!r}", hint="use NAME=D0,D1,... e.g. --shape input=1,3,224,224")
    out = []
    for d in dims.split(","):
        d = d.strip()
        if d in ("?", "N", "-1"):
            out.append(-1)
            continue
        try:
            v = int(d)
        except ValueError:
            v = -1
        if v < 0 or v > 1 << 24:  # 0: an empty input (compiler/empty.py)
            raise ModelError(f"bad dimension {d!r} in --shape {text!r}",
                             hint="dimensions are integers >= 0 (or ? for a dynamic batch)")
        out.append(v)
    return name, out


# ---------------------------------------------------------------------------------------------- 1
def normalize_ir(model: Any) -> bool:
    """Drop initializers from the graph inputs (IR < 4 style) and raise ir_version to a valid one."""
    import onnx

    g = model.graph
    inits = {t.name for t in g.initializer}
    keep = [i for i in g.input if i.name not in inits]
    changed = len(keep) != len(g.input)
    if changed:
        del g.input[:]
        g.input.extend(keep)
    want = max(4, model.ir_version)
    try:
        want = max(want, onnx.helper.find_min_ir_version_for(list(model.opset_import)))
    except Exception:  # an opset newer than this onnx knows: leave the version alone
        pass
    want = min(want, 10) if model.ir_version <= 10 else model.ir_version
    if want != model.ir_version:
        model.ir_version = want
        changed = True
    return changed


# ---------------------------------------------------------------------------------------------- 2
def upgrade_opset(model: Any, minimum: int = MIN_OPSET) -> bool:
    """Convert a model whose default-domain opset is below ``minimum`` (13: TVM's Relax frontend is
    best at the modern op signatures) with onnx.version_converter. When the converter cannot, an
    opset of at least ``FLOOR_OPSET`` is kept as it is; older ones are refused."""
    import onnx
    from onnx import version_converter

    have = _opset(model)
    if have >= minimum:
        return False
    err: Exception | None = None
    for want in (minimum, FLOOR_OPSET):
        if want <= have:
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                new = version_converter.convert_version(model, want)
            onnx.checker.check_model(new)
        except Exception as exc:
            err = exc
            continue
        old_resize = _old_resize_outputs(model, have)
        model.CopyFrom(new)
        _keep_old_resize(model, old_resize)
        # (domains onnx does not know, such as onnxruntime's com.microsoft.nchwc, ask nothing)
        need = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
        model.ir_version = max(model.ir_version, need)
        return True
    raise ModelError(f"opset {have} is too old and could not be upgraded to {FLOOR_OPSET}: "
                     f"{' '.join(str(err).split())[:200]}", hint="re-export the model with a recent opset")


def _old_resize_outputs(model: Any, opset: int) -> set[str]:
    """The outputs of Upsample nodes, and of Resize nodes before opset 11: their coordinates are
    ``asymmetric`` and their nearest rounding floor (ceil when downsampling), which the version
    converter's Resize-11 does not keep (it gets Resize-11's defaults, half_pixel: another answer)."""
    if opset >= 11:
        return set()
    return {n.output[0] for n in model.graph.node if n.op_type in ("Upsample", "Resize") and n.output}


def _keep_old_resize(model: Any, outputs: set[str]) -> None:
    """Give the upgraded Resize nodes of :func:`_old_resize_outputs` their old semantics."""
    from onnx import helper, numpy_helper

    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Resize" or not node.output or node.output[0] not in outputs:
            continue
        keep = [a for a in node.attribute if a.name not in ("coordinate_transformation_mode", "nearest_mode")]
        scales = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        # nearest: floor when upsampling, ceil when downsampling (per axis: "simple", which only
        # compiler.dynshape_resize implements; with constant scales one rounding must fit all axes)
        rounding = "simple"
        if scales is not None and scales.size:
            rounding = "floor" if (scales >= 1).all() else "ceil" if (scales <= 1).all() else "simple"
        del node.attribute[:]
        node.attribute.extend([*keep, helper.make_attribute("coordinate_transformation_mode", "asymmetric"),
                               helper.make_attribute("nearest_mode", rounding)])


# ---------------------------------------------------------------------------------------------- 3
def apply_shapes(model: Any, shapes: dict[str, list[int]] | None = None, batch: int | None = None) -> bool:
    """Fix input dims from ``shapes`` (name -> dims, -1 keeps a dim dynamic); a still-dynamic
    leading dim becomes ``batch`` when given. Unknown names and rank mismatches are ModelErrors."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    inputs = {i.name: i for i in g.input if i.name not in inits}
    shapes = dict(shapes or {})
    from compiler.dynshape import shape_operand_inputs

    # an empty axes / shape operand is a length-0 input; so may be one that only carries a dtype, and
    # a data input given a zero dim here (answered at compile time: compiler/empty.py)
    empty_ok = shape_operand_inputs(model) | dtype_only_inputs(model) | \
        {n for n, dims in shapes.items() if 0 in dims}
    for name, dims in shapes.items():
        if name not in inputs:
            raise ModelError(f"--shape names {name!r}, which is not an input of the model",
                             hint=f"the inputs are: {', '.join(inputs) or '(none)'}")
        tt = inputs[name].type.tensor_type
        if any(d < -1 for d in dims):
            raise ModelError(f"--shape {name}={','.join(map(str, dims))} has a negative dimension",
                             hint="dimensions are >= 0 (or ? for a dynamic batch)")
        if tt.HasField("shape") and len(tt.shape.dim) != len(dims):
            raise ModelError(f"--shape {name} gives {len(dims)} dimensions; the input has "
                             f"{len(tt.shape.dim)}",
                             hint="give one size per dimension")
    changed = False
    for name, inp in inputs.items():
        tt = inp.type.tensor_type
        want_dims = shapes.get(name)
        if want_dims is not None and not tt.HasField("shape"):
            for _ in want_dims:
                tt.shape.dim.add()
        if not tt.HasField("shape"):
            continue
        for axis, d in enumerate(tt.shape.dim):
            static = d.HasField("dim_value") and (d.dim_value > 0 or name in empty_ok)
            want = want_dims[axis] if want_dims is not None else -1
            if want > 0:
                if static and d.dim_value != want and axis > 0:
                    raise ModelError(f"--shape {name}: dimension {axis} is fixed to {d.dim_value} in the "
                                     "model, "
                                     f"not {want}", hint="only dynamic dimensions (and the batch) can be set")
            elif want < 0 and axis == 0 and not static and batch:  # (a given 0 stays: compiler/empty.py)
                want = batch
            if (want > 0 or (want == 0 and name in empty_ok)) and not (static and d.dim_value == want):
                d.Clear()
                d.dim_value = want
                changed = True
    if changed:
        del g.value_info[:]  # stale below the inputs; re-inferred
    return changed


# ---------------------------------------------------------------------------------------------- 4
# (constant folding and graph helpers: compiler/graphbuild.py)


# ---------------------------------------------------------------------------------------------- 5
_ACT_DEFAULTS = {"LeakyRelu": (0.01, None), "ThresholdedRelu": (1.0, None), "HardSigmoid": (0.2, 0.5),
                 "Elu": (1.0, None), "Affine": (1.0, 0.0), "ScaledTanh": (1.0, 1.0)}
_ACTS = {"Relu", "Tanh", "Sigmoid", "Softsign", "Softplus", *_ACT_DEFAULTS}


class _Builder(Builder):
    """The rewrites' node builder (compiler/graphbuild.py) with the activations RNN cells use."""

    def act(self, kind: str, x: str, alpha: float | None, beta: float | None, dtype: Any) -> str:
        if kind in ("Relu", "Tanh", "Sigmoid", "Softsign", "Softplus"):
            return self.op(kind, [x])
        if kind in ("LeakyRelu", "ThresholdedRelu", "Elu"):
            return self.op(kind, [x], alpha=float(alpha if alpha is not None else 0.0))
        if kind == "HardSigmoid":
            return self.op(kind, [x], alpha=float(alpha or 0.0), beta=float(beta or 0.0))
        if kind == "Affine":
            m = self.op("Mul", [x, self.const(np.array(alpha, dtype=dtype), "alpha")])
            return self.op("Add", [m, self.const(np.array(beta, dtype=dtype), "beta")])
        if kind == "ScaledTanh":
            m = self.op("Mul", [x, self.const(np.array(beta, dtype=dtype), "beta")])
            return self.op("Mul", [self.op("Tanh", [m]), self.const(np.array(alpha, dtype=dtype), "alpha")])
        raise AssertionError(kind)


def _activations(node: Any, n_per_dir: int, dirs: int, defaults: list[str]) -> list[tuple[str, Any, Any]]:
    attrs = {a.name: a for a in node.attribute}
    names = [s.decode() for s in attrs["activations"].strings] if "activations" in attrs else defaults * dirs
    if len(names) != n_per_dir * dirs:
        raise ModelError(f"{node.op_type} {node.name!r} lists {len(names)} activations; expected "
                         f"{n_per_dir * dirs}", hint="fix the model's activations attribute")
    alphas = list(attrs["activation_alpha"].floats) if "activation_alpha" in attrs else []
    betas = list(attrs["activation_beta"].floats) if "activation_beta" in attrs else []
    out = []
    canon = {a.lower(): a for a in _ACTS}
    for raw in names:
        kind = canon.get(raw.lower())
        if kind is None:
            raise ModelError(f"{node.op_type} {node.name!r} uses the activation {raw!r}, which ONNX does "
                             "not define",
                             hint="use one of " + ", ".join(sorted(_ACTS)))
        da, db = _ACT_DEFAULTS.get(kind, (None, None))
        alpha = alphas.pop(0) if da is not None and alphas else da
        beta = betas.pop(0) if db is not None and betas else db
        out.append((kind, alpha, beta))
    return out


def _rnn_nodes(model: Any, node: Any, consts: dict[str, np.ndarray],
               shapes: dict[str, list[int]], index: int) -> _Builder:
    op = node.op_type
    attrs = {a.name: a for a in node.attribute}
    label = f"{op} {node.name or f'#{index}'!r}"

    def iattr(n: str, d: int) -> int:
        return int(attrs[n].i) if n in attrs else d

    direction = attrs["direction"].s.decode() if "direction" in attrs else "forward"
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ModelError(f"{label} has direction {direction!r}", hint="forward, reverse or bidirectional")
    dirs = 2 if direction == "bidirectional" else 1
    layout = iattr("layout", 0)
    hidden = iattr("hidden_size", 0)
    clip = float(attrs["clip"].f) if "clip" in attrs else None
    input_forget = iattr("input_forget", 0)
    linear_before_reset = iattr("linear_before_reset", 0)
    n_gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    n_acts = {"LSTM": 3, "GRU": 2, "RNN": 1}[op]
    acts = _activations(node, n_acts, dirs, {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"],
                                             "RNN": ["Tanh"]}[op])
    ins = list(node.input) + [""] * (8 - len(node.input))
    x, w_name, r_name, b_name, seq_name, h0_name = ins[:6]
    c0_name, p_name = (ins[6], ins[7]) if op == "LSTM" else ("", "")

    def dims_of(nm: str) -> list[int]:
        return list(consts[nm].shape) if nm in consts else list(shapes.get(nm) or [])

    for what, nm in (("W", w_name), ("R", r_name), ("B", b_name), ("P", p_name)):
        if nm and (not dims_of(nm) or any(d <= 0 for d in dims_of(nm))):
            raise ModelError(f"{label}: input {what} has no static shape ({dims_of(nm)})",
                             hint="export the model with the recurrent weights as initializers")
    xshape = shapes.get(x)
    if not xshape or len(xshape) != 3 or any(d <= 0 for d in xshape):
        raise ModelError(f"{label}: the input sequence has no fixed shape ({xshape})",
                         hint="fix the sequence length and batch with --shape NAME=D0,D1,D2")
    seq_len, batch = (xshape[0], xshape[1]) if layout == 0 else (xshape[1], xshape[0])
    w_dims, r_dims = dims_of(w_name), dims_of(r_name)
    if w_name in consts:
        dtype = consts[w_name].dtype
    else:  # weights given at run time (model inputs): sliced in the graph instead of here
        from onnx import helper

        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(_elem_types(model).get(w_name, 1)))
    if not hidden:
        hidden = r_dims[-1]
    if w_dims[0] != dirs or w_dims[1] != n_gates * hidden or r_dims[1:] != [n_gates * hidden, hidden]:
        raise ModelError(f"{label}: weight shapes W{w_dims} R{r_dims} do not match "
                         f"hidden_size={hidden} and {dirs} direction(s)", hint="fix the model")
    # sequence_lens other than the full length: past a sample's length its state stays and its
    # output is 0 (a mask per step; a reverse pass so starts at the sample's own last step)
    masked = bool(seq_name) and not (seq_name in consts and np.all(consts[seq_name] == seq_len))
    bld = _Builder(model, f"{node.name or op}_{index}")
    lens_col = bld.op("Reshape", [bld.op("Cast", [seq_name], to=7), bld.const(np.array([batch, 1], np.int64),
                                                                              "shape")]) if masked else ""
    H = hidden
    blocks: dict[tuple[str, int, int, int, bool], str] = {}

    def rows(nm: str, d: int, lo: int, hi: int, transpose: bool = False) -> str:
        """``nm[d, lo:hi]`` (transposed): a constant, or sliced in the graph from a run-time input."""
        key = (nm, d, lo, hi, transpose)
        if key in blocks:
            return blocks[key]
        if not nm:
            v = bld.const(np.zeros((hi - lo,), dtype), "zeros")
        elif nm in consts:
            part = consts[nm][d, lo:hi]
            v = bld.const((part.T if transpose else part).copy(), "w")
        else:
            v = bld.op("Gather", [nm, bld.const(np.array(d, np.int64), "dir")], axis=0)
            bounds = [bld.const(np.array([b], np.int64), "b") for b in (lo, hi, 0)]
            v = bld.op("Slice", [v, *bounds]) if _opset(model) >= 10 else \
                bld.op("Slice", [v], starts=[lo], ends=[hi], axes=[0])
            v = bld.op("Transpose", [v], perm=[1, 0]) if transpose else v
        blocks[key] = v
        return v

    if layout == 1:
        x = bld.op("Transpose", [x], perm=[1, 0, 2])
    # gate order per op (W/R/B row blocks): LSTM i o f c, GRU z r h, RNN i
    ys, hs, cs = [], [], []
    for d in range(dirs):
        f_act, g_act = acts[d * n_acts], acts[d * n_acts + 1] if n_acts > 1 else None
        h_act = acts[d * n_acts + 2] if op == "LSTM" else None
        rb0 = n_gates * H  # B holds Wb then Rb

        # input projections for all steps at once: [T, batch, H] per gate
        xw = []
        for k in range(n_gates):
            proj = bld.op("MatMul", [x, rows(w_name, d, k * H, (k + 1) * H, transpose=True)])
            both = not (op == "GRU" and k == 2 and linear_before_reset)  # Wb + Rb
            if b_name in consts or not b_name:
                bias = consts[b_name][d, k * H:(k + 1) * H] if b_name else np.zeros(H, dtype)
                if both and b_name:
                    bias = bias + consts[b_name][d, rb0 + k * H:rb0 + (k + 1) * H]
                xw.append(bld.op("Add", [proj, bld.const(bias.astype(dtype), f"b{k}")]))
                continue
            proj = bld.op("Add", [proj, rows(b_name, d, k * H, (k + 1) * H)])
            if both:
                proj = bld.op("Add", [proj, rows(b_name, d, rb0 + k * H, rb0 + (k + 1) * H)])
            xw.append(proj)
        rt = [rows(r_name, d, k * H, (k + 1) * H, transpose=True) for k in range(n_gates)]

        def state(name: str, d: int = d) -> str:
            if name:
                return bld.op("Gather", [name, bld.const(np.array(d, np.int64), "dir")], axis=layout)
            return bld.const(np.zeros((batch, H), dtype), "zeros")

        h = state(h0_name)
        c = state(c0_name) if op == "LSTM" else ""
        steps = range(seq_len) if (direction == "forward" or (direction == "bidirectional" and d == 0)) \
            else range(seq_len - 1, -1, -1)
        outs: dict[int, str] = {}

        def pre(k: int, t_idx: str, extra: list[str]) -> str:
            v = bld.op("Add", [bld.op("Gather", [xw[k], t_idx], axis=0),  # noqa: B023 (called at once)
                               bld.op("MatMul", [h, rt[k]])])  # noqa: B023
            for e in extra:
                v = bld.op("Add", [v, e])
            return v

        def clipped(v: str) -> str:
            if clip is None:
                return v
            if _opset(model) < 11:
                return bld.op("Clip", [v], min=-clip, max=clip)
            lo, hi = bld.const(np.array(-clip, dtype), "lo"), bld.const(np.array(clip, dtype), "hi")
            return bld.op("Clip", [v, lo, hi])

        def fa(spec: tuple[str, Any, Any], v: str) -> str:
            return bld.act(spec[0], clipped(v), spec[1], spec[2], dtype)

        one = bld.const(np.array(1, dtype), "one")
        for t in steps:
            ti = bld.const(np.array(t, np.int64), "t")
            h_before, c_before = h, c
            if op == "LSTM":
                peep = [rows(p_name, d, k * H, (k + 1) * H) for k in range(3)] if p_name else []
                pi = [bld.op("Mul", [c, peep[0]])] if peep else []
                pf = [bld.op("Mul", [c, peep[2]])] if peep else []
                i_g = fa(f_act, pre(0, ti, pi))
                f_g = bld.op("Sub", [one, i_g]) if input_forget else fa(f_act, pre(2, ti, pf))
                assert g_act is not None and h_act is not None
                c_t = fa(g_act, pre(3, ti, []))
                c = bld.op("Add", [bld.op("Mul", [f_g, c]), bld.op("Mul", [i_g, c_t])])
                po = [bld.op("Mul", [c, peep[1]])] if peep else []
                o_g = fa(f_act, pre(1, ti, po))
                h = bld.op("Mul", [o_g, bld.act(h_act[0], c, h_act[1], h_act[2], dtype)])
            elif op == "GRU":
                assert g_act is not None
                z = fa(f_act, pre(0, ti, []))
                r = fa(f_act, pre(1, ti, []))
                xh = bld.op("Gather", [xw[2], ti], axis=0)
                if linear_before_reset:
                    rbh = rows(b_name, d, rb0 + 2 * H, rb0 + 3 * H)
                    hr = bld.op("Add", [bld.op("MatMul", [h, rt[2]]), rbh])
                    cand = bld.op("Add", [xh, bld.op("Mul", [r, hr])])
                else:
                    cand = bld.op("Add", [xh, bld.op("MatMul", [bld.op("Mul", [r, h]), rt[2]])])
                hh = fa(g_act, cand)
                h = bld.op("Add", [bld.op("Mul", [bld.op("Sub", [one, z]), hh]), bld.op("Mul", [z, h])])
            else:
                h = fa(f_act, pre(0, ti, []))
            if masked:
                live = bld.op("Less", [ti, lens_col])  # [batch, 1]: step t within the sample
                outs[t] = bld.op("Where", [live, h, bld.const(np.zeros((1, H), dtype), "zero")])
                h = bld.op("Where", [live, h, h_before])
                if op == "LSTM":
                    c = bld.op("Where", [live, c, c_before])
            else:
                outs[t] = h
        shape4 = bld.const(np.array([1, 1, batch, H], np.int64), "shape")
        ys.append(bld.op("Concat", [bld.op("Reshape", [outs[t], shape4]) for t in range(seq_len)], axis=0))
        shape3 = bld.const(np.array([1, batch, H], np.int64), "shape")
        hs.append(bld.op("Reshape", [h, shape3]))
        if op == "LSTM":
            cs.append(bld.op("Reshape", [c, shape3]))
    outputs = list(node.output) + [""] * 3
    y_name, yh_name, yc_name = outputs[0], outputs[1], outputs[2] if op == "LSTM" else ""

    def emit(parts: list[str], axis: int, name: str, perm: list[int] | None) -> None:
        if not name:
            return
        v = parts[0] if len(parts) == 1 else bld.op("Concat", parts, axis=axis)
        if perm is not None:
            bld.op("Transpose", [v], out=name, perm=perm)
        else:
            bld.op("Identity", [v], out=name)

    emit(ys, 1, y_name, [2, 0, 1, 3] if layout == 1 else None)
    emit(hs, 0, yh_name, [1, 0, 2] if layout == 1 else None)
    emit(cs, 0, yc_name, [1, 0, 2] if layout == 1 else None)
    return bld


def decompose_rnn(model: Any) -> bool:
    """Unroll every LSTM / GRU / RNN node over its (fixed) sequence length."""
    g = model.graph
    if not any(n.op_type in _RNN_OPS and n.domain in ("", "ai.onnx") for n in g.node):
        return False
    consts = _const_inputs(model)
    shapes = _static_shapes(model)
    new_nodes = []
    for i, node in enumerate(g.node):
        if node.op_type in _RNN_OPS and node.domain in ("", "ai.onnx"):
            bld = _rnn_nodes(model, node, consts, shapes, i)
            new_nodes.extend(bld.nodes)
            g.initializer.extend(bld.inits)
        else:
            new_nodes.append(node)
    _replace_nodes(g, new_nodes)
    _drop_unused_initializers(model)
    return True


# --------------------------------------------------------------------------------------------- 5b
_CUMPROD_MAX = 256  # CumProd is unrolled along its axis: one Mul per element
_DET_MAX = 5  # Det sums n! products (Leibniz): 120 terms at 5


def _cumprod_along(bld: _Builder, x: str, dims: list[int], axis: int, exclusive: bool, reverse: bool,
                   dtype: Any) -> str:
    """Running product of ``x`` along ``axis``, one slice at a time."""
    n = dims[axis]
    axes = bld.const(np.array([axis], np.int64), "axis")
    pieces = [bld.op("Slice", [x, bld.const(np.array([j], np.int64), "start"),
                                bld.const(np.array([j + 1], np.int64), "end"), axes]) for j in range(n)]
    running = bld.const(np.ones([1 if k == axis else d for k, d in enumerate(dims)], dtype), "ones")
    out: dict[int, str] = {}
    for j in (range(n - 1, -1, -1) if reverse else range(n)):
        before = running
        running = bld.op("Mul", [running, pieces[j]])
        out[j] = before if exclusive else running
    return bld.op("Concat", [out[j] for j in range(n)], axis=axis)


def _cumprod_nodes(model: Any, node: Any, consts: dict[str, np.ndarray], shapes: dict[str, list[int]],
                   types: dict[str, int], label: str, index: int) -> _Builder:
    from onnx import helper

    x, axis_name = node.input[0], node.input[1]
    dims = shapes.get(x)
    if dims is None or any(d <= 0 for d in dims) or not dims:
        raise ModelError(f"{label}: the input has no fixed shape ({dims})",
                         hint="fix the input's shape with --shape NAME=D0,D1,...")
    elem = types.get(x)
    if elem is None:
        raise ModelError(f"{label}: the type of its input is unknown", hint="give the model's inputs types")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
    rank = len(dims)
    exclusive = bool(next((a.i for a in node.attribute if a.name == "exclusive"), 0))
    reverse = bool(next((a.i for a in node.attribute if a.name == "reverse"), 0))
    known = consts.get(axis_name)
    candidates = [int(known) % rank] if known is not None else list(range(rank))
    for k in candidates:
        if dims[k] > _CUMPROD_MAX:
            raise ModelError(f"{label}: the product runs along {dims[k]} elements; it is unrolled, up to "
                             f"{_CUMPROD_MAX}",
                             hint="split the axis or compute the product outside the model")
    bld = _Builder(model, f"{node.name or 'CumProd'}_{index}")
    results = {k: _cumprod_along(bld, x, dims, k, exclusive, reverse, dtype) for k in candidates}
    if len(candidates) == 1:
        bld.op("Identity", [results[candidates[0]]], out=node.output[0])
        return bld
    # the axis arrives at run time: compute along every axis, keep the one asked for
    axis_type = np.dtype(helper.tensor_dtype_to_np_dtype(types.get(axis_name, 7)))
    ax = bld.op("Reshape", [axis_name, bld.const(np.array([], np.int64), "scalar")])
    neg = bld.op("Less", [ax, bld.const(np.array(0, axis_type), "zero")])
    ax = bld.op("Where", [neg, bld.op("Add", [ax, bld.const(np.array(rank, axis_type), "rank")]), ax])
    picked = results[candidates[-1]]
    for k in reversed(candidates[:-1]):
        hit = bld.op("Equal", [ax, bld.const(np.array(k, axis_type), "k")])
        picked = bld.op("Where", [hit, results[k], picked])
    bld.op("Identity", [picked], out=node.output[0])
    return bld


def _det_nodes(model: Any, node: Any, shapes: dict[str, list[int]], label: str, index: int) -> _Builder:
    """Leibniz: det = sum over permutations p of sign(p) * prod_i x[i, p(i)]."""
    import itertools

    x = node.input[0]
    dims = shapes.get(x)
    if dims is None or len(dims) < 2 or dims[-1] <= 0 or dims[-1] != dims[-2]:
        raise ModelError(f"{label}: the matrices have no fixed square shape ({dims})",
                         hint="fix the input's shape with --shape NAME=D0,D1,...")
    n = dims[-1]
    if n > _DET_MAX:
        raise ModelError(f"{label}: {n}x{n} matrices; the determinant is expanded only up to "
                         f"{_DET_MAX}x{_DET_MAX}", hint="compute the determinant outside the model")
    perms = list(itertools.permutations(range(n)))
    flat = np.array([[i * n + p[i] for i in range(n)] for p in perms], np.int64)
    sign = np.array([(-1) ** sum(1 for i in range(n) for j in range(i + 1, n) if p[i] > p[j])
                     for p in perms])
    bld = _Builder(model, f"{node.name or 'Det'}_{index}")
    lead = len(dims) - 2
    rows = bld.op("Reshape", [x, bld.const(np.array([0] * lead + [n * n], np.int64), "shape")])
    terms = bld.op("ReduceProd", [bld.op("Gather", [rows, bld.const(flat, "perm")], axis=-1),
                                  bld.const(np.array([-1], np.int64), "axes")], keepdims=0)
    signs = bld.op("CastLike", [bld.const(sign.astype(np.float32), "sign"), terms])
    bld.op("ReduceSum", [bld.op("Mul", [terms, signs]), bld.const(np.array([-1], np.int64), "axes")],
           out=node.output[0], keepdims=0)
    return bld


def _lp_norm_nodes(model: Any, node: Any, types: dict[str, int], label: str, index: int) -> _Builder:
    """x / ReduceL1 or ReduceL2 over ``axis``; a zero norm gives 0, as onnxruntime does (not 0/0)."""
    p = next((int(a.i) for a in node.attribute if a.name == "p"), 2)
    axis = next((int(a.i) for a in node.attribute if a.name == "axis"), -1)
    if p not in (1, 2):
        raise ModelError(f"{label}: p={p}; ONNX defines LpNormalization for p 1 and 2 only",
                         hint="use p=1 or p=2")
    from onnx import helper

    x = node.input[0]
    if types.get(x) not in _FLOAT_TYPES | {10}:
        raise ModelError(f"{label}: the input's type is unknown or not a float",
                         hint="run onnx.shape_inference on the model or give its inputs types")
    dtype = helper.tensor_dtype_to_np_dtype(types[x])
    bld = _Builder(model, f"{node.name or 'LpNormalization'}_{index}")
    reduce = "ReduceL1" if p == 1 else "ReduceL2"
    if _opset(model) >= 18:  # axes became an input in opset 18
        norm = bld.op(reduce, [x, bld.const(np.array([axis], np.int64), "axes")], keepdims=1)
    else:
        norm = bld.op(reduce, [x], axes=[axis], keepdims=1)
    zero = bld.op("Equal", [norm, bld.const(np.array(0, dtype), "zero")])
    safe = bld.op("Where", [zero, bld.const(np.array(1, dtype), "one"), norm])
    bld.op("Div", [x, safe], out=node.output[0])
    return bld


def _cumsum_nodes(model: Any, node: Any, shapes: dict[str, list[int]], label: str, index: int) -> _Builder:
    """CumSum with its axis given at run time: one CumSum per axis (TVM's converter needs a constant
    axis), the one the input holds picked and checked (any other value stops inference)."""
    from compiler.convert_ops import MAX_ALTERNATIVES, guard_values

    x, axis_name = node.input[0], node.input[1]
    rank = len(shapes.get(x) or [])
    if not 0 < 2 * rank <= MAX_ALTERNATIVES:
        raise ModelError(f"{label}: the axis {axis_name!r} is known only at run time and the input has rank "
                         f"{rank or 'unknown'} (up to {MAX_ALTERNATIVES // 2} is compiled axis by axis)",
                         hint="make the axis a constant of the model")
    bld = _Builder(model, f"{node.name or 'CumSum'}_{index}")
    attrs = {a.name: a.i for a in node.attribute if a.name in ("exclusive", "reverse")}
    results, alternatives = [], []
    for k in range(rank):
        along = bld.op("CumSum", [x, bld.const(np.array(k, np.int64), "axis")], **attrs)
        for value in (k, k - rank):
            results.append(along)
            alternatives.append({axis_name: np.array(value)})
    guard_values(bld, results, alternatives, node.output[0])
    return bld


def _decomposed(node: Any, consts: dict[str, np.ndarray]) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "CumSum":  # with a run-time axis
        return len(node.input) > 1 and node.input[1] not in consts
    return node.op_type in _LOWERED_OPS


def decompose_ops(model: Any) -> bool:
    """CumProd (unrolled along its axis), Det (Leibniz, up to 5x5) and LpNormalization (a reduction
    and a division): no TVM converter, no ONNX function; CumSum with a run-time axis."""
    g = model.graph
    if not any(n.op_type in {*_LOWERED_OPS, "CumSum"} and n.domain in ("", "ai.onnx") for n in g.node):
        return False
    consts = _const_inputs(model)
    if not any(_decomposed(n, consts) for n in g.node):
        return False
    shapes = _static_shapes(model)
    types = _elem_types(model)
    new_nodes = []
    for i, node in enumerate(g.node):
        if not _decomposed(node, consts):
            new_nodes.append(node)
            continue
        label = f"{node.op_type} at node {node.name or f'#{i}'!r}"
        if node.op_type == "CumSum":
            bld = _cumsum_nodes(model, node, shapes, label, i)
        elif node.op_type == "CumProd":
            bld = _cumprod_nodes(model, node, consts, shapes, types, label, i)
        elif node.op_type == "LpNormalization":
            bld = _lp_norm_nodes(model, node, types, label, i)
        else:
            bld = _det_nodes(model, node, shapes, label, i)
        new_nodes.extend(bld.nodes)
        g.initializer.extend(bld.inits)
    _replace_nodes(g, new_nodes)
    return True


_FLOAT_TYPES = frozenset({1, 11})  # float, double (float16 Pow: left to TVM and promote_float16)


def cast_pow_exponent(model: Any) -> bool:
    """Pow of a float base by an integer exponent (ONNX allows mixed types, TVM's Pow does not):
    the exponent is cast to the base's type (exact for exponents below 2^24 in float32)."""
    from onnx import helper

    g = model.graph
    if not any(n.op_type == "Pow" for n in g.node):
        return False
    types = _elem_types(model)
    new_nodes = []
    changed = False
    for i, node in enumerate(g.node):
        base, exp = (types.get(x) for x in node.input[:2]) if node.op_type == "Pow" else (None, None)
        if node.domain not in ("", "ai.onnx") or base not in _FLOAT_TYPES or exp in (None, *_FLOAT_TYPES):
            new_nodes.append(node)
            continue
        cast = f"{node.name or 'Pow'}_{i}/exponent"
        new_nodes.append(helper.make_node("Cast", [node.input[1]], [cast], name=cast, to=base))
        node.input[1] = cast
        new_nodes.append(node)
        changed = True
    if changed:
        _replace_nodes(g, new_nodes)
    return changed


# ---------------------------------------------------------------------------------------------- 6
def guard_bitshift(model: Any) -> bool:
    """BitShift by an amount outside [0, bits) (a negative amount counts as a huge unsigned one):
    ONNX gives 0 (left, or right of an unsigned value) or the sign (right of a signed value);
    LLVM's shift is undefined there. Clamp the amount to bits - 1 and select 0 where it was out
    of range (a signed right shift by bits - 1 already gives the sign)."""
    from onnx import helper

    g = model.graph
    if not any(n.op_type == "BitShift" for n in g.node):
        return False
    consts = _const_inputs(model)
    types = _elem_types(model)
    new_nodes = []
    changed = False
    for i, node in enumerate(g.node):
        if node.op_type != "BitShift" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            new_nodes.append(node)
            continue
        x, amount = node.input[0], node.input[1]
        elem = types.get(x) or types.get(amount)
        if elem is None:
            raise ModelError(f"BitShift at node {node.name or f'#{i}'!r}: the type of its input is unknown",
                             hint="run onnx.shape_inference on the model or give its inputs types")
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
        bits = dtype.itemsize * 8
        known = consts.get(amount)
        if known is not None and np.all((known >= 0) & (known < bits)):
            new_nodes.append(node)
            continue
        bld = _Builder(model, f"{node.name or 'BitShift'}_{i}")
        limit = bld.const(np.array(bits, dtype), "bits")
        out = bld.op("GreaterOrEqual", [amount, limit])
        if dtype.kind == "i":
            out = bld.op("Or", [out, bld.op("Less", [amount, bld.const(np.array(0, dtype), "zero")])])
        safe = bld.op("Where", [out, bld.const(np.array(bits - 1, dtype), "top"), amount])
        direction = next((a.s.decode() for a in node.attribute if a.name == "direction"), "")
        shifted = bld.op("BitShift", [x, safe], direction=direction)
        if direction == "RIGHT" and dtype.kind == "i":
            bld.op("Identity", [shifted], out=node.output[0])
        else:
            bld.op("Where", [out, bld.const(np.array(0, dtype), "zero"), shifted], out=node.output[0])
        new_nodes.extend(bld.nodes)
        g.initializer.extend(bld.inits)
        changed = True
    if changed:
        _replace_nodes(g, new_nodes)
    return changed


# ---------------------------------------------------------------------------------------------- 8
# onnx FLOAT, FLOAT16, DOUBLE
_FLOAT_ELEMS: dict[int, type[np.floating[Any]]] = {1: np.float32, 10: np.float16, 11: np.float64}


def fix_reduce_extremes(model: Any) -> bool:
    """TVM starts a float ReduceMax at the lowest finite value (ReduceMin at the highest), so a
    slice of only -inf (+inf) gives -3.4e38 (3.4e38) instead of -inf (+inf); attention masks make
    such rows, and the Equal(max, -inf) guard after them then fails (NaN instead of 0). Map the
    finite extreme back to the infinity."""
    g = model.graph
    if not any(n.op_type in ("ReduceMax", "ReduceMin") for n in g.node):
        return False
    types = _elem_types(model)
    new_nodes = []
    changed = False
    for i, node in enumerate(g.node):
        dtype = _FLOAT_ELEMS.get(types.get(node.input[0], 0)) if node.input else None
        reduce = node.op_type in ("ReduceMax", "ReduceMin") and node.domain in ("", "ai.onnx")
        if not reduce or dtype is None:
            new_nodes.append(node)
            continue
        bld = _Builder(model, f"{node.name or node.op_type}_{i}")
        out = node.output[0]
        raw = bld.name("raw")
        node.output[0] = raw
        info = np.finfo(dtype)
        finite, inf = (info.min, -np.inf) if node.op_type == "ReduceMax" else (info.max, np.inf)
        hit = bld.op("Equal", [raw, bld.const(np.array(finite, dtype), "extreme")])
        bld.op("Where", [hit, bld.const(np.array(inf, dtype), "inf"), raw], out=out)
        new_nodes.extend([node, *bld.nodes])
        g.initializer.extend(bld.inits)
        changed = True
    if changed:
        _replace_nodes(g, new_nodes)
    return changed


# ---------------------------------------------------------------------------------------------- 7
_FP16, _FP32 = 10, 1
_DTYPE_ATTRS = {"Cast": "to", "EyeLike": "dtype", "RandomNormal": "dtype", "RandomUniform": "dtype",
                "RandomNormalLike": "dtype", "RandomUniformLike": "dtype", "Bernoulli": "dtype"}


def promote_float16(model: Any) -> bool:
    """Compute a float16 model in float32: inputs are cast up once, outputs cast back, float16
    constants widened. TVM computes float16 with a rounding after every operation (x86 has no
    float16 arithmetic), which drifts past 1e-3 over a softmax or a convolution; onnxruntime's CPU
    kernels, the reference users compare with, widen too."""
    from onnx import helper, numpy_helper

    g = model.graph
    if not _uses_float16(model):
        return False
    inits = {t.name for t in g.initializer}
    rename: dict[str, str] = {}
    head = []
    for inp in g.input:
        if inp.name not in inits and inp.type.tensor_type.elem_type == _FP16:
            rename[inp.name] = f"{inp.name}/float32"
            head.append(helper.make_node("Cast", [inp.name], [rename[inp.name]], to=_FP32,
                                         name=f"promote_{inp.name}"))
    for node in g.node:
        for k, name in enumerate(node.input):
            if name in rename:
                node.input[k] = rename[name]
        for a in node.attribute:
            if a.name == "value" and a.type == 4 and a.t.data_type == _FP16:  # TENSOR attribute
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
            if node.op_type in _DTYPE_ATTRS and a.name == _DTYPE_ATTRS[node.op_type] and a.i == _FP16:
                a.i = _FP32
    for k, t in enumerate(g.initializer):
        if t.data_type == _FP16:
            widened = numpy_helper.to_array(t).astype(np.float32)
            g.initializer[k].CopyFrom(numpy_helper.from_array(widened, t.name))
    for inp in g.input:
        if inp.name in inits and inp.type.tensor_type.elem_type == _FP16:
            inp.type.tensor_type.elem_type = _FP32
    tail = []
    for out in g.output:
        if out.type.tensor_type.elem_type != _FP16:
            continue
        wide = f"{out.name}/float32"
        for node in g.node:
            for k, name in enumerate(node.output):
                if name == out.name:
                    node.output[k] = wide
        source = rename.get(out.name, wide)
        tail.append(helper.make_node("Cast", [source], [out.name], to=_FP16, name=f"narrow_{out.name}"))
    _replace_nodes(g, [*head, *g.node, *tail])
    return True


def _uses_float16(model: Any) -> bool:
    g = model.graph
    if any(t.data_type == _FP16 for t in g.initializer):
        return True
    if any(vi.type.tensor_type.elem_type == _FP16 for vi in [*g.input, *g.output]):
        return True
    for node in g.node:
        for a in node.attribute:
            if a.type == 5 or a.type == 10:  # a subgraph: not rewritten
                return False
        for a in node.attribute:
            if (a.name == "value" and a.type == 4 and a.t.data_type == _FP16) or \
                    (node.op_type in _DTYPE_ATTRS and a.name == _DTYPE_ATTRS[node.op_type] and a.i == _FP16):
                return True
    return False


def cast_like_inputs(model: Any) -> bool:
    """CastLike whose ``target_type`` is a model input -> Cast to that input's dtype: the input only
    carries a dtype (it may be empty, as in ONNX's CastLike cases), and no compiled code reads it."""
    from onnx import helper

    g = model.graph
    inits = {t.name for t in g.initializer}
    dtypes = {i.name: i.type.tensor_type.elem_type for i in g.input if i.name not in inits}
    changed = False
    for node in g.node:
        if node.op_type == "CastLike" and node.domain in ("", "ai.onnx") and len(node.input) == 2 \
                and dtypes.get(node.input[1]):
            to = dtypes[node.input[1]]
            node.op_type = "Cast"
            del node.input[1]
            saturate = [a for a in node.attribute if a.name == "saturate"]
            del node.attribute[:]
            node.attribute.extend([helper.make_attribute("to", to), *saturate])
            changed = True
    return changed


# ---------------------------------------------------------------------------------------------- all
def prepare(model: Any, *, shapes: dict[str, list[int]] | None = None,
            batch: int | None = None) -> tuple[Any, list[str]]:
    """Run every step on a copy of ``model``; returns (prepared model, names of steps that changed it)."""
    import copy

    model = copy.deepcopy(model)
    steps: list[tuple[str, Callable[[], bool]]] = [
        ("normalize_ir", lambda: normalize_ir(model)),
        ("lower_ml", lambda: lower_ml(model)),  # ai.onnx.ml -> standard ops (compiler/prepare_ml.py)
        # ai.onnx.preview.training's optimizers (compiler/lower_training.py); such a model may
        # import no default opset, which the upgrade would take for opset 1
        ("lower_training", lambda: lower_training(model)),
        # opset 8's batched Scan: before the version converter, which rewrites it wrongly
        ("unroll_scan8", lambda: unroll_loops(model, final=False)),
        ("upgrade_opset", lambda: upgrade_opset(model)),
        ("apply_shapes", lambda: apply_shapes(model, shapes, batch)),
        # QLinearConv, QGemm, ... -> DequantizeLinear -> op -> QuantizeLinear (compiler/qoperator.py):
        # before fold_constants, which keeps a weight's DequantizeLinear for compiler.integer
        ("qoperator_to_qdq", lambda: qoperator_to_qdq(model)),
        ("fold_constants", lambda: fold_constants(model)),
        ("expand_functions", lambda: expand_functions(model)),
        ("unroll_loops", lambda: unroll_loops(model)),  # Loop / Scan / constant If (compiler/unroll.py)
        ("lower_sequences", lambda: lower_sequences(model)),  # static lengths (compiler/sequences.py)
        ("decompose_rnn", lambda: decompose_rnn(model)),
        ("decompose_ops", lambda: decompose_ops(model)),
        ("lower_ops", lambda: lower_ops(model)),  # ScatterElements, DFT, ... (compiler/lower_ops.py)
        ("cast_pow_exponent", lambda: cast_pow_exponent(model)),
        ("guard_bitshift", lambda: guard_bitshift(model)),
        ("cast_like_inputs", lambda: cast_like_inputs(model)),
        # what nodes compute from empty data inputs, answered at compile time (compiler/empty.py)
        ("fold_empty", lambda: fold_empty(model, shapes)),
        ("lower_ieee", lambda: lower_ieee(model)),  # IsInf's sign, Mod by inf (compiler/lower_ieee.py)
        ("promote_float16", lambda: promote_float16(model)),
        # after promote_float16: the finite extreme is the computing type's
        ("fix_reduce_extremes", lambda: fix_reduce_extremes(model)),
    ]
    changed = []
    for name, step in steps:
        if step():
            changed.append(name)
    rewritten = {"expand_functions", "unroll_loops", "lower_sequences", "decompose_rnn", "decompose_ops",
                 "lower_ops", "fold_empty"}
    rewritten &= set(changed)
    if rewritten and fold_constants(model) and "fold_constants" not in changed:
        changed.append("fold_constants")
    return model, changed
