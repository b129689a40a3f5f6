"""The numbers a round's arithmetic checks against (screening, the final sync, the update's size).

Part of :mod:`federation.bounds` (every limit a receiver enforces, in one place), which re-exports
them; they live in this module of plain numbers so that the training worker (edgenode/trainworker.py)
computes a round without loading the message models and pydantic (issue 25: a board's memory).
"""

from __future__ import annotations

__all__ = [
    "UPDATE_NORM_FACTOR",
    "SYNC_GAP_OF_UPDATE",
    "SYNC_GAP_OF_PARAMS",
    "OUTLIER_FACTOR_DEFAULT",
    "OUTLIER_FACTOR_MAX",
    "DIRECTION_NORM_FACTOR",
    "DIRECTION_MAX_COSINE",
]

# A round's update (final - start parameters) may not exceed this many times the start norm
# (at least 1): a member committing it would replace the model rather than train it.
UPDATE_NORM_FACTOR = 100.0
# Final sync without a majority (federation/phases.py:agree): a member adopts the first member's
# parameters only if they lie within SYNC_GAP_OF_UPDATE x its own update of the round plus
# SYNC_GAP_OF_PARAMS x its own parameters' norm (L2) of its own result. Boards that round
# differently drift apart by a few ulps per step, orders of magnitude below this; a member that
# split the others' views on purpose moves the model by at most this, or fails the round.
SYNC_GAP_OF_UPDATE = 1e-2
SYNC_GAP_OF_PARAMS = 1e-5
# A step's update whose norm exceeds this many times the median of the members' is excluded
# (federation/robust.py); 0 = no screening. Below 1 honest members would be excluded.
OUTLIER_FACTOR_DEFAULT = 10.0
OUTLIER_FACTOR_MAX = 1e6
# A screened step also excludes a member whose update points away from the coordinate-wise median
# of the other kept updates (cosine below DIRECTION_MAX_COSINE) with a norm above
# DIRECTION_NORM_FACTOR x the median norm (federation/robust.py opposed; 3 or more kept updates,
# only where every member holds every update: PROTOCOL.md section 7.1). Measured on the digits
# splits of tests/edgenode/learning.py: a gradient x -4 is at 2.9 x or more, its cosine below -0.2
# in about 90% of the steps; an honest non-IID member was excluded in 15 of 631 steps (a member is
# named only when excluded so in half the round's steps: federation/phases.py StepCombiner).
DIRECTION_NORM_FACTOR = 2.5
DIRECTION_MAX_COSINE = -0.2
