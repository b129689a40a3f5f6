"""``GET /v1/node`` (identity, model, parameters, round, sample count) and ``GET /metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import NodeDep

__all__ = ["router"]

router = APIRouter(tags=["node"])


@router.get("/v1/node", summary="Node status")
async def node_info(node: NodeDep) -> dict[str, Any]:
    """Node id, arch, model name and version, ``params_sha256``, current round, sample count."""
    return await run_in_threadpool(node.info)  # may read SQLite: keep it off the event loop


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
async def metrics(request: Request, node: NodeDep) -> Response:
    """HTTP metrics of this app followed by the node's own (inference, samples, rounds, loss)."""
    parts = [generate_latest(request.app.state.http_metrics.registry)]
    parts.append(generate_latest(node.registry))
    return Response(b"".join(parts), media_type=CONTENT_TYPE_LATEST)
