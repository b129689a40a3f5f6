"""Read a request body, undoing ``Content-Encoding: gzip|deflate`` (tritonclient can send both).

The wire size is already bounded by :class:`api.middleware.BodyLimitMiddleware`; the decoded size
is bounded here too, so a small compressed bomb cannot expand past ``max_body_bytes``.
"""

from __future__ import annotations

import zlib

from fastapi import Request

from api.errors import ApiError

__all__ = ["read_body"]


async def read_body(request: Request) -> bytes:
    """The request body, decompressed if needed, at most ``app.state.max_body_bytes`` bytes."""
    body = await request.body()
    enc = request.headers.get("content-encoding", "identity").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc not in ("gzip", "deflate"):
        raise ApiError(415, f"unsupported Content-Encoding '{enc}' (use gzip, deflate or none)")
    limit = request.app.state.max_body_bytes
    d = zlib.decompressobj(wbits=31 if enc == "gzip" else 15)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ApiError(400, f"body is not valid {enc} data: {exc}") from exc
    if len(out) > limit or d.unconsumed_tail:
        raise ApiError(413, f"decompressed body exceeds the node's max_body_bytes ({limit})")
    if not d.eof:
        raise ApiError(400, f"{enc} body is truncated")
    return out
