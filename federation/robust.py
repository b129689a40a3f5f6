"""Outlier screening and robust aggregation of members' updates (pure functions, no I/O).

A ring allreduce shows every member only partial sums, so a member cannot look at another's
update. The protocol (PROTOCOL.md section 7, "Outliers") therefore works on *claims*:

1. Before a step's allreduce every member computes the L2 norm of its update on each of the n
   ring chunks (:func:`chunk_norms`; :data:`NON_FINITE` in every slot for a NaN/Inf update) and
   the members send these rows directly to each other as the first frames of the step's own
   allreduce call (``RingAllreduce.allreduce(screen=...)``: one hop, each row from its own
   sender, so nobody can alter another member's claim).
2. Every member runs the same :func:`screen` on the same bits: a contributor whose claimed norm
   is non-finite or above ``factor`` x the median claimed norm of the contributors is excluded
   for this step; it contributes zeros and the divisor of the mean shrinks to the kept count.
3. The allreduce then **verifies the claims** (``RingAllreduce.allreduce(claims=...)``): a
   partial sum of chunk c that arrives carrying the contributions of members J cannot have a
   norm above ``sum(claims[j, c] for j in J)`` (triangle inequality), so a member that lies
   about its norm, or an excluded member that still sends data, is caught by its successor and
   the call aborts blaming it. An honest forwarder checked what it received before adding its own
   chunk, so blaming the sender of a violating frame is always right.

What a liar can still do: stay within the slack of the triangle inequality (the honest members'
chunk norms add up to more than the norm of their sum). Its influence is bounded by the sum of
the claims of the step, i.e. about ``n x factor x median``, never 1e3 x.

Robust aggregation (``aggregation = "median" | "trimmed_mean"``) needs every update: it uses an
exchange of the updates ((n - 1) L floats sent per member, about n / 2 times a mean allreduce's),
then screens on the *actual* norms and takes the coordinate-wise median or trimmed mean of the
kept rows (:func:`aggregate`). Every member computes the same numbers from the same
bits, so the result is bit-identical everywhere.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from federation import schedule as sch

__all__ = [
    "NON_FINITE",
    "Aggregation",
    "Screening",
    "chunk_norms",
    "screen",
    "aggregate",
    "claims_tolerance",
    "TRIM_FRACTION",
    "norms_from_claims",
    "norm_of_claim",
    "opposed",
]

NON_FINITE = -1.0  # a claimed chunk norm that says "my update is not finite" (norms are >= 0)


class Aggregation(enum.StrEnum):
    MEAN = "mean"  # ring allreduce (2 L floats sent per member)
    MEDIAN = "median"  # coordinate-wise median over an all-gather (about 2 n L floats per member)
    TRIMMED_MEAN = "trimmed_mean"  # coordinate-wise mean without the k lowest and k highest values


@dataclass(frozen=True)
class Screening:
    """The outcome of :func:`screen` for one step (identical on every member)."""

    kept: tuple[int, ...]  # ranks (sorted group order) whose update is used
    excluded: dict[int, str] = field(default_factory=dict)  # rank -> why
    median: float = 0.0  # median norm of the contributors with a finite norm


def chunk_norms(x: np.ndarray, n: int) -> np.ndarray:
    """float32 ``(n,)``: the L2 norm of ``x`` on each ring chunk (``schedule.chunk_bounds``),
    rounded **up** to float32 so a claim never undercuts the real norm; all :data:`NON_FINITE`
    when ``x`` holds NaN/Inf."""
    x64 = np.asarray(x, np.float64)
    if not np.isfinite(x64).all():
        return np.full(n, NON_FINITE, np.float32)
    out = np.empty(n, np.float32)
    for c, (a, b) in enumerate(sch.chunk_bounds(n, x64.size)):
        v = math.sqrt(float(np.dot(x64[a:b], x64[a:b])))
        f = np.float32(v)
        out[c] = f if float(f) >= v else np.nextafter(f, np.float32(np.inf))
    if not np.isfinite(out).all():  # a norm beyond float32 is as good as non-finite
        return np.full(n, NON_FINITE, np.float32)
    return out


def norm_of_claim(row: np.ndarray) -> float:
    """The whole update's norm from its chunk norms (NaN for a non-finite claim)."""
    if (row < 0).any() or not np.isfinite(row).all():
        return math.nan
    return math.sqrt(float(np.dot(row.astype(np.float64), row.astype(np.float64))))


