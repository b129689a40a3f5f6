"""The coordinate-wise median of the kept members' updates (over an exchange: about n / 2 times
the bytes of the ring mean)."""

from __future__ import annotations

import numpy as np

from federation.aggregators.base import Combined, Step
from federation.aggregators.coordinatewise import coordinatewise
from federation.robust import Aggregation

__all__ = ["Median"]


class Median:
    def combine(self, step: Step, update: np.ndarray) -> Combined:
        return coordinatewise(step, update, Aggregation.MEDIAN)
