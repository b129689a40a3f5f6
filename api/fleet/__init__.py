"""The fleet service: node registry, round manager and event stream over MQTT."""

from api.fleet.registry import NodeRegistry
from api.fleet.rounds import RoundManager, RoundRejected, RoundRequest, RoundState
from api.fleet.service import FleetService
from api.fleet.settings import FleetSettings

__all__ = ["FleetService", "FleetSettings", "NodeRegistry", "RoundManager", "RoundRejected",
           "RoundRequest", "RoundState"]
