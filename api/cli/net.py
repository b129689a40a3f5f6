"""Re-export of :mod:`api.net` for the CLI verbs (the helper lives outside the CLI so deploy/ can use it)."""

from __future__ import annotations

from api.net import port_problem

__all__ = ["port_problem"]
