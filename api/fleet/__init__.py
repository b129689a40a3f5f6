"""The fleet service: node registry, round manager and event stream over MQTT.

The names below are imported on first use: ``import api.fleet.x`` (``fractal --help``, or a node
whose CLI registers the ``fleet`` verb) then costs only ``x``, not the service, its settings and
the signing stack (issue 25: a board's node memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fractal.lazy import LazyNames

if TYPE_CHECKING:
    from api.fleet.registry import NodeRegistry
    from api.fleet.rounds import RoundManager, RoundRejected, RoundRequest, RoundState
    from api.fleet.service import FleetService
    from api.fleet.settings import FleetSettings

__all__ = ["FleetService", "FleetSettings", "NodeRegistry", "RoundManager", "RoundRejected",
           "RoundRequest", "RoundState"]

# name -> submodule, resolved by __getattr__ on first access
_LAZY = {
    "NodeRegistry": "api.fleet.registry",
    "RoundManager": "api.fleet.rounds",
    "RoundRejected": "api.fleet.rounds",
    "RoundRequest": "api.fleet.rounds",
    "RoundState": "api.fleet.rounds",
    "FleetService": "api.fleet.service",
    "FleetSettings": "api.fleet.settings",
}


_names = LazyNames(__name__, _LAZY, globals())


def __getattr__(name: str) -> Any:
    return _names.get(name)


def __dir__() -> list[str]:
    return _names.dir(__all__)
