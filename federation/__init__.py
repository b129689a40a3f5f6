"""federation: the swarm's ring-allreduce (pure schedule, framing, codecs, engines, transports).

Import the submodules for details; the names below are the public surface. The MQTT side
(``MqttLink``, ``Membership``, broker helpers) is imported lazily on first use, so that
``import federation`` does not pay for paho-mqtt (or amqtt) when only the engines are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from federation.errors import (
    FederationError,
    FrameError,
    RetriesExhausted,
    RoundAborted,
    TransportError,
    UpdateRejected,
)
from federation.hierarchy import HierarchicalAllreduce, Topology
from federation.memory import MemoryHub, MemoryTransport
from federation.messages import Compression
from federation.ring import ReduceOp, RingAllreduce
from federation.roundspec import RoundDefaults, RoundSpec, resolve
from federation.star import StarAllreduce
from federation.stats import Stats
from federation.transport import Capabilities, Framing, PubSubLink, Transport

if TYPE_CHECKING:
    from federation.broker import Broker, start_default, start_embedded, start_mosquitto
    from federation.membership import Membership, StatusPublisher
    from federation.mqtt import MqttLink, TlsOptions

# name -> submodule, resolved by __getattr__ on first access
_LAZY = {
    "MqttLink": "federation.mqtt",
    "TlsOptions": "federation.mqtt",
    "Membership": "federation.membership",
    "StatusPublisher": "federation.membership",
    "Broker": "federation.broker",
    "start_mosquitto": "federation.broker",
    "start_embedded": "federation.broker",
    "start_default": "federation.broker",
}

__all__ = [
    "Broker",
    "Capabilities",
    "Compression",
    "FederationError",
    "FrameError",
    "Framing",
    "HierarchicalAllreduce",
    "Membership",
    "MemoryHub",
    "MemoryTransport",
    "MqttLink",
    "PubSubLink",
    "ReduceOp",
    "RingAllreduce",
    "RoundAborted",
    "RoundDefaults",
    "RoundSpec",
    "StarAllreduce",
    "Topology",
    "Stats",
    "StatusPublisher",
    "TlsOptions",
    "Transport",
    "TransportError",
    "UpdateRejected",
    "RetriesExhausted",
    "start_default",
    "start_embedded",
    "start_mosquitto",
    "resolve",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'federation' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
