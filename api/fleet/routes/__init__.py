"""Thin HTTP routers of the fleet service, one per resource."""

from api.fleet.routes import auth, events, nodes, page, rollback, rounds

__all__ = ["auth", "events", "nodes", "page", "rollback", "rounds"]