def screen(norms: list[float] | np.ndarray, contributors: list[bool], factor: float) -> Screening:
    """Which contributors' updates to use: every contributor whose ``norms[k]`` is finite and at
    most ``factor`` x the median of the contributors' finite norms (``factor`` 0 = keep every
    finite one). Non-contributors (no samples) are neither kept nor named."""
    vals = [float(v) for v in norms]
    ranks = [k for k, c in enumerate(contributors) if c]
    finite = [vals[k] for k in ranks if math.isfinite(vals[k])]
    median = float(np.median(finite)) if finite else 0.0
    kept, excluded = [], {}
    for k in ranks:
        v = vals[k]
        if not math.isfinite(v):
            excluded[k] = "non-finite update"
        elif factor > 0 and median > 0 and v > factor * median:
            excluded[k] = f"update norm {v:.3g} > {factor:g} x median {median:.3g}"
        else:
            kept.append(k)
    return Screening(tuple(kept), excluded, median)


def norms_from_claims(claims: np.ndarray) -> list[float]:
    """Whole-update norms from the n x n claimed chunk norms (NaN for non-finite claims)."""
    return [norm_of_claim(claims[k]) for k in range(claims.shape[0])]


def aggregate(rows: np.ndarray, method: Aggregation | str, trim_fraction: float = 0.2) -> np.ndarray:
    """Coordinate-wise aggregate of ``rows`` (m x L, float32) -> float32 ``(L,)``.

    ``trimmed_mean`` drops ``max(1, floor(trim_fraction x m))`` values at each end of every
    coordinate when ``m >= 3`` (fewer rows: the plain mean, nothing can be told apart)."""
    method = Aggregation(method)
    rows = np.asarray(rows, np.float32)
    m = rows.shape[0]
    if m == 0:
        raise ValueError("nothing to aggregate")
    if method == Aggregation.MEAN or m == 1:
        return rows.mean(axis=0, dtype=np.float64).astype(np.float32)
    if method == Aggregation.MEDIAN:
        return np.median(rows, axis=0).astype(np.float32)
    k = max(1, int(trim_fraction * m)) if m >= 3 else 0
    if 2 * k >= m:
        k = (m - 1) // 2
    s = np.sort(rows, axis=0)
    return s[k:m - k].mean(axis=0, dtype=np.float64).astype(np.float32)


def opposed(rows: np.ndarray, kept: tuple[int, ...] | list[int], factor: float,
            cosine: float = 0.0) -> dict[int, str]:
    """The direction check: which of the ``kept`` rows pull against the others, i.e. point away
    from the coordinate-wise median of the *other* kept rows (cosine similarity below ``cosine``;
    its own row is left out of its reference, which it would otherwise drag along) with a norm
    above ``factor`` x the median of the kept rows' norms (rank -> why). An opposed update gets a
    tighter norm bound than an aligned one (the outlier factor): a gradient x -4 stays under
    10 x the median norm but is caught here, while an honest member on non-IID data, whose update
    can point away from the others', does so with an ordinary norm. Needs 3 or more kept rows
    (with 2 there is no majority to point with); a zero row or reference judges nobody."""
    if len(kept) < 3:
        return {}
    sub = np.asarray(rows, np.float32)[list(kept)].astype(np.float64)
    norms = [math.sqrt(float(np.dot(r, r))) for r in sub]
    typical = float(np.median(norms))
    out = {}
    for i, k in enumerate(kept):
        if not norms[i] > factor * typical:
            continue  # an ordinary norm: whatever its direction, not an amplified pull
        ref = np.median(np.delete(sub, i, axis=0), axis=0)
        m = math.sqrt(float(np.dot(ref, ref)))
        cos = float(np.dot(sub[i], ref)) / (norms[i] * m) if m > 0 else 0.0
        if cos < cosine:
            out[k] = (f"update points away from the other members' median (cosine {cos:.2f}) with "
                      f"norm {norms[i]:.3g} > {factor:g} x median {typical:.3g}")
    return out


TRIM_FRACTION = 0.2  # trimmed_mean drops this share (at least one) of the values at each end


def claims_tolerance(n: int, lossy: bool) -> float:
    """Relative slack of the claim check: float32 rounding of sums (and fp16 rounding of every hop)."""
    return 1.0 + (2e-3 * n if lossy else 1e-4)
