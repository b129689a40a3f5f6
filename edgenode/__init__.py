"""edgenode: the agent that runs on every board (artifact + params + samples + training rounds).

Import the node itself from :mod:`edgenode.node` (it pulls in the compiler and MQTT lazily).
Every name here is imported on first use, so that ``import edgenode.x`` costs only ``x``: the
training worker (edgenode/trainworker.py) never loads the node's config models (issue 25: a
board's memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fractal.lazy import LazyNames

if TYPE_CHECKING:
    from edgenode.config import NodeConfig, load_config
    from edgenode.errors import ConfigError, InvalidInput, NodeBusy, NodeError, RoundFailed, StoreError
    from edgenode.node import EdgeNode

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

# name -> submodule, resolved by __getattr__ on first access
_LAZY = {
    "NodeError": "edgenode.errors",
    "ConfigError": "edgenode.errors",
    "InvalidInput": "edgenode.errors",
    "StoreError": "edgenode.errors",
    "NodeBusy": "edgenode.errors",
    "RoundFailed": "edgenode.errors",
    "NodeConfig": "edgenode.config",
    "load_config": "edgenode.config",
    "EdgeNode": "edgenode.node",
}


_names = LazyNames(__name__, _LAZY, globals())


def __getattr__(name: str) -> Any:
    return _names.get(name)


def __dir__() -> list[str]:
    return _names.dir(__all__)
