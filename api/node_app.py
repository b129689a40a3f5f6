"""``create_node_app(node)``: the node's FastAPI app, wired from routers, middlewares and error handlers.

Routes live in :mod:`api.routes`, the tensor codec in :mod:`api.tensors`, model execution and
storage in :mod:`edgenode`. Middleware order (outermost first): metrics (so 401/413/500 are
counted too), internal-error body, bearer auth, body size limit.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api import __version__
from api.deps import NodeLike
from api.errors import error_response, install_error_handlers
from api.middleware import (
    BearerAuthMiddleware,
    BodyLimitMiddleware,
    BodyTimeoutMiddleware,
    HttpMetrics,
    InternalErrorMiddleware,
    MetricsMiddleware,
)
from api.routes import labels, oip, samples
from api.routes import node as node_routes
from api.tensors import BatchTooLarge

__all__ = ["create_node_app"]


def create_node_app(node: NodeLike, *, auth_token: str | None = None,
                    max_body_bytes: int | None = None, body_timeout_s: float = 30.0) -> FastAPI:
    """The HTTP app serving ``node``; auth token and body limit default to ``node.config``;
    a request body slower than ``body_timeout_s`` gets 408."""
    token = auth_token if auth_token is not None else node.config.auth_token
    # One default for the body limit: NodeConfig's (NODE.toml max_body_bytes).
    limit = int(max_body_bytes if max_body_bytes is not None else node.config.max_body_bytes)
    # FastAPI's native OpenTelemetry is off: the node exports Prometheus metrics (/metrics), and
    # the per-request "is OTel configured?" probes are pure overhead on a sub-millisecond path.
    app = FastAPI(title="fractal-edge node", version=__version__,
                  description="Open Inference Protocol v2, training samples, node status and metrics.",
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.node = node
    app.state.max_body_bytes = limit
    app.state.http_metrics = HttpMetrics()
    # Inference threads: TVM releases the GIL while it computes, so a few threads overlap requests.
    app.state.executor = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                            thread_name_prefix="infer")
    install_error_handlers(app)

    @app.exception_handler(BatchTooLarge)  # more specific than TensorError's 400: this one wins
    async def _batch_too_large(_: Request, exc: BatchTooLarge) -> JSONResponse:
        return error_response(413, str(exc))

    app.include_router(oip.router)
    app.include_router(samples.router)
    app.include_router(labels.router)
    app.include_router(node_routes.router)
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=limit)
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=body_timeout_s)
    if token:
        app.add_middleware(BearerAuthMiddleware, token=token)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=app.state.http_metrics)
    return app
