"""Operator-token authentication for the fleet API.

A request is authenticated by any one of:

* ``Authorization: Bearer TOKEN`` (scripts, curl);
* the ``fractal_fleet_token`` cookie (HttpOnly, SameSite=Strict) that ``POST /api/login`` sets,
  so the dashboard's ``EventSource`` (which cannot send headers) is authenticated too;
* ``?token=TOKEN`` in the query string (a link the swarm prints; the dashboard page swaps it
  for the cookie and drops it from the address bar).

Everything except ``/api/health``, login and the pages needs one; anything else is a 401, given
by :class:`api.fleet.gate.FleetAuthGate` before the body is read (the dependency below stays as
a second check on every operator route).
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from starlette.requests import HTTPConnection

__all__ = ["COOKIE", "token_from", "check_token", "require_token", "Authenticated"]

COOKIE = "fractal_fleet_token"


def token_from(request: HTTPConnection) -> str | None:
    """The token a request presents, header first, then cookie, then query (reads no body)."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(COOKIE) or request.query_params.get("token")


def check_token(request: Request, presented: str | None) -> bool:
    expected: str = request.app.state.settings.token
    if not presented:
        return False
    return secrets.compare_digest(presented.encode(), expected.encode())


def require_token(request: Request) -> None:
    """FastAPI dependency: 401 unless the request carries the operator token."""
    if not check_token(request, token_from(request)):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing or wrong operator token: send 'Authorization: Bearer TOKEN' "
                   "(or log in at /login)",
            headers={"WWW-Authenticate": "Bearer"},
        )


Authenticated = Annotated[None, Depends(require_token)]
