"""Relax converters of the project's own (issue 29); :mod:`compiler.dynshape`'s importer tries
them before TVM's:

* BitCast (opset 26; TVM has no converter): the same bits read as another type of the same width,
  ``topi.reinterpret`` (no ONNX operator reinterprets a float as an integer). Bool, which has no
  fixed bit layout in the compiled code, is refused before import (:mod:`compiler.importer`).
* Value guards. A rewrite that needs a shape operand given as a model input (Col2Im's
  ``image_shape``, STFT's ``frame_step``, ...) may take the only value the model's static shapes
  allow, provided the input is checked at run time: :func:`guard_values` emits the check as
  ``Where(ok, y, y)`` marked with :data:`GUARD_ATTR` (a standard node, so ONNX shape inference
  still sees through it), and its converter turns ``ok`` into a run-time shape check: inference on
  any other value stops with an error (an InputError from the artifact) instead of an answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["GUARD_ATTR", "OWN_CONVERTERS", "guard_values", "guarded", "convert_guard"]

GUARD_ATTR = "fractal_expected_values"  # on a Where node: the values its condition checks (text)


def _bitcast(bb: Any, inputs: list[Any], attrs: dict[str, Any]) -> Any:
    from onnx import helper
    from tvm import topi

    dtype = str(helper.tensor_dtype_to_np_dtype(int(attrs["to"])))
    return bb.emit_te(topi.reinterpret, inputs[0], dtype)


OWN_CONVERTERS: dict[str, Callable[[Any, list[Any], dict[str, Any]], Any]] = {"BitCast": _bitcast}


def guard_values(bld: Any, data: str, expected: dict[str, np.ndarray], out: str) -> None:
    """``out`` = ``data`` once every model input named in ``expected`` holds exactly those values
    (checked at run time; ``bld`` is a :class:`compiler.graphbuild.Builder`)."""
    flags = []
    for name, values in expected.items():
        want = np.asarray(values, np.int64).reshape(-1)
        have = bld.op("Reshape", [bld.op("Cast", [name], to=7), bld.const(np.array([-1], np.int64), "flat")])
        same = bld.op("Cast", [bld.op("Equal", [have, bld.const(want, "want")])], to=7)
        flags.append(bld.op("ReduceMin", [same], keepdims=0))  # axes attribute or input: all axes either way
    low = flags[0]
    for f in flags[1:]:
        low = bld.op("Min", [low, f])
    ok = bld.op("Equal", [low, bld.const(np.array(1, np.int64), "one")])
    text = ", ".join(f"{k}={np.asarray(v).reshape(-1).tolist()}" for k, v in expected.items())
    bld.op("Where", [ok, data, data], out=out, **{GUARD_ATTR: text})


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
