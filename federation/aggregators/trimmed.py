"""The coordinate-wise trimmed mean of the kept members' updates: ``max(1, floor(0.2 m))``
values dropped at each end of every coordinate (m = kept rows >= 3; fewer rows: the mean)."""

from __future__ import annotations

import numpy as np

from federation.aggregators.base import Combined, Step
from federation.aggregators.coordinatewise import coordinatewise
from federation.robust import Aggregation

__all__ = ["TrimmedMean"]


class TrimmedMean:
    def combine(self, step: Step, update: np.ndarray) -> Combined:
        return coordinatewise(step, update, Aggregation.TRIMMED_MEAN)
