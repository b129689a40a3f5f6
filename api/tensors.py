"""Open Inference Protocol v2 tensor codec: request bytes -> numpy, numpy -> response bytes.

Parsed with ``json`` + ``numpy`` directly rather than pydantic: a pydantic model over a list of
thousands of floats costs more than the model itself on a small MLP, and the node's latency
budget is sub-millisecond. Every malformed request raises :class:`TensorError` whose message
names the problem (the route turns it into a 400 with the OIP ``{"error": ...}`` body).
Float inputs may hold NaN and infinities (binary data as sent; in JSON the tokens ``NaN``,
``Infinity``, ``-Infinity`` that Python's ``json`` and tritonclient write, and that replies carry):
inference takes IEEE values, as onnxruntime does. Samples and labels stay finite (api.routes).

Supports the JSON tensor form (``data`` flat or nested, row-major) and Triton's binary tensor
data extension (``Inference-Header-Content-Length`` header, ``binary_data_size`` /
``binary_data`` / ``binary_data_output`` parameters), which ``tritonclient.http`` uses by default.

The codec only *decodes*: each tensor becomes a numpy array of the datatype and shape the request
declares (data that does not fit its own declaration is a TensorError). Whether the tensors fit
the model (names, shapes, dtypes) is decided in one place for every caller,
``compiler.artifact.check_inputs``, behind ``node.infer`` (an InvalidInput, also a 400).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fractal.oip import (
    BYTES,
    DATATYPES,
    TensorError,
    as_int,
    check_shape,
    datatype_of,
    decode_bytes,
    decode_json_data,
    encode_bytes,
    json_tensor,
    loads,
)

__all__ = [
    "DATATYPES",
    "BatchTooLarge",
    "InferRequest",
    "TensorError",
    "datatype_of",
    "encode_response",
    "metadata_shape",
    "parse_infer_request",
]

# The datatype table and the decoder of one JSON tensor live in the shared base (the boot health
# check reads the node's replies with them); re-exported here under the names the node uses.
_loads = loads
_as_int = as_int
_check_shape = check_shape
_from_json_data = decode_json_data


class BatchTooLarge(TensorError):
    """A well-formed request whose batch exceeds the node's ``max_batch`` (-> HTTP 413: the
    request is too large for this server, like a body over ``max_body_bytes``)."""


@dataclass
class InferRequest:
    """A decoded inference request."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None = None                  # None = every model output
    binary: dict[str, bool] = field(default_factory=dict)  # output name -> send as binary


def metadata_shape(shape: Sequence[int | None | str], *, batched: bool = True) -> list[int]:
    """Model-metadata shape: the leading batch dim is variable (-1) when the model has one;
    symbolic dims are -1 too."""
    dims = [d if isinstance(d, int) and d >= 0 else -1 for d in shape]
    if dims and batched:
        dims[0] = -1
    return dims


def _parse_outputs(req: dict[str, Any], output_names: Sequence[str],
                   binary_default: bool) -> tuple[list[str] | None, dict[str, bool]]:
    outs = req.get("outputs")
    if outs is None:
        return None, {n: binary_default for n in output_names}
    if not isinstance(outs, list):
        raise TensorError("'outputs' must be a list of {\"name\": ...} objects")
    names: list[str] = []
    binary: dict[str, bool] = {}
    for o in outs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise TensorError("each requested output must be an object with a string 'name'")
        if o["name"] not in output_names:
            raise TensorError(f"unknown output '{o['name']}' (model outputs: {', '.join(output_names)})")
        params = o.get("parameters") or {}
        if not isinstance(params, dict):
            raise TensorError(f"output '{o['name']}': 'parameters' must be an object")
        if params.get("classification"):
            raise TensorError(f"output '{o['name']}': the classification extension is not supported "
                              "(request the raw output and take the top-k client-side)")
        names.append(o["name"])
        binary[o["name"]] = bool(params.get("binary_data", binary_default))
    return names, binary


