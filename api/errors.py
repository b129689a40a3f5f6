"""HTTP error mapping for the node app: every error body is the OIP form ``{"error": "..."}``.

Bad input is always a 4xx naming the problem; a 5xx means a bug in the node, never in the request.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from api.tensors import TensorError
from edgenode.errors import InvalidInput, NodeBusy, NodeError, StoreError

__all__ = ["ApiError", "error_response", "install_error_handlers", "install_common_handlers"]

log = logging.getLogger("fractal.api")


class ApiError(Exception):
    """An error with an HTTP status; the message names the problem."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The OIP error body ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _node_status(exc: NodeError) -> int:
    # Why these codes: InvalidInput is the client's fault (400); a busy node or a round in the way
    # is a conflict (409); a full store is a server condition the client can retry later (507).
    if isinstance(exc, InvalidInput):
        return 400
    if isinstance(exc, NodeBusy):
        return 409
    if isinstance(exc, StoreError):
        return 507
    return 400


def install_error_handlers(app: FastAPI) -> None:
    """Map ApiError, TensorError, NodeError, HTTP and validation errors to ``{"error": ...}``."""

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(TensorError)
    async def _tensor(_: Request, exc: TensorError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(NodeError)
    async def _node(_: Request, exc: NodeError) -> JSONResponse:
        msg = str(exc) + (f" (help: {exc.hint})" if getattr(exc, "hint", None) else "")
        return error_response(_node_status(exc), msg)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> JSONResponse:
        # Nobody is left to read this; answering keeps the disconnect out of the error log.
        return error_response(400, "client disconnected before sending the whole body")

    install_common_handlers(app)


def install_common_handlers(app: FastAPI) -> None:
    """The error body both apps (node and fleet) share: ``{"error": "..."}`` for HTTP errors and
    for 422s, which name each bad field without echoing the input (it may not even be JSON)."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return error_response(422, "invalid request: " + "; ".join(parts))
