"""edgenode: the agent that runs on every board (artifact + params + samples + training rounds).

Import the node itself from :mod:`edgenode.node` (it pulls in the compiler and MQTT lazily);
this package root only re-exports the light pieces.
"""

from edgenode.config import NodeConfig, load_config
from edgenode.errors import ConfigError, InvalidInput, NodeBusy, NodeError, RoundFailed, StoreError

__all__ = [
    "NodeError",
    "ConfigError",
    "InvalidInput",
    "StoreError",
    "NodeBusy",
    "RoundFailed",
    "NodeConfig",
    "load_config",
    "EdgeNode",
]


def __getattr__(name: str) -> type:
    if name == "EdgeNode":  # lazy: edgenode.node imports numpy-heavy and MQTT modules
        from edgenode.node import EdgeNode

        return EdgeNode
    raise AttributeError(name)
