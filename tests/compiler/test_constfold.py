"""compiler.constfold folds in numpy exactly what FoldConstant folds with LLVM (issue 29).

The forms of the `light` networks: a convolution weight transposed to HWIO, a BatchNorm's
statistics decomposed into expand_dims / add(eps) / sqrt / divide, a negated bias broadcast.
After fold_numpy + FoldConstant the module must be the one FoldConstant alone gives (same
operators, bit-identical constants), and fold_numpy must have left FoldConstant nothing.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from compiler.constfold import fold_numpy


def _module() -> tvm.IRModule:
    rng = np.random.default_rng(0)

    def const(*shape: int) -> relax.Expr:
        return relax.const((rng.standard_normal(shape) + 2.0).astype(np.float32))

    x = relax.Var("x", relax.TensorType((1, 5, 5, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            w = bb.emit(relax.op.permute_dims(const(8, 4, 3, 3), [2, 3, 1, 0]))  # OIHW -> HWIO
            var = bb.emit(relax.op.add(const(8), relax.prim_value(tvm.tirx.const(1e-5, "float32"))))
            std = bb.emit(relax.op.expand_dims(relax.op.sqrt(var), [0, 1, 2]))
            scale = bb.emit(relax.op.divide(const(1, 1, 1, 8), std))
            bias = bb.emit(relax.op.broadcast_to(relax.op.negative(const(8)), relax.ShapeExpr([1, 1, 1, 8])))
            y = bb.emit(relax.op.nn.conv2d(x, w, data_layout="NHWC", kernel_layout="HWIO", padding=[1, 1]))
            out = bb.emit_output(relax.op.add(relax.op.multiply(y, scale), bias))
        bb.emit_func_output(out)
    return bb.get()


def _folded_calls(mod: tvm.IRModule) -> list[str]:
    """Operators whose every tensor argument is a constant (what FoldConstant would build)."""
    found = []

    def visit(e: relax.Expr) -> None:
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.args and \
                all(isinstance(a, (Constant, relax.ShapeExpr)) for a in e.args):
            found.append(e.op.name)

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def test_numpy_fold_equals_fold_constant() -> None:
    mod = relax.transform.Normalize()(_module())
    folded = fold_numpy(mod)
    assert _folded_calls(relax.transform.CanonicalizeBindings()(folded)) == []
    want = relax.transform.FoldConstant()(mod)
    got = relax.transform.FoldConstant()(folded)
    tvm.ir.assert_structural_equal(got, want)  # (compares the constants' bytes too)
    consts: list[np.ndarray] = []
    relax.analysis.post_order_visit(
        got["main"], lambda e: consts.append(e.value.numpy())
        if isinstance(e, Constant) and isinstance(e.value, tvm.runtime.Tensor) else None)
    assert sorted(c.shape for c in consts) == [(1, 1, 1, 8), (1, 1, 1, 8), (3, 3, 4, 8)]
