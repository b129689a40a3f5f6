"""Enrolment routes: the operator's tokens and decisions, and a device's announcement and polls.

Operator (token as ``Authorization: Bearer``): ``POST /api/enrollment-tokens``,
``GET /api/enrollments``, ``POST /api/enrollments/{device_id}/accept|reject|revoke``.
Device (open routes, small bodies; see api/fleet/enrollment.py): ``POST /api/enroll``,
``POST /api/enroll/{device_id}/status``.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from api.fleet.auth import Authenticated
from api.fleet.deps import Service
from api.fleet.enrollment import (
    EnrollmentManager,
    EnrollmentRejected,
    EnrolRequest,
    PollRequest,
    TokenRequest,
)
from api.fleet.events import EventType

router = APIRouter(prefix="/api", tags=["enrollment"])


def _mgr(request: Request) -> EnrollmentManager:
    return request.app.state.fleet.enrollment


def _call(fn, *args):
    try:
        return fn(*args)
    except EnrollmentRejected as exc:
        raise HTTPException(exc.status_code, detail=exc.reason) from None


@router.post("/enrollment-tokens")
def create_token(body: TokenRequest, _: Authenticated, request: Request) -> dict:
    """A new enrolment token (shown once; stored hashed): ``{"token", "expires_at", "uses"}``."""
    return _call(_mgr(request).create_token, body)


@router.get("/enrollments")
def list_enrollments(_: Authenticated, request: Request) -> dict:
    """Every enrolment (pending, accepted, rejected, revoked), newest first."""
    return {"enrollments": _mgr(request).list()}


def _decide(verb: str, device_id: str, request: Request, fleet) -> dict:
    mgr = _mgr(request)
    view = _call(getattr(mgr, verb), device_id)
    fleet.history.record_action(f"enrollment.{verb}", {"device_id": device_id})
    fleet.bus.publish(EventType.ENROLLMENT, {"enrollments": mgr.list()})
    return view


@router.post("/enrollments/{device_id}/accept")
def accept(device_id: str, _: Authenticated, request: Request, fleet: Service) -> dict:
    return _decide("accept", device_id, request, fleet)


@router.post("/enrollments/{device_id}/reject")
def reject(device_id: str, _: Authenticated, request: Request, fleet: Service) -> dict:
    return _decide("reject", device_id, request, fleet)


@router.post("/enrollments/{device_id}/revoke")
def revoke(device_id: str, _: Authenticated, request: Request, fleet: Service) -> dict:
    return _decide("revoke", device_id, request, fleet)


@router.post("/enroll")
def enroll(body: EnrolRequest, request: Request, fleet: Service) -> dict:
    """A device announces itself with an enrolment token and its public keys (pending until accepted)."""
    mgr = _mgr(request)
    out = _call(mgr.request, body)
    fleet.bus.publish(EventType.ENROLLMENT, {"enrollments": mgr.list()})
    return out


@router.post("/enroll/{device_id}/status")
def poll(device_id: str, body: PollRequest, request: Request) -> dict:
    """The device's enrolment state; once accepted, its signed keyring and broker credentials."""
    return _call(_mgr(request).poll, device_id, body)
