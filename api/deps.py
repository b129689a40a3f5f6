"""What the node app needs from an edge node, and the ``Annotated`` dependency aliases of its routes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Protocol

import numpy as np
from fastapi import Depends, Request

__all__ = ["NodeLike", "NodeDep", "get_node", "model_version"]


class NodeLike(Protocol):
    """The surface of :class:`edgenode.node.EdgeNode` the HTTP layer uses (tests may fake it)."""

    model_name: str
    inputs: Sequence[Any]    # TensorSpec(name, shape incl. batch dim, dtype)
    outputs: Sequence[Any]

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def add_samples(self, inputs: dict[str, np.ndarray], labels: np.ndarray) -> Any: ...

    def info(self) -> dict[str, Any]: ...


def get_node(request: Request) -> NodeLike:
    """The node this app serves (set once by ``create_node_app``)."""
    return request.app.state.node


NodeDep = Annotated[NodeLike, Depends(get_node)]


def model_version(node: NodeLike) -> str:
    """The served model version as an OIP version string ("1" if the node does not say)."""
    v = getattr(node, "model_version", None)
    return str(v) if v is not None else "1"
