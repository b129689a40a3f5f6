"""The dashboard page. ``/`` serves the dashboard when the request is authenticated, else the
login form; ``/?token=T`` (the link ``fractal swarm`` prints) logs in and redirects to ``/``
so the token leaves the address bar. Static assets (code, no data) are public."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from api.fleet.auth import COOKIE, check_token, token_from

router = APIRouter(tags=["page"])

STATIC = Path(__file__).resolve().parents[2] / "static"


@router.get("/", include_in_schema=False)
def index(request: Request) -> Response:
    query_token = request.query_params.get("token")
    if query_token is not None and check_token(request, query_token):
        resp = RedirectResponse("/", status_code=303)
        resp.set_cookie(COOKIE, query_token, httponly=True, samesite="lax",
                        secure=request.url.scheme == "https", path="/")
        return resp
    if check_token(request, token_from(request)):
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})
    return FileResponse(STATIC / "login.html", headers={"Cache-Control": "no-store"})


@router.get("/login", include_in_schema=False)
def login_page() -> Response:
    return FileResponse(STATIC / "login.html", headers={"Cache-Control": "no-store"})
