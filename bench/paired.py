"""The overhead of a variant over its baseline from interleaved runs, with a confidence interval.

A benchmark that alternates baseline and variant run by run (A B, B A, A B, ...) gets one pair per
repeat, measured within the same second or so: load that changes from minute to minute hits both
sides of a pair alike. Comparing the medians of the two columns throws that pairing away; on a
shared 2-core machine single runs of a whole training round swing by +-5 points, so a ratio of
medians from 11 repeats says little. This module reports the median of the per-pair overheads
(``variant_i / baseline_i - 1``) and a percentile-bootstrap 95% interval of that median (pairs
resampled with replacement, a fixed seed: the same runs always give the same interval). A claim
such as "under 5%" is made on the interval's upper end, not on the point estimate.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["paired_overhead"]

_RESAMPLES = 4000


def paired_overhead(baseline: Sequence[float], variant: Sequence[float], *, seed: int = 0,
                    resamples: int = _RESAMPLES, clusters: int = 1) -> dict[str, Any]:
    """-> ``{"median": m, "ci95": [lo, hi], "pairs": n}`` for ``variant[i] / baseline[i] - 1``.

    ``baseline`` and ``variant`` are the two columns of interleaved runs, pair ``i`` measured
    back to back. With fewer than 3 pairs there is no interval (``ci95`` is None).

    ``clusters`` > 1: the pairs come in that many equal consecutive groups that share something
    pairs cannot cancel (a benchmark's fresh set of processes per group). The interval then comes
    from a two-stage bootstrap (groups resampled, then pairs within each drawn group), so a bias
    between groups widens it instead of hiding in it; ``per_cluster`` lists each group's median."""
    if len(baseline) != len(variant):
        raise ValueError(f"{len(baseline)} baseline runs but {len(variant)} variant runs: not paired")
    if not baseline:
        raise ValueError("no runs")
    if min(baseline) <= 0:
        raise ValueError("baseline times must be positive")
    ratios = [v / b - 1.0 for b, v in zip(baseline, variant, strict=True)]
    n = len(ratios)
    out: dict[str, Any] = {"median": round(statistics.median(ratios), 4), "ci95": None, "pairs": n}
    if clusters < 1 or n % clusters:
        raise ValueError(f"{n} pairs do not split into {clusters} equal groups")
    size = n // clusters
    groups = [ratios[k * size:(k + 1) * size] for k in range(clusters)]
    if clusters > 1:
        out["per_cluster"] = [round(statistics.median(g), 4) for g in groups]
    if n >= 3:
        rng = random.Random(seed)
        if clusters == 1:
            meds = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
        else:
            meds = sorted(statistics.median([r for g in rng.choices(groups, k=clusters)
                                             for r in rng.choices(g, k=size)]) for _ in range(resamples))
        out["ci95"] = [round(meds[int(0.025 * resamples)], 4), round(meds[int(0.975 * resamples) - 1], 4)]
    return out
