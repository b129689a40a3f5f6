"""Health (public), login/logout (sets or clears the HttpOnly token cookie)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from api.fleet.auth import COOKIE, check_token
from api.fleet.deps import Service

router = APIRouter(prefix="/api", tags=["auth"])


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: str = Field(min_length=1, max_length=4096)


@router.get("/health")
def health(fleet: Service) -> dict:
    """Liveness, no token needed: is the service up and connected to its broker, does it lead."""
    return {"status": "ok", "broker_connected": fleet.connected, "swarm": fleet.settings.swarm,
            "role": "leader" if fleet.leading else "follower"}


@router.post("/login")
def login(body: Login, request: Request) -> JSONResponse:
    """Exchange the operator token for an HttpOnly cookie (what the dashboard and SSE use)."""
    if not check_token(request, body.token):
        return JSONResponse({"detail": "wrong operator token"}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
    resp = JSONResponse({"status": "ok"})
    resp.set_cookie(COOKIE, body.token, httponly=True, samesite="strict",
                    secure=request.url.scheme == "https", path="/")
    return resp


@router.post("/logout")
def logout() -> JSONResponse:
    resp = JSONResponse({"status": "ok"})
    resp.delete_cookie(COOKIE, path="/")
    return resp
