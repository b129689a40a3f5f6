"""User-fixable errors of the fleet service and the swarm launcher.

They subclass the project's root ``fractal.FractalError``, so the CLI prints them as one
``error: MESSAGE (help: HINT)`` line with a non-zero exit.
"""

from __future__ import annotations

from fractal import FractalError

__all__ = ["FleetError", "StoreUnavailable"]


class FleetError(FractalError):
    """A fleet or swarm setup problem: port in use, broker unreachable, sysroot missing."""


class StoreUnavailable(FleetError):
    """The fleet's PostgreSQL cannot be reached (the API answers 503 until it is back)."""
