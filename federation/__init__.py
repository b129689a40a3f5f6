"""federation: the swarm's ring-allreduce (pure schedule, framing, codecs, engines, transports).

Import the submodules for details; the names below are the public surface. Every name is
imported lazily on first use, so that ``import federation`` (which any ``import federation.x``
runs first) costs nothing: the training worker loads the ring without the message models, and
nothing pays for paho-mqtt (or amqtt) before it needs them (issue 25: a board's memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fractal.lazy import LazyNames

if TYPE_CHECKING:
    from federation.broker import Broker, start_default, start_embedded, start_mosquitto
    from federation.errors import (
        FederationError,
        FrameError,
        RetriesExhausted,
        RoundAborted,
        TransportError,
        UpdateRejected,
    )
    from federation.hierarchy import HierarchicalAllreduce, Topology
    from federation.membership import Membership, StatusPublisher
    from federation.memory import MemoryHub, MemoryTransport
    from federation.messages import Compression
    from federation.mqtt import MqttLink, TlsOptions
    from federation.ring import ReduceOp, RingAllreduce
    from federation.roundspec import RoundDefaults, RoundSpec, resolve
    from federation.star import StarAllreduce
    from federation.stats import Stats
    from federation.transport import Capabilities, Framing, PubSubLink, Transport

# name -> submodule, resolved by __getattr__ on first access
_LAZY = {
    "FederationError": "federation.errors",
    "FrameError": "federation.errors",
    "RetriesExhausted": "federation.errors",
    "RoundAborted": "federation.errors",
    "TransportError": "federation.errors",
    "UpdateRejected": "federation.errors",
    "HierarchicalAllreduce": "federation.hierarchy",
    "Topology": "federation.hierarchy",
    "MemoryHub": "federation.memory",
    "MemoryTransport": "federation.memory",
    "Compression": "federation.messages",
    "ReduceOp": "federation.ring",
    "RingAllreduce": "federation.ring",
    "RoundDefaults": "federation.roundspec",
    "RoundSpec": "federation.roundspec",
    "resolve": "federation.roundspec",
    "StarAllreduce": "federation.star",
    "Stats": "federation.stats",
    "Capabilities": "federation.transport",
    "Framing": "federation.transport",
    "PubSubLink": "federation.transport",
    "Transport": "federation.transport",
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


_names = LazyNames(__name__, _LAZY, globals())


def __getattr__(name: str) -> Any:
    return _names.get(name)


def __dir__() -> list[str]:
    return _names.dir(__all__)
