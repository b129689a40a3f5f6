"""Thin HTTP routers of the fleet service, one per resource."""

from api.fleet.routes import auth, autorounds, events, images, nodes, page, rollback, rollouts, rounds

__all__ = ["auth", "autorounds", "events", "images", "nodes", "page", "rollback", "rollouts", "rounds"]
