"""``create_fleet_app(settings)``: the fleet service's FastAPI app (API + SSE + dashboard)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from api.errors import error_response, install_common_handlers
from api.fleet.errors import StoreUnavailable
from api.fleet.gate import FleetAuthGate, FollowerGate, body_limit
from api.fleet.routes import (
    asyncrounds,
    auth,
    autorounds,
    enrollment,
    events,
    images,
    nodes,
    page,
    rollback,
    rollouts,
    rounds,
)
from api.fleet.routes.page import STATIC
from api.fleet.service import FleetService, LinkFactory
from api.fleet.settings import FleetSettings
from api.middleware import BodyLimitMiddleware, BodyTimeoutMiddleware

__all__ = ["create_fleet_app"]


def create_fleet_app(settings: FleetSettings, *, link_factory: LinkFactory | None = None) -> FastAPI:
    """Build the app; the MQTT connection opens at startup and closes at shutdown."""
    if not settings.token:
        raise ValueError("the fleet service needs an operator token (--token or FRACTAL_FLEET_TOKEN)")
    fleet = FleetService(settings, link_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.stopping = asyncio.Event()
        if not fleet.connected:  # serve_fleet connects first so a bad broker URL is a clear error
            fleet.start()
        try:
            yield
        finally:
            app.state.stopping.set()
            fleet.stop()

    # No /docs, /redoc or /openapi.json: the fleet's API is documented in docs/operations.md, and
    # an unauthenticated schema only helps an attacker map the service.
    app = FastAPI(title="fractal-edge fleet", version="1", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.fleet = fleet
    app.state.stopping = asyncio.Event()
    for r in (auth, nodes, rounds, autorounds, asyncrounds, rollback, images, rollouts, enrollment, events,
              page):
        app.include_router(r.router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    install_common_handlers(app)  # error bodies are {"error": ...}, as on the node

    @app.exception_handler(StoreUnavailable)
    async def _store_down(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return error_response(503, f"{exc} ({exc.hint})" if exc.hint else str(exc),
                              headers={"Retry-After": "5"})

    # add_middleware wraps: the last added is the outermost. Token first (401), then the route's
    # body limit (413), both before a byte of the body is read; then slow bodies (408); then a
    # follower's 503 to writes (api/fleet/leadership.py).
    app.add_middleware(FollowerGate, leader=lambda: fleet.leader_address())
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=30.0)
    app.add_middleware(BodyLimitMiddleware, max_bytes=body_limit, name="the route's body limit")
    app.add_middleware(FleetAuthGate, token=settings.token)
    return app