def parse_infer_request(body: bytes, output_names: Sequence[str], header_length: str | None = None,
                        max_batch: int | None = None) -> InferRequest:
    """Decode an OIP v2 infer request body into arrays of the declared datatypes and shapes.

    ``header_length`` is the ``Inference-Header-Content-Length`` header (binary extension):
    the first that many bytes are the JSON header and the rest are the inputs' raw bytes.
    A declared batch over ``max_batch`` raises :class:`BatchTooLarge` before any data is decoded.
    """
    if header_length is not None:
        try:
            hlen = int(header_length)
        except ValueError as exc:
            raise TensorError("Inference-Header-Content-Length must be an integer") from exc
        if not 0 < hlen <= len(body):
            raise TensorError(f"Inference-Header-Content-Length {hlen} is outside the body "
                              f"({len(body)} bytes)")
        head, blob = body[:hlen], memoryview(body)[hlen:]
    else:
        head, blob = body, memoryview(b"")
    req = _loads(head, ieee=True)  # inference takes IEEE values (see compiler.artifact._convert)
    if not isinstance(req, dict):
        raise TensorError("request body must be a JSON object with an 'inputs' list")
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise TensorError("'id' must be a string")
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise TensorError("'parameters' must be an object")
    if "inputs" not in req:
        raise TensorError("missing 'inputs' (a list of tensors)")
    raw_inputs = req["inputs"]
    if not isinstance(raw_inputs, list):
        raise TensorError("'inputs' must be a list of tensors")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for t in raw_inputs:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise TensorError("each input must be an object with a string 'name'")
        name = t["name"]
        if name in inputs:
            raise TensorError(f"input '{name}' given twice")
        want_dt = t.get("datatype")
        if not isinstance(want_dt, str) or want_dt not in DATATYPES:
            raise TensorError(f"input '{name}': datatype {json.dumps(want_dt)[:40]} is not one of "
                              f"{', '.join(DATATYPES)}")
        dtype = DATATYPES[want_dt]
        dims = _check_shape(name, t.get("shape"))
        if max_batch is not None and dims[0] > max_batch:
            raise BatchTooLarge(f"input '{name}': batch {dims[0]} exceeds the node's max_batch "
                                f"({max_batch}); split the request into smaller batches")
        tparams = t.get("parameters") or {}
        if not isinstance(tparams, dict):
            raise TensorError(f"input '{name}': 'parameters' must be an object")
        size = tparams.get("binary_data_size")
        if size is not None:
            size = _as_int(size, f"input '{name}': binary_data_size")
            need = math.prod(dims) * dtype.itemsize
            if want_dt == BYTES:  # length-prefixed elements: the size is the sender's to give
                if size < 0 or offset + size > len(blob):
                    raise TensorError(f"input '{name}': binary data is truncated "
                                      f"(need {size} bytes at offset {offset}, have {len(blob) - offset})")
                inputs[name] = decode_bytes(name, blob[offset:offset + size], dims)
                offset += size
                continue
            if size != need:
                raise TensorError(f"input '{name}': binary_data_size {size} but shape {list(dims)} "
                                  f"of {want_dt} needs {need} bytes")
            if offset + size > len(blob):
                raise TensorError(f"input '{name}': binary data is truncated "
                                  f"(need {size} bytes at offset {offset}, have {len(blob) - offset})")
            arr = np.frombuffer(blob[offset:offset + size], dtype=dtype.newbyteorder("<")).reshape(dims)
            offset += size
            inputs[name] = arr.astype(dtype, copy=False)  # IEEE bits as sent, NaN and infinities too
        else:
            if "data" not in t:
                raise TensorError(f"input '{name}' has no 'data' (and no binary_data_size)")
            inputs[name] = _from_json_data(name, t["data"], dims, dtype, ieee=True)
    if offset != len(blob):
        raise TensorError(f"{len(blob) - offset} bytes of binary data after the inputs are unaccounted for")
    outs, binary = _parse_outputs(req, output_names, bool(params.get("binary_data_output", False)))
    return InferRequest(id=rid, inputs=inputs, outputs=outs, binary=binary)


def encode_response(model_name: str, model_version: str, request: InferRequest,
                    results: dict[str, np.ndarray]) -> tuple[bytes, int | None]:
    """Encode the OIP v2 infer response; returns (body, json header length or None if all-JSON)."""
    names = request.outputs if request.outputs is not None else list(results)
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name in names:
        arr = np.asarray(results[name])
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(arr.dtype), "shape": list(arr.shape)}
        if request.binary.get(name):
            raw = (encode_bytes(arr) if arr.dtype.kind == "O" else
                   np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = json_tensor(name, arr)["data"]
        outputs.append(entry)
    resp: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": outputs}
    if request.id is not None:
        resp["id"] = request.id
    head = json.dumps(resp, separators=(",", ":")).encode()
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)
