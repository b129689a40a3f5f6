"""``POST /v1/labels``: labels that arrive after their samples (by sample ids or a time range).

Body: ``{"label": L, "ids": [id, ...]}`` or ``{"label": L, "since": T0, "until": T1}`` (unix
seconds, ``since`` inclusive, ``until`` exclusive; either may be left out). ``L`` is a class id
for a classifier, a target for a regression model, 0 (normal) / 1 (anomalous) for an anomaly model.
Answers ``{"labelled": n}``, the number of stored samples that got the label.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from api.body import read_body
from api.deps import NodeDep, NodeLike
from api.errors import ApiError
from api.tensors import _loads

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["samples"])

_MAX_IDS = 100_000
_ERROR = {"content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}}}}
_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["label"],
    "properties": {
        "label": {"description": "class id, target, or 0/1 anomaly flag"},
        "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": _MAX_IDS},
        "since": {"type": "number"}, "until": {"type": "number"},
    }}}}}


def _time(req: dict[str, Any], key: str) -> float | None:
    v = req.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ApiError(400, f"'{key}' must be a time in unix seconds")
    return float(v)


def _label(node: NodeLike, body: bytes) -> dict[str, Any]:
    try:
        req = _loads(body)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    if not isinstance(req, dict) or "label" not in req:
        raise ApiError(400, 'body must be {"label": ..., "ids": [...]} or {"label": ..., "since": t0, '
                            '"until": t1}')
    extra = sorted(set(req) - {"label", "ids", "since", "until"})
    if extra:
        raise ApiError(400, f"unknown key {extra[0]!r}")
    ids = req.get("ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > _MAX_IDS or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 < i < 2**63 for i in ids):
            raise ApiError(400, f"'ids' must be a list of at most {_MAX_IDS} sample ids (positive integers)")
    since, until = _time(req, "since"), _time(req, "until")
    if ids is not None and (since is not None or until is not None):
        raise ApiError(400, "give either 'ids' or 'since'/'until', not both")
    if ids is None and since is None and until is None:
        raise ApiError(400, "give 'ids' or a time range ('since'/'until')")
    label = req["label"]
    if isinstance(label, bool) or not isinstance(label, (int, float, list)):
        raise ApiError(400, "'label' must be a number (or a list of numbers for a regression target)")
    return {"labelled": node.set_labels(label, ids=ids, since=since, until=until)}


@router.post("/labels", summary="Label stored samples", openapi_extra={"requestBody": _BODY},
             responses={400: _ERROR, 413: _ERROR})
async def post_labels(request: Request, node: NodeDep) -> dict[str, Any]:
    """Give stored samples a label that arrived later (durable before this returns)."""
    body = await read_body(request)
    return await run_in_threadpool(_label, node, body)
