"""Dependency aliases shared by the fleet routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.fleet.service import FleetService

__all__ = ["Service", "get_service"]


def get_service(request: Request) -> FleetService:
    return request.app.state.fleet


Service = Annotated[FleetService, Depends(get_service)]
