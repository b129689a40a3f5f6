"""Image roll-outs: POST /api/rollouts (canary first, then the rest), GET /api/rollouts[/{id}],
and POST /api/image-rollback (nodes back to their previous good slot; /api/rollback is for
parameter versions)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from api.fleet.auth import Authenticated
from api.fleet.deps import Service
from api.fleet.rollouts import ImageRollbackRequest, RolloutRequest
from api.fleet.rounds import RoundRejected

router = APIRouter(prefix="/api", tags=["rollouts"])


@router.post("/rollouts", status_code=202)
def start_rollout(body: RolloutRequest, request: Request, _: Authenticated, fleet: Service) -> dict:
    """Roll catalogue image ``image`` out to ``nodes``: ``nodes[0]`` is the canary, the others
    follow once it passed its health check; stops at the first failure. 404 unknown image or
    node, 409 with the reason when not possible now. Follow it with GET /api/rollouts/{id}."""
    try:
        return fleet.start_rollout(body, str(request.base_url))
    except RoundRejected as exc:
        raise HTTPException(exc.status_code, detail=exc.reason) from None


@router.get("/rollouts")
def list_rollouts(_: Authenticated, fleet: Service) -> dict:
    """Recent image roll-outs and image rollbacks, newest first."""
    return {"rollouts": fleet.rollouts.recent()}


@router.get("/rollouts/{rollout_id}")
def get_rollout(rollout_id: str, _: Authenticated, fleet: Service) -> dict:
    ro = fleet.rollouts.get(rollout_id)
    if ro is None:
        raise HTTPException(404, detail=f"no roll-out {rollout_id!r}")
    return ro


@router.post("/image-rollback", status_code=202)
def image_rollback(body: ImageRollbackRequest, _: Authenticated, fleet: Service) -> dict:
    """Make ``nodes`` boot their previous good slot again (tracked like a roll-out, kind rollback)."""
    try:
        return fleet.image_rollback(body)
    except RoundRejected as exc:
        raise HTTPException(exc.status_code, detail=exc.reason) from None
