"""The screened mean (the default): outliers excluded, the mean over the kept members.

Around the ring (PROTOCOL.md section 7.1 "Mean (ring) with screening") members claim their
chunk norms inside the step's allreduce, every member screens the same claims, and the ring
checks every partial sum against them. On the direct path (small float32 vectors) every member
holds every row, so it screens the rows' own norms and, in addition, their direction
(``federation.robust.opposed``): a member whose update points against the members' median is
excluded like a norm outlier.
"""

from __future__ import annotations

import numpy as np

from federation import robust
from federation.aggregators.base import Combined, Step, screen

__all__ = ["ScreenedMean"]


class ScreenedMean:
    """Screening, then the mean of the kept members' updates (float32 and fp16 codecs)."""

    def combine(self, step: Step, update: np.ndarray) -> Combined:
        n, k = len(step.group), step.rank
        row = robust.chunk_norms(update, n) if step.contributors[k] else np.zeros(n, np.float32)
        kept: list[int] = []
        excluded: dict[str, str] = {}
        opposed: set[str] = set()

        def decide(claims: np.ndarray, rows: np.ndarray | None) -> tuple[np.ndarray, bool]:
            # Every member gets the same rows (each straight from its sender) and decides alike.
            s_kept, s_excluded, s_opposed = screen(step, robust.norms_from_claims(claims), rows)
            kept.extend(s_kept)
            excluded.update(s_excluded)
            opposed.update(s_opposed)
            bounds = claims.astype(np.float64)
            for j in range(n):
                if j not in s_kept:
                    bounds[j] = 0.0  # excluded members and members without samples send zeros
            return bounds, k in s_kept

        avg = np.asarray(step.collective.allreduce(update, group=step.members, tag=step.tag, op="mean",
                                                   timeout=step.timeout, compression=step.compression,
                                                   screen=(row, decide)), np.float32)
        return Combined(avg * np.float32(n / len(kept)) if len(kept) != n else avg, excluded,
                        frozenset(opposed))
