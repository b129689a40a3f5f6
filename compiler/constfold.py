"""Constant folding of data-movement and exact elementwise operators in numpy.

``relax.transform.FoldConstant`` folds a call on constants by legalizing it to TIR, building that
with LLVM and running it: one LLVM build per distinct operator and shape. The weights of the
`light` networks are constants, and the channels-last conversion (:mod:`compiler.layout`)
transposes every convolution's weights to HWIO, and each BatchNorm the importer kept decomposes
into expand_dims / add / sqrt of its constant statistics: ResNet-50's cost ~24 s of FoldConstant
builds in ``tuning.prepare`` and ~6 s in the conversion (2 cores, loaded; issue 29).
:func:`fold_numpy` folds the operators whose numpy result is bit-identical to TVM's
(transposes, reshapes, broadcasts, added unit axes, negation, square roots, and IEEE add /
subtract / multiply / divide on one float dtype, a scalar such as BatchNorm's epsilon included)
before FoldConstant runs, which then has (almost) nothing left to build. The folded module is the one
FoldConstant would give: same values, same shapes, hence the same kernels and workload hashes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["fold_numpy"]

_BINARY = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
           "relax.divide": np.divide}
_UNARY = {"relax.negative": np.negative, "relax.sqrt": np.sqrt}  # (sqrt: correctly rounded in both)


def _shape(e: Any) -> tuple[int, ...] | None:
    from tvm import relax

    if not isinstance(e, relax.ShapeExpr):
        return None
    try:
        return tuple(int(v) for v in e.values)
    except (TypeError, ValueError):  # a symbolic dimension
        return None


def _fold(op: str, call: Any, args: list[np.ndarray | None]) -> np.ndarray | None:
    """The value of ``call`` (operator ``op``) on constant ``args`` (None: not a constant), or
    None when it is not one :func:`fold_numpy` folds."""
    if op in _BINARY:
        a, b = args
        if a is None or b is None or a.dtype != b.dtype or a.dtype.kind != "f":
            return None
        with np.errstate(all="ignore"):
            return np.asarray(_BINARY[op](a, b), dtype=a.dtype)
    x = args[0] if args else None
    if x is None:
        return None
    if op in _UNARY and x.dtype.kind == "f":
        return np.asarray(_UNARY[op](x), dtype=x.dtype)
    if op == "relax.permute_dims":
        axes = call.attrs.axes
        return np.ascontiguousarray(np.transpose(x, None if axes is None else [int(a) for a in axes]))
    if op == "relax.expand_dims":
        axes = [int(a) % (x.ndim + len(call.attrs.axis)) for a in call.attrs.axis]
        return np.ascontiguousarray(np.expand_dims(x, sorted(axes)))
    if op in ("relax.reshape", "relax.broadcast_to"):
        shape = _shape(call.args[1])
        if shape is None:
            return None
        fn = np.reshape if op == "relax.reshape" else np.broadcast_to
        return np.ascontiguousarray(fn(x, shape))
    return None


def _fits(call: Any, value: np.ndarray) -> bool:
    """Whether ``value`` has the shape and dtype the original ``call`` was inferred to give (a
    0-d operand broadcast by numpy where TVM kept a rank, say, is left to FoldConstant)."""
    try:
        sinfo = call.struct_info
        shape = tuple(int(v) for v in sinfo.shape.values)
    except (AttributeError, TypeError, ValueError):  # no static tensor info to compare with
        return True
    return shape == value.shape


def fold_numpy(mod: Any) -> Any:
    """``mod`` with the calls above on constants replaced by their values (every Relax function)."""
    import tvm
    from tvm import relax
    from tvm.ir.expr import Constant
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class Fold(PyExprMutator):  # type: ignore[misc]
        def _value(self, e: Any) -> np.ndarray | None:
            if isinstance(e, relax.Var):
                e = self.lookup_binding(e)
            if isinstance(e, Constant) and isinstance(e.value, tvm.runtime.Tensor):
                return e.value.numpy()
            if isinstance(e, tvm.tirx.FloatImm) and str(e.ty) in ("float16", "float32", "float64"):
                return np.asarray(e.value, dtype=str(e.ty))  # a scalar operand (BatchNorm's eps)
            return None

        def visit_call_(self, op: Any) -> Any:
            call = super().visit_call_(op)
            if not isinstance(call.op, tvm.ir.Op) or call.op.name not in _FOLDED:
                return call
            n = 2 if call.op.name in _BINARY else 1
            args = [self._value(a) for a in call.args[:n]]
            if any(a is None for a in args):
                return call
            value = _fold(call.op.name, call, args)
            if value is None or not _fits(op, value):
                return call
            # (a TVM tensor, not the array: relax.const copies an array through astype even
            # when it has the dtype already, a second copy of VGG-19's 548 MB of weights)
            return relax.const(tvm.runtime.tensor(value))

    folder = Fold()
    try:
        funcs = {gv: folder.visit_expr(f) if isinstance(f, relax.Function) else f
                 for gv, f in mod.functions.items()}
    except (ValueError, TypeError, RuntimeError):
        # a fold the module's other inferred types do not accept (ONNX's DynamicQuantizeLinear
        # body: a Stack of a folded [1] and a 0-d value): FoldConstant, which folds none of those
        # at once, does the folding instead
        return mod
    return tvm.IRModule(funcs, attrs=mod.attrs)


_FOLDED = {*_BINARY, *_UNARY, "relax.permute_dims", "relax.reshape", "relax.broadcast_to",
           "relax.expand_dims"}
