"""``POST /v1/samples``: sensor samples for on-device training, stored durably before 2xx.

Labels are required, except for an anomaly model (edgenode/anomaly.py), which learns from
unlabelled samples; the response carries the stored samples' ids for ``POST /v1/labels``."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from api.body import read_body
from api.deps import NodeDep, NodeLike
from api.errors import ApiError
from api.tensors import _loads  # same strict JSON (no NaN/Infinity) as the infer route

__all__ = ["router", "parse_samples"]

router = APIRouter(prefix="/v1", tags=["samples"])

_ERROR = {"content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}}}}
_BODY = {
    "required": True,
    "content": {"application/json": {"schema": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "inputs": {"type": "object", "additionalProperties": {"type": "array"},
                       "description": "INPUT_NAME -> list of samples, each shaped like the input "
                                      "without its batch dimension"},
            "labels": {"type": "array", "description": "one label per sample (optional for anomaly "
                                                         "models: unlabelled samples)"},
        },
    }}},
}


def _bad(msg: str) -> ApiError:
    return ApiError(400, msg)


def _samples_array(name: str, value: Any) -> np.ndarray:
    """Decode one input's JSON samples into a number array (the store checks it fits the model)."""
    if not isinstance(value, list) or not value:
        raise _bad(f"inputs.{name} must be a non-empty list of samples")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise _bad(f"inputs.{name}: samples are ragged or malformed: {exc}") from exc
    if arr.dtype.kind not in "iuf":
        raise _bad(f"inputs.{name}: samples must hold only numbers")
    return arr


def _labels_array(value: Any, count: int) -> np.ndarray:
    if not isinstance(value, list):
        raise _bad("'labels' must be a list with one label per sample")
    if len(value) != count:
        raise _bad(f"label count mismatch: {len(value)} labels for {count} samples")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise _bad(f"labels are ragged or malformed: {exc}") from exc
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind != "f":
        raise _bad("labels must be numbers (class ids) or lists of numbers (regression targets)")
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(np.float32)
    if not np.isfinite(out).all():
        raise _bad("labels have non-finite values")
    return out


def parse_samples(body: bytes, node: NodeLike) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Decode a samples body into arrays; whether they fit the model (names, shapes, dtypes, finite
    values) is the sample store's one check (``edgenode.store.SampleStore.validate``)."""
    try:
        req = _loads(body)
    except ValueError as exc:
        raise _bad(str(exc)) from exc
    if not isinstance(req, dict):
        raise _bad('body must be a JSON object {"inputs": {...}, "labels": [...]}')
    inputs = req.get("inputs")
    if not isinstance(inputs, dict) or not inputs:
        raise _bad("'inputs' must be an object mapping input names to lists of samples")
    arrays = {str(n): _samples_array(str(n), v) for n, v in inputs.items()}
    counts = {len(a) for a in arrays.values()}
    if len(counts) > 1:
        raise _bad(f"inputs disagree on the number of samples: {sorted(counts)}")
    if "labels" not in req:
        if node.labels_optional:
            return arrays, None
        raise _bad("missing 'labels' (only an anomaly model takes samples without labels)")
    return arrays, _labels_array(req["labels"], counts.pop())


def _store(node: NodeLike, body: bytes) -> dict[str, Any]:
    arrays, labels = parse_samples(body, node)
    ids, count = node.insert_samples(arrays, labels)  # once the store committed
    return {"stored": len(ids), "sample_count": int(count), "ids": ids}


@router.post("/samples", summary="Store labelled samples", openapi_extra={"requestBody": _BODY},
             responses={400: _ERROR, 413: _ERROR})
async def post_samples(request: Request, node: NodeDep) -> dict[str, Any]:
    """Store samples durably (committed before this returns) for the next training round."""
    body = await read_body(request)
    return await run_in_threadpool(_store, node, body)
