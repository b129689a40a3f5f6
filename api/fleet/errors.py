"""User-fixable errors of the fleet service and the swarm launcher.

They subclass ``edgenode.common.NodeError`` (api sits on top of edgenode), so the CLI prints
them as one ``error: MESSAGE (help: HINT)`` line with a non-zero exit.
"""

from __future__ import annotations

from edgenode.common import NodeError

__all__ = ["FleetError"]


class FleetError(NodeError):
    """A fleet or swarm setup problem: port in use, broker unreachable, sysroot missing."""
