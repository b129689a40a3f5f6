"""The launchers' errors: something the demo swarm or an emulated node needs could not start."""

from __future__ import annotations

from fractal import FractalError

__all__ = ["DeployError"]


class DeployError(FractalError):
    """A launcher could not start what it runs (qemu or a sysroot missing, a node exiting at
    start-up, nodes not ready in time); the hint says how to fix it."""
