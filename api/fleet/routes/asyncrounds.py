"""GET /api/async: the asynchronous rounds' versions (federation/PROTOCOL.md section 13)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from api.fleet.auth import Authenticated
from api.fleet.deps import Service

router = APIRouter(prefix="/api", tags=["async"])


@router.get("/async")
def get_async(_: Authenticated, fleet: Service) -> dict:
    """The current global version (number, sha256), the buffer's fill and bounds, the refused
    updates by reason and the recent versions with their contributors; 404 when this fleet does
    not aggregate asynchronous rounds, 503 (with the leader's URL) on a following fleet process."""
    if fleet.aggregator is None and fleet.settings.async_params:
        leader = fleet.leader_address()[1]
        raise HTTPException(503, detail=f"this fleet process follows; the leading one aggregates: {leader}")
    if fleet.aggregator is None:
        raise HTTPException(404, detail="this swarm runs no asynchronous rounds (start the fleet with "
                                        "async_params: FRACTAL_FLEET_ASYNC_PARAMS or --async-params)")
    return fleet.aggregator.status()
