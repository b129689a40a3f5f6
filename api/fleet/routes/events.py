"""GET /api/events: Server-Sent Events of node and round changes.

The stream opens with one ``snapshot`` event (nodes + round history), then ``node`` and
``round`` events as they happen, and a comment line every 15 s so proxies keep it open.
``EventSource`` cannot send headers: authenticate with the login cookie or ``?token=``.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from api.fleet.auth import Authenticated
from api.fleet.deps import Service
from api.fleet.events import EventType, json_safe

router = APIRouter(prefix="/api", tags=["events"])

KEEPALIVE_S = 15.0


def _frame(kind: str, data: str) -> str:
    return f"event: {kind}\ndata: {data}\n\n"


@router.get("/events")
async def events(request: Request, _: Authenticated, fleet: Service) -> StreamingResponse:
    sub = fleet.bus.subscribe()
    stopping: asyncio.Event = request.app.state.stopping

    async def stream():
        idle = 0.0
        try:
            snap = json.dumps(json_safe(fleet.snapshot()), allow_nan=False)
            yield "retry: 2000\n\n" + _frame(EventType.SNAPSHOT.value, snap)
            while not stopping.is_set():
                item = await sub.get(timeout=1.0)
                if item is None:
                    if await request.is_disconnected():
                        break
                    idle += 1.0
                    if idle >= KEEPALIVE_S:
                        idle = 0.0
                        yield ": keepalive\n\n"
                    continue
                idle = 0.0
                yield _frame(*item)
        finally:
            fleet.bus.unsubscribe(sub)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
