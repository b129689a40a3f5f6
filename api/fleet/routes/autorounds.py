"""GET/PUT /api/auto-rounds: the policy by which the fleet starts rounds by itself."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from api.fleet.auth import Authenticated
from api.fleet.autorounds import AutoRoundPolicy
from api.fleet.deps import Service
from api.fleet.operations import RoundRejected

router = APIRouter(prefix="/api", tags=["auto-rounds"])


@router.get("/auto-rounds")
def get_auto_rounds(_: Authenticated, fleet: Service) -> dict:
    """``{"policy": ..., "status": ...}``: the policy and where its triggers stand (next due time,
    the participants' new samples against the threshold, what waits and why)."""
    return fleet.auto_view()


@router.put("/auto-rounds")
def put_auto_rounds(body: AutoRoundPolicy, _: Authenticated, fleet: Service) -> dict:
    """Replace the policy (one JSON object; 422 on a value out of bounds); answers as GET."""
    try:
        return fleet.set_auto_policy(body)
    except RoundRejected as exc:
        raise HTTPException(exc.status_code, detail=exc.reason) from None
