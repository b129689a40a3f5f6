"""Pure-ASGI middlewares of the node app: body size limit, bearer-token auth, HTTP metrics.

Pure ASGI (not ``BaseHTTPMiddleware``) because they sit on the inference hot path: each one is
a couple of dict lookups per request, with no extra task or body copy.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["BodyLimitMiddleware", "BodyTimeoutMiddleware", "BearerAuthMiddleware", "InternalErrorMiddleware",
           "MetricsMiddleware", "HttpMetrics", "BodyTooLarge", "BodyTooSlow", "send_error"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("fractal.api")

# Health stays open without a token: orchestrators and load balancers probe it anonymously.
OPEN_PREFIX = "/v2/health/"


async def send_error(send: Send, status: int, message: str,
                      headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class _TrackingSend:
    """``send`` that remembers whether the response has started (after that, an error can only
    drop the connection: no status line can be sent any more)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class BodyTooLarge(Exception):
    """Raised from ``receive`` once the streamed body passes the limit (caught by the middleware)."""


class BodyLimitMiddleware:
    """Reject bodies larger than ``max_bytes`` (bytes, or a function of the request's scope) with
    413 without reading them into memory.

    A declared ``Content-Length`` over the limit is refused before a single body byte is read.
    A chunked (or lying) body is counted as it streams through ``receive``; the first chunk that
    passes the limit aborts the request, so at most ``max_bytes`` + one chunk is ever buffered.
    The connection is closed afterwards (the rest of the body is never read).
    """

    def __init__(self, app: ASGIApp, max_bytes: int | Callable[[Scope], int],
                 name: str = "the node's max_body_bytes") -> None:
        self.app = app
        # an int, or a function of the request's scope (the fleet sizes the limit per route)
        if callable(max_bytes):
            self.limit_for = max_bytes
        else:
            fixed = int(max_bytes)

            def constant(_scope: Scope) -> int:
                return fixed

            self.limit_for = constant
        self.name = name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        for key, value in scope["headers"]:
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await send_error(send, 400, "Content-Length is not an integer")
                    return
                if declared > limit:
                    await send_error(send, 413, f"request body of {declared} bytes exceeds "
                                                 f"{self.name} ({limit})")
                    return
                break
        seen = 0
        tripped = False  # the limit was passed: whatever the app answers then, the answer is 413
        replaced = False
        tracking_send = _TrackingSend(send)

        def too_large() -> str:
            return f"request body exceeds {self.name} ({limit}); stopped reading after {seen} bytes"

        async def limited_receive() -> Message:
            nonlocal seen, tripped
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    tripped = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            # A framework may catch BodyTooLarge itself (FastAPI turns any error while it parses
            # a body into "400 There was an error parsing the body"): the 413 replaces that answer.
            nonlocal replaced
            if tripped and not tracking_send.started:
                if message["type"] == "http.response.start":
                    replaced = True
                    await send_error(tracking_send, 413, too_large())
                return
            if replaced:
                return
            await tracking_send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyTooLarge:
            if tracking_send.started:  # nothing sane left to say on this connection
                if replaced:
                    return
                raise
            await send_error(send, 413, too_large())


class BodyTooSlow(Exception):
    """Raised from ``receive`` when the request body does not arrive in time."""


class BodyTimeoutMiddleware:
    """A request body must arrive within ``timeout_s`` (from the first ``receive``): a client
    that trickles bytes (slowloris) gets 408 and the connection is closed, instead of holding a
    worker forever. Only the body is timed: after it, ``receive`` waits for the disconnect of a
    long response (the fleet's event stream) untimed.
    """

    def __init__(self, app: ASGIApp, timeout_s: float = 30.0) -> None:
        self.app = app
        self.timeout_s = float(timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        body_done = False
        tracking_send = _TrackingSend(send)

        async def timed_receive() -> Message:
            nonlocal deadline, body_done
            if body_done:
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise BodyTooSlow() from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        try:
            await self.app(scope, timed_receive, tracking_send)
        except BodyTooSlow:
            if tracking_send.started:
                raise
            await send_error(send, 408, f"request body did not arrive within {self.timeout_s:g} s")


class InternalErrorMiddleware:
    """A bug in the node becomes a logged, JSON ``500 {"error": ...}`` and the server keeps going.

    Starlette's own handler for ``Exception`` re-raises after answering, which makes uvicorn drop
    the keep-alive connection; catching here (inside Starlette's outermost layer) does not.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracking_send = _TrackingSend(send)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if tracking_send.started:
                raise
            body = json.dumps({"error": f"internal error: {type(exc).__name__}"}).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


class BearerAuthMiddleware:
    """With a token configured, every route but ``/v2/health/*`` needs ``Authorization: Bearer TOKEN``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PREFIX):
            await self.app(scope, receive, send)
            return
        got = b""
        for key, value in scope["headers"]:
            if key == b"authorization":
                got = value
                break
        if not hmac.compare_digest(got, self.expected):  # constant time: no token-guessing oracle
            reason = "missing bearer token" if not got else "invalid bearer token"
            await send_error(send, 401, f"{reason}: send 'Authorization: Bearer <auth_token>'",
                              [(b"www-authenticate", b'Bearer realm="fractal-node"')])
            return
        await self.app(scope, receive, send)


# Sub-millisecond buckets: the node's inference latency budget is ~1 ms for small models.
_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class HttpMetrics:
    """Per-route request counts and latency histograms in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("fractal_http_requests_total", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("fractal_http_request_duration_seconds", "HTTP request latency by route",
                                 ["method", "route"], buckets=_BUCKETS, registry=self.registry)


class MetricsMiddleware:
    """Counts every request (401s and 413s included) under its route template, not the raw path."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            # Unmatched paths share one label so random URLs cannot blow up the label set.
            label = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.latency.labels(method, label).observe(time.perf_counter() - t0)
            self.metrics.requests.labels(method, label, str(status)).inc()
