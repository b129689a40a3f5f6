"""Thin HTTP routers of the fleet service, one per resource."""

from api.fleet.routes import (
    asyncrounds,
    auth,
    autorounds,
    events,
    images,
    nodes,
    page,
    rollback,
    rollouts,
    rounds,
)

__all__ = ["asyncrounds", "auth", "autorounds", "events", "images", "nodes", "page", "rollback", "rollouts",
           "rounds"]
