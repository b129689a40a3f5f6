"""Print any of the project's errors as one CLI line.

Every layer's error tree hangs under ``fractal.FractalError`` (a message and an optional
``hint``, "how to fix it"), which the CLI prints as ``error: MESSAGE (help: HINT)``.
"""

from __future__ import annotations

from fractal import FractalError

__all__ = ["is_user_error", "format_error"]


def is_user_error(exc: BaseException) -> bool:
    """True for errors the user can fix (bad input, bad config), printed as one line."""
    return isinstance(exc, FractalError)


def format_error(exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or type(exc).__name__
    hint = exc.hint if isinstance(exc, FractalError) else None
    return f"error: {msg}" + (f" (help: {hint})" if hint else "")
