"""The mean over the ring, unscreened (``outlier_factor`` 0): the allreduce(mean) of section 6.

A non-finite update aborts the step naming its sender (the ring's own check). Members without
samples send zeros; the mean is rescaled by n / (members with samples) so they do not dilute it.
"""

from __future__ import annotations

import numpy as np

from federation.aggregators.base import Combined, Step

__all__ = ["Mean", "ring_mean"]


def ring_mean(step: Step, update: np.ndarray, scale: float, claims: np.ndarray | None = None) -> np.ndarray:
    """The allreduce(mean) of ``update`` x ``scale`` (the ring's codec: ``step.compression``)."""
    avg = np.asarray(step.collective.allreduce(update, group=step.members, tag=step.tag, op="mean",
                                               timeout=step.timeout, compression=step.compression,
                                               claims=claims), np.float32)
    return avg * np.float32(scale) if scale != 1.0 else avg


class Mean:
    """Mean of every member's update (2 (n - 1) / n L floats sent per member)."""

    def combine(self, step: Step, update: np.ndarray) -> Combined:
        return Combined(ring_mean(step, update, len(step.group) / sum(step.contributors)))
