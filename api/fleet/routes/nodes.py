"""GET /api/nodes: the node table; POST /api/nodes/{id}/readmit: take a node left out back into rounds."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from api.fleet.auth import Authenticated
from api.fleet.deps import Service
from api.fleet.rounds import RoundRejected

router = APIRouter(prefix="/api", tags=["nodes"])


@router.get("/nodes")
def list_nodes(_: Authenticated, fleet: Service) -> dict:
    """Every node ever seen with its effective state (offline after Last Will or 1.5x keepalive),
    and the MQTT messages the fleet dropped, per reason (forged, unsigned, malformed, ...)."""
    return {"nodes": fleet.nodes(), "rejected": dict(fleet.rejected)}


@router.post("/nodes/{node_id}/readmit")
def readmit(node_id: str, _: Authenticated, fleet: Service) -> dict:
    """Take a node the fleet left out of rounds (its peers kept naming it as the cause of failed
    rounds: ``left_out`` in the node table) back into rounds; 409 when it is not left out."""
    try:
        return fleet.readmit(node_id)
    except RoundRejected as exc:
        raise HTTPException(exc.status_code, detail=exc.reason) from None
