"""POST /api/rounds, GET /api/rounds (paged), GET /api/rounds/{id}, GET /api/actions (paged)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from api.fleet.auth import Authenticated
from api.fleet.deps import Service
from api.fleet.history import ActionCursor
from api.fleet.rounds import RoundRejected, RoundRequest

router = APIRouter(prefix="/api", tags=["rounds"])

Limit = Annotated[int, Query(ge=1, le=500, description="page size")]


@router.post("/rounds", status_code=201)
def start_round(body: RoundRequest, _: Authenticated, fleet: Service) -> dict:
    """Start a training round among online nodes; 409 with the reason when the swarm cannot."""
    try:
        rnd = fleet.start_round(body)
    except RoundRejected as exc:
        raise HTTPException(exc.status_code, detail=exc.reason) from None
    return {"round_id": rnd["round_id"], "participants": rnd["participants"], "skipped": rnd["skipped"]}


@router.get("/rounds")
def list_rounds(_: Authenticated, fleet: Service, limit: Limit = 50,
                before: Annotated[float | None, Query(allow_inf_nan=False,
                                                      description="started_at cursor")] = None) -> dict:
    """Round history, newest first, ``limit`` per page; pass ``next_before`` as ``before`` for the next."""
    rounds = fleet.round_history(limit=limit, before=before)
    nxt = rounds[-1]["started_at"] if len(rounds) == limit else None
    return {"rounds": rounds, "next_before": nxt}


@router.get("/rounds/{round_id}")
def get_round(round_id: str, _: Authenticated, fleet: Service) -> dict:
    rnd = fleet.round_view(round_id)
    if rnd is None:
        raise HTTPException(404, detail=f"no round {round_id!r}")
    return rnd


@router.get("/actions")
def list_actions(_: Authenticated, fleet: Service, limit: Limit = 50,
                 before: Annotated[ActionCursor | None, Query(description="id cursor")] = None) -> dict:
    """The operator's actions (round starts, roll-backs), newest first."""
    actions = fleet.history.actions(limit, before)
    return {"actions": actions, "next_before": actions[-1]["id"] if len(actions) == limit else None}
