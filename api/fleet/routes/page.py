"""The dashboard page. ``/`` serves the dashboard when the request is authenticated, else the
login form; ``/?token=T`` (the link ``fractal swarm`` prints) logs in and moves on to ``/``
so the token leaves the address bar. Static assets (code, no data) are public.

The cookie is SameSite=Strict (as docs/operations.md says). The hop to ``/`` is a same-origin meta
refresh, not a 303: a Strict cookie is not sent along a redirect chain that started on
another site (a link clicked in a web mail), but it is sent by a navigation our page makes."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from api.fleet.auth import COOKIE, check_token, token_from

router = APIRouter(tags=["page"])

STATIC = Path(__file__).resolve().parents[2] / "static"
_HOP = ('<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="0;url=/">'
        '<title>fractal-edge fleet</title><a href="/">open the dashboard</a>')


@router.get("/", include_in_schema=False)
def index(request: Request) -> Response:
    query_token = request.query_params.get("token")
    if query_token is not None and check_token(request, query_token):
        resp = HTMLResponse(_HOP, headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})
        resp.set_cookie(COOKIE, query_token, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/")
        return resp
    if check_token(request, token_from(request)):
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})
    return FileResponse(STATIC / "login.html", headers={"Cache-Control": "no-store"})


@router.get("/login", include_in_schema=False)
def login_page() -> Response:
    return FileResponse(STATIC / "login.html", headers={"Cache-Control": "no-store"})
