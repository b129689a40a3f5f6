"""federation: the swarm's ring-allreduce (pure schedule, framing, codecs, engines, transports).

Import the submodules for details; the names below are the public surface.
"""

from federation.errors import FederationError, FrameError, RoundAborted, TransportError, UpdateRejected
from federation.memory import MemoryHub, MemoryTransport
from federation.messages import Compression
from federation.ring import ReduceOp, RingAllreduce
from federation.star import StarAllreduce
from federation.stats import Stats
from federation.transport import Transport

__all__ = [
    "Compression",
    "FederationError",
    "FrameError",
    "MemoryHub",
    "MemoryTransport",
    "ReduceOp",
    "RingAllreduce",
    "RoundAborted",
    "StarAllreduce",
    "Stats",
    "Transport",
    "TransportError",
    "UpdateRejected",
]
