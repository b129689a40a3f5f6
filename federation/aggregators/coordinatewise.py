"""What the coordinate-wise aggregates (median, trimmed mean) share: every member needs every
update, which a ring cannot reduce, so the step is an exchange of L + 1 floats per member
((1 = finite, the update), all zeros from a non-finite or sample-less member); every member
screens the actual norms (and, when screening is on, the direction) and aggregates the kept rows
with ``federation.robust.aggregate``: same bits in, same bits out on every member."""

from __future__ import annotations

import numpy as np

from federation import robust
from federation.aggregators.base import Combined, Step, screen

__all__ = ["coordinatewise"]


def coordinatewise(step: Step, update: np.ndarray, method: robust.Aggregation) -> Combined:
    ok = step.contributors[step.rank] and bool(np.isfinite(update).all())
    row = np.zeros(update.size + 1, np.float32)  # [1 = finite, the update]; zeros = nothing to add
    if ok:
        row[0], row[1:] = 1.0, update
    out = np.asarray(step.collective.exchange(row, group=step.members, tag=step.tag, timeout=step.timeout),
                     np.float32)
    rows = out[:, 1:]
    norms = [float(np.linalg.norm(rows[j].astype(np.float64))) if out[j, 0] == 1.0 else float("nan")
             for j in range(len(step.group))]
    kept, excluded, opposed = screen(step, norms, rows)
    return Combined(robust.aggregate(rows[list(kept)], method, robust.TRIM_FRACTION), excluded, opposed)
