"""Update checks applied to every member's contribution and every received partial sum."""

from __future__ import annotations

import numpy as np

from federation.errors import UpdateRejected

__all__ = ["all_finite", "check_finite", "clip_l2"]


def all_finite(x: np.ndarray) -> bool:
    """True if no element is NaN or +-Inf.

    Fast path: the sum of a finite vector is finite unless it overflows, and NaN/Inf always
    propagate into the sum; only an overflowing (or non-finite) sum pays the exact check.
    """
    if x.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(x)):
            return True
    return bool(np.isfinite(x).all())


def check_finite(x: np.ndarray, *, member: str, what: str = "update") -> None:
    """Raise :class:`UpdateRejected` naming ``member`` if ``x`` holds NaN or Inf."""
    if not all_finite(x):
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        raise UpdateRejected(
            f"{what} from {member} has {bad} non-finite value(s) (NaN/Inf)",
            member=member,
            hint="the member's gradient diverged: lower the learning rate or enable clipping",
        )


def clip_l2(x: np.ndarray, max_norm: float | None) -> tuple[np.ndarray, float]:
    """Scale ``x`` down to L2 norm ``max_norm`` (no-op if ``None`` or already within).

    Returns ``(vector, factor)``; the input is never modified (a scaled copy is returned).
    """
    if max_norm is None:
        return x, 1.0
    if not max_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {max_norm}")
    norm = float(np.linalg.norm(x.astype(np.float64, copy=False)))
    if norm <= max_norm:
        return x, 1.0
    factor = max_norm / norm
    return (x * np.float32(factor)).astype(np.float32, copy=False), factor
