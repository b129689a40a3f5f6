"""``create_fleet_app(settings)``: the fleet service's FastAPI app (API + SSE + dashboard)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from api.fleet.images import ImageCatalogue
from api.fleet.routes import auth, events, images, nodes, page, rounds
from api.fleet.routes.page import STATIC
from api.fleet.service import FleetService, LinkFactory
from api.fleet.settings import FleetSettings

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

    app = FastAPI(title="fractal-edge fleet", version="1", lifespan=lifespan)
    app.state.settings = settings
    app.state.fleet = fleet
    app.state.stopping = asyncio.Event()
    images_dir, keys = settings.images_dir, settings.image_keys
    app.state.images = ImageCatalogue(images_dir, keys) if images_dir else None
    for r in (auth, nodes, rounds, images, events, page):
        app.include_router(r.router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_exception_handler(RequestValidationError, _validation_error)
    return app


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each bad field. The offending input is not echoed back: it may not even be
    JSON-serialisable (a bare ``Infinity`` body made FastAPI's default handler answer 500)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
              for e in errors]
    return JSONResponse({"detail": detail}, status_code=422)
