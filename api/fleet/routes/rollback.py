"""POST /api/rollback (the operator's rollback), GET /api/rollback/{id}."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from api.fleet.auth import Authenticated
from api.fleet.deps import Service
from api.fleet.rollback import RollbackRequest
from api.fleet.rounds import RoundRejected

router = APIRouter(prefix="/api", tags=["rollback"])


@router.post("/rollback", status_code=202)
def start_rollback(body: RollbackRequest, _: Authenticated, fleet: Service) -> dict:
    """Return ``nodes`` (null: every online node) to parameter version ``to_version`` (null: the
    one before the newest among them), together; 409 with the reason when the swarm cannot.
    Accepted, not finished: follow it with GET /api/rollback/{id} or the event stream."""
    try:
        return fleet.rollback(body)
    except RoundRejected as exc:
        raise HTTPException(exc.status_code, detail=exc.reason) from None


@router.get("/rollback/{rollback_id}")
def get_rollback(rollback_id: str, _: Authenticated, fleet: Service) -> dict:
    rb = fleet.rollbacks.get(rollback_id)
    if rb is None:
        raise HTTPException(404, detail=f"no rollback {rollback_id!r} (recent ones are in GET /api/actions)")
    return rb
