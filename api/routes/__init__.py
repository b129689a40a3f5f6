"""Routers of the node app, one per resource: OIP v2 (``oip``), samples, node info and metrics."""

from api.routes import node, oip, samples

__all__ = ["node", "oip", "samples"]
