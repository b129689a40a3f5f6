"""GET /api/nodes: the node table."""

from __future__ import annotations

from fastapi import APIRouter

from api.fleet.auth import Authenticated
from api.fleet.deps import Service

router = APIRouter(prefix="/api", tags=["nodes"])


@router.get("/nodes")
def list_nodes(_: Authenticated, fleet: Service) -> dict:
    """Every node ever seen with its effective state (offline after Last Will or 1.5x keepalive),
    and the MQTT messages the fleet dropped, per reason (forged, unsigned, malformed, ...)."""
    return {"nodes": fleet.nodes(), "rejected": dict(fleet.rejected)}
