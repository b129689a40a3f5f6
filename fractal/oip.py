"""Open Inference Protocol v2 JSON tensors: the datatype table and the strict decoder of one tensor.

Shared by the node's request codec (``api.tensors``) and the boot health check
(``firmware.health``), which reads the node's reply: one table, one decoder, one set of
messages. Imports nothing of the project (this is the shared base, under every layer).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

__all__ = [
    "DATATYPES",
    "TensorError",
    "as_int",
    "check_shape",
    "datatype_of",
    "decode_json_data",
    "decode_json_tensor",
    "json_tensor",
    "loads",
    "BYTES",
    "encode_bytes",
    "decode_bytes",
]

# OIP datatype name <-> numpy dtype. BYTES (strings: a model's text inputs and outputs, run by the
# host stage) are object arrays of str (or of bytes, as received); BF16 has no numpy form.
BYTES = "BYTES"
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    BYTES: np.dtype(object),
}
_BY_DTYPE = {v: k for k, v in DATATYPES.items()}


class TensorError(ValueError):
    """A tensor (or the JSON around it) that does not decode to what it declares."""


def datatype_of(dtype: Any) -> str:
    """OIP datatype name of a numpy dtype (or dtype string such as ``"float32"``)."""
    try:
        return _BY_DTYPE[np.dtype(dtype)]
    except (KeyError, TypeError) as exc:
        raise TensorError(f"dtype {dtype} has no Open Inference Protocol datatype") from exc


def _reject_constant(token: str) -> Any:
    raise TensorError(f"non-finite number {token} in request JSON (NaN and Infinity are not allowed)")


def loads(raw: bytes | str, *, ieee: bool = False) -> Any:
    """Strict JSON: too deep nesting and bad UTF-8 are TensorErrors, and so are the tokens ``NaN``,
    ``Infinity`` and ``-Infinity`` unless ``ieee`` (an inference request: Python's ``json`` and
    tritonclient write non-finite floats so, and the node's replies carry them the same way)."""
    try:
        if ieee:
            return json.loads(raw)
        return json.loads(raw, parse_constant=_reject_constant)
    except TensorError:
        raise
    except RecursionError as exc:
        raise TensorError("malformed JSON: nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise TensorError(f"malformed JSON: {exc}") from exc


def as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TensorError(f"{what} must be an integer, got {json.dumps(value)[:40]}")
    return value


def check_shape(name: str, shape: Any, what: str = "input") -> tuple[int, ...]:
    """The declared shape: a non-empty list of non-negative integers (whether it fits the model is
    the validator's business)."""
    if not isinstance(shape, list) or not shape:
        raise TensorError(f"{what} '{name}': 'shape' must be a non-empty list of integers")
    dims = tuple(as_int(d, f"{what} '{name}': shape entry") for d in shape)
    if any(d < 0 for d in dims):
        raise TensorError(f"{what} '{name}': shape {list(dims)} has a negative dimension")
    return dims


def encode_bytes(arr: np.ndarray) -> bytes:
    """A BYTES tensor in the binary extension's form: each element (row-major) as a 4-byte
    little-endian length and its bytes (str as UTF-8)."""
    parts = []
    for v in np.asarray(arr, dtype=object).ravel().tolist():
        b = v.encode("utf-8") if isinstance(v, str) else bytes(v)
        parts += [len(b).to_bytes(4, "little"), b]
    return b"".join(parts)


def decode_bytes(name: str, raw: bytes | memoryview, dims: tuple[int, ...],
                 what: str = "input") -> np.ndarray:
    """The binary form of a BYTES tensor (:func:`encode_bytes`) as an object array of bytes of
    shape ``dims``; TensorError unless ``raw`` holds exactly that many elements."""
    raw = bytes(raw)
    count = math.prod(dims)
    out = np.empty(count, dtype=object)
    at = 0
    for i in range(count):
        if at + 4 > len(raw):
            raise TensorError(f"{what} '{name}': BYTES data ends before element {i} of {count}")
        size = int.from_bytes(raw[at:at + 4], "little")
        at += 4
        if at + size > len(raw):
            raise TensorError(f"{what} '{name}': BYTES element {i} claims {size} bytes, "
                              f"{len(raw) - at} are left")
        out[i] = raw[at:at + size]
        at += size
    if at != len(raw):
        raise TensorError(f"{what} '{name}': {len(raw) - at} bytes after the {count} BYTES elements of "
                          f"shape {list(dims)}")
    return out.reshape(dims)


def _strings(name: str, data: list[Any], dims: tuple[int, ...], what: str) -> np.ndarray:
    """JSON ``data`` of a BYTES tensor: strings only, flat or nested, as an object array of str."""
    flat: list[Any] = []
    stack = [data]
    while stack:  # row-major flattening; nesting is checked against dims by the count below
        top = stack.pop()
        if isinstance(top, list):
            stack.extend(reversed(top))
        elif isinstance(top, str):
            flat.append(top)
        else:
            raise TensorError(f"{what} '{name}': 'data' of a BYTES tensor must hold only strings")
    if len(flat) != math.prod(dims):
        raise TensorError(f"{what} '{name}': 'data' has {len(flat)} elements but shape {list(dims)} "
                          f"needs {math.prod(dims)}")
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(dims)


def decode_json_data(name: str, data: Any, dims: tuple[int, ...], dtype: np.dtype,
                     what: str = "input", *, ieee: bool = False) -> np.ndarray:
    """``data`` (flat or nested row-major) as an array of ``dtype`` and shape ``dims``, or TensorError.
    Float data must be finite unless ``ieee`` (inference: NaN and infinities are IEEE values the
    model's operators define); a finite number that overflows the datatype is refused either way
    (it has no value of that datatype: the client declared the wrong one). BYTES data are strings."""
    if not isinstance(data, list):
        raise TensorError(f"{what} '{name}': 'data' must be a list (flat or nested row-major)")
    if dtype.kind == "O":
        return _strings(name, data, dims, what)
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError) as exc:  # ragged nesting
        raise TensorError(f"{what} '{name}': 'data' is ragged or malformed: {exc}") from exc
    if arr.size == 0 and math.prod(dims) == 0:  # an empty tensor: no values, so no type to check
        return np.empty(dims, dtype)
    if arr.dtype.kind not in "biuf" or (arr.dtype.kind == "b") != (dtype.kind == "b"):
        raise TensorError(f"{what} '{name}': 'data' must hold only "
                          f"{'booleans' if dtype.kind == 'b' else 'numbers'}")
    if arr.size != math.prod(dims):
        raise TensorError(f"{what} '{name}': 'data' has {arr.size} elements but shape {list(dims)} "
                          f"needs {math.prod(dims)}")
    if dtype.kind == "f":
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(dtype, copy=False).reshape(dims)
        if not np.isfinite(out).all():
            if not ieee:
                raise TensorError(f"{what} '{name}': 'data' has non-finite values "
                                  f"(NaN, Infinity or out of {datatype_of(dtype)} range)")
            if (np.isfinite(arr.reshape(dims)) & ~np.isfinite(out)).any():
                raise TensorError(f"{what} '{name}': 'data' has numbers out of {datatype_of(dtype)} range")
        return out
    if dtype.kind in "iu":
        if arr.dtype.kind == "f":
            raise TensorError(f"{what} '{name}': 'data' must hold integers for {datatype_of(dtype)}")
        info = np.iinfo(dtype)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise TensorError(f"{what} '{name}': 'data' is out of {datatype_of(dtype)} range")
    return arr.astype(dtype).reshape(dims)


def decode_json_tensor(t: Any, what: str = "output") -> tuple[str, np.ndarray]:
    """One JSON tensor object ``{"name", "datatype", "shape", "data"}`` as (name, array)."""
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise TensorError(f"each {what} must be an object with a string 'name'")
    name = t["name"]
    dt = t.get("datatype")
    if not isinstance(dt, str) or dt not in DATATYPES:
        raise TensorError(f"{what} '{name}': datatype {json.dumps(dt)[:40]} is not one of "
                          f"{', '.join(DATATYPES)}")
    dims = check_shape(name, t.get("shape"), what)
    return name, decode_json_data(name, t.get("data"), dims, DATATYPES[dt], what)


def json_tensor(name: str, arr: np.ndarray) -> dict[str, Any]:
    """``arr`` as a JSON tensor object (the form a request's inputs and a reply's outputs take)."""
    a = np.asarray(arr)
    data = a.ravel().tolist()
    if a.dtype.kind == "O":  # BYTES: text (bytes that are not UTF-8 cannot be JSON)
        data = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in data]
    return {"name": name, "datatype": datatype_of(a.dtype), "shape": list(a.shape), "data": data}
