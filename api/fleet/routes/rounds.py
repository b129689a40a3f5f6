"""POST /api/rounds, GET /api/rounds, GET /api/rounds/{id}."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from api.fleet.auth import Authenticated
from api.fleet.deps import Service
from api.fleet.rounds import RoundRejected, RoundRequest

router = APIRouter(prefix="/api", tags=["rounds"])


@router.post("/rounds", status_code=201)
def start_round(body: RoundRequest, _: Authenticated, fleet: Service) -> dict:
    """Start a training round among online nodes; 409 with the reason when the swarm cannot."""
    try:
        rnd = fleet.start_round(body)
    except RoundRejected as exc:
        raise HTTPException(exc.status_code, detail=exc.reason) from None
    return {"round_id": rnd["round_id"], "participants": rnd["participants"], "skipped": rnd["skipped"]}


@router.get("/rounds")
def list_rounds(_: Authenticated, fleet: Service) -> dict:
    """Round history, newest first."""
    return {"rounds": fleet.rounds.history()}


@router.get("/rounds/{round_id}")
def get_round(round_id: str, _: Authenticated, fleet: Service) -> dict:
    rnd = fleet.rounds.get(round_id)
    if rnd is None:
        raise HTTPException(404, detail=f"no round {round_id!r} (the fleet keeps the last "
                                        f"{fleet.settings.history} rounds)")
    return rnd
