"""The federation's error tree.

    FederationError
    ├── TransportError      broker unreachable, connection lost, payload too large
    ├── FrameError          bad version, checksum mismatch, malformed frame (message rejected)
    ├── RoundAborted        deadline passed, member died, update rejected (reason names the member)
    ├── UpdateRejected      NaN/Inf or over-norm update (a RoundAborted)
    ├── RoundRefused        a round's phase cannot go on (no start, refused final parameters, a no)
    ├── AllExcluded         a screened step excluded every member's update (nobody to blame)
    └── RetriesExhausted    a frame stayed unacknowledged after ``max_retransmits`` (a RoundAborted)
"""

from __future__ import annotations

from fractal import FractalError

__all__ = ["FederationError", "TransportError", "FrameError", "RoundAborted", "UpdateRejected",
           "RoundRefused", "AllExcluded", "RetriesExhausted"]


class FederationError(FractalError):
    """Base of every error the federation raises on purpose."""


class TransportError(FederationError):
    pass


class FrameError(FederationError):
    pass


class RoundAborted(FederationError):
    def __init__(self, message: str, *, member: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.member = member


class UpdateRejected(RoundAborted):
    pass


class RoundRefused(RoundAborted):
    """A phase of a round (``federation/phases.py``) found that the round cannot go on; ``member``
    names the member at fault when there is one."""


class AllExcluded(FederationError):
    """Screening left no update to combine in a step (every member excluded)."""


class RetriesExhausted(RoundAborted):
    """A peer never acknowledged a frame after the endpoint's ``max_retransmits`` retransmissions."""
