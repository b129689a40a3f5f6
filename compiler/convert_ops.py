"""Relax converters of the project's own (issue 29); :mod:`compiler.dynshape`'s importer tries
them before TVM's:

* BitCast (opset 26; TVM has no converter): the same bits read as another type of the same width,
  ``topi.reinterpret`` (no ONNX operator reinterprets a float as an integer). Bool, which has no
  fixed bit layout in the compiled code, is refused before import (:mod:`compiler.importer`).
* Value guards. A rewrite that needs a shape operand given as a model input (Col2Im's
  ``image_shape``, STFT's ``frame_step``, ...) compiles each value the model's static shapes allow
  (a few at most), picks the one the input holds at run time, and checks that it holds one of them:
  :func:`guard_values` emits the check as ``Where(ok, y, y)`` marked with :data:`GUARD_ATTR` (a
  standard node, so ONNX shape inference still sees through it), and its converter turns ``ok``
  into a run-time shape check: inference on any other value stops with an error (an InputError
  from the artifact) instead of an answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["GUARD_ATTR", "MAX_ALTERNATIVES", "OWN_CONVERTERS", "guard_values", "guarded", "convert_guard"]

GUARD_ATTR = "fractal_expected_values"  # on a Where node: the values its condition checks (text)


def _bitcast(bb: Any, inputs: list[Any], attrs: dict[str, Any]) -> Any:
    from onnx import helper
    from tvm import topi

    dtype = str(helper.tensor_dtype_to_np_dtype(int(attrs["to"])))
    return bb.emit_te(topi.reinterpret, inputs[0], dtype)


OWN_CONVERTERS: dict[str, Callable[[Any, list[Any], dict[str, Any]], Any]] = {"BitCast": _bitcast}


MAX_ALTERNATIVES = 8  # values compiled side by side for one run-time operand


def _holds(bld: Any, values: dict[str, np.ndarray]) -> str:
    """bool scalar: every model input named in ``values`` holds exactly those values."""
    low = None
    for name, want in values.items():
        flat = np.asarray(want, np.int64).reshape(-1)
        have = bld.op("Reshape", [bld.op("Cast", [name], to=7), bld.const(np.array([-1], np.int64), "flat")])
        same = bld.op("Cast", [bld.op("Equal", [have, bld.const(flat, "want")])], to=7)
        one = bld.op("ReduceMin", [same], keepdims=0)  # all axes, whether axes is an attribute or input
        low = one if low is None else bld.op("Min", [low, one])
    return str(bld.op("Equal", [low, bld.const(np.array(1, np.int64), "one")]))


def guard_values(bld: Any, results: list[str], alternatives: list[dict[str, np.ndarray]], out: str) -> None:
    """``out`` = ``results[k]`` where the run-time inputs hold ``alternatives[k]`` (model input ->
    values); inference on any other values stops (``bld`` is a :class:`compiler.graphbuild.Builder`).
    No alternative holds a model input (all known at compile time): ``results[0]``, unchecked."""
    if not alternatives or not alternatives[0]:
        bld.op("Identity", [results[0]], out=out)
        return
    flags = [_holds(bld, alt) for alt in alternatives]
    picked = results[-1]
    for k in range(len(results) - 2, -1, -1):
        picked = bld.op("Where", [flags[k], results[k], picked])
    ok = flags[0]
    for f in flags[1:]:
        ok = bld.op("Or", [ok, f])
    text = " or ".join(", ".join(f"{k}={np.asarray(v).reshape(-1).tolist()}" for k, v in alt.items())
                       for alt in alternatives)
    bld.op("Where", [ok, picked, picked], out=out, **{GUARD_ATTR: text})


def guarded(node: Any) -> bool:
    """Whether ``node`` is a value guard of :func:`guard_values`."""
    return node.op_type == "Where" and any(a.name == GUARD_ATTR for a in node.attribute)


def convert_guard(bb: Any, inputs: list[Any], attrs: dict[str, Any]) -> Any:
    """The guard's Relax: ``y`` reshaped to its own dims, bound only when ``ok`` (else the VM raises)."""
    from tvm import relax

    from compiler.dynshape_ops import checked_shape, dims_of

    ok, data = inputs[0], inputs[1]
    bad = bb.normalize(relax.op.reshape(relax.op.astype(relax.op.logical_not(ok), "int64"), [1]))
    return relax.op.reshape(data, checked_shape(bb, dims_of(bb, data), bad, "guarded"))
