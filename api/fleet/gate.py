"""The fleet's front door: who may send a body, and how large (pure ASGI, outside every route).

FastAPI reads and parses a request's body before it resolves the route's dependencies, so a
token check in a dependency comes too late: an anonymous 768 MiB POST was read whole, and the
memory never came back. Here, before a byte of the body is read:

* :class:`FleetAuthGate` answers 401 to a request without the operator token (header, login
  cookie or ``?token=``), except on the open routes: health, login, the pages and static files,
  and image downloads (``GET /api/images/{id}``, which check a node's grant themselves);
* :class:`FollowerGate` answers 503 with the leader's address to a write sent to a follower
  (a fleet process on PostgreSQL that does not lead, api/fleet/leadership.py);
* :func:`body_limit` sizes each route's body limit for :class:`api.middleware.BodyLimitMiddleware`
  (413): tiny for login and the other open routes, small for the operator's JSON requests, the
  image size limit for an image upload (streamed to disk, never held in memory).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from starlette.requests import HTTPConnection

from api.fleet.auth import token_from
from api.middleware import ASGIApp, Receive, Scope, Send, send_error
from firmware.image import MAX_IMAGE

__all__ = ["FleetAuthGate", "FollowerGate", "body_limit", "is_open", "LOGIN_MAX_BYTES", "JSON_MAX_BYTES",
           "UPLOAD_MAX_BYTES"]

LOGIN_MAX_BYTES = 16 * 1024  # {"token": ...} with a token of at most 4,096 characters
JSON_MAX_BYTES = 256 * 1024  # rounds, rollbacks, roll-outs: at most 1,024 node ids of 64 characters
UPLOAD_MAX_BYTES = MAX_IMAGE  # POST /api/images: the image size limit (streamed to a file)

_OPEN = frozenset({"/", "/login", "/api/health", "/api/login"})


def is_open(method: str, path: str) -> bool:
    """May this request come without the operator token?"""
    if path in _OPEN or path.startswith("/static/"):
        return True
    if method == "POST" and (path == "/api/enroll" or (path.startswith("/api/enroll/")
                                                       and path.endswith("/status"))):
        return True  # a device's enrolment: its token and key proofs are checked by the route
    # a node's download: the route checks its grant (or the token) itself; no body
    return method in ("GET", "HEAD") and path.startswith("/api/images/")


def body_limit(scope: Scope) -> int:
    """The largest body a request to this route may carry (bytes)."""
    method, path = scope.get("method", ""), scope.get("path", "")
    if method == "POST" and path == "/api/images":
        return UPLOAD_MAX_BYTES
    if is_open(method, path):
        return LOGIN_MAX_BYTES
    return JSON_MAX_BYTES


class FleetAuthGate:
    """401 before the body is read, unless the route is open or the request carries the token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        if not token:
            raise ValueError("the fleet's auth gate needs the operator token")
        self.app = app
        self._expected = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        presented = token_from(HTTPConnection(scope))
        if presented is None or not secrets.compare_digest(presented.encode(), self._expected):
            await send_error(send, 401, "missing or wrong operator token: send 'Authorization: Bearer "
                                        "TOKEN' (or log in at /login)",
                             [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


_READS = frozenset({"GET", "HEAD", "OPTIONS"})


class FollowerGate:
    """A follower serves reads; a write (any other method but login) gets 503 and the leader's URL.

    503, not a redirect: the operator's token or cookie belongs to the request's origin, and the
    client (the dashboard, a script) should choose to resend to the leader. The body says where:
    ``{"error": ..., "leader": URL or null}``, also in the ``X-Fractal-Leader`` header.
    ``leader()``: (does this process lead, the leader's URL or None)."""

    def __init__(self, app: ASGIApp, leader: Callable[[], tuple[bool, str | None]]) -> None:
        self.app = app
        self._leader = leader

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _READS or scope["path"] == "/api/login":
            await self.app(scope, receive, send)
            return
        leading, url = self._leader()
        if leading:
            await self.app(scope, receive, send)
            return
        where = f"the leader at {url}" if url else "the leading fleet process (none leads right now)"
        body = json.dumps({"error": f"this fleet process follows and does not accept changes: send them to "
                                    f"{where}", "leader": url}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"retry-after", b"1"), (b"connection", b"close")]
        if url:
            headers.append((b"x-fractal-leader", url.encode()))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
