"""Map every layer's error tree onto one CLI line.

``compiler`` and ``federation`` may not import from other folders (DESIGN.md layers), so each
layer owns its base error. All of them share one shape: a message and an optional ``hint``
("how to fix it"), which the CLI prints as ``error: MESSAGE (help: HINT)``.
"""

from __future__ import annotations

import importlib

_BASES = (
    ("compiler.errors", "CompilerError"),
    ("federation.errors", "FederationError"),
    ("edgenode.common", "NodeError"),
    ("firmware.errors", "FirmwareError"),
)


def _bases() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = []
    for mod, name in _BASES:
        try:
            found.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def is_user_error(exc: BaseException) -> bool:
    """True for errors the user can fix (bad input, bad config), printed as one line."""
    return isinstance(exc, _bases())


def format_error(exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or type(exc).__name__
    hint = getattr(exc, "hint", None)
    return f"error: {msg}" + (f" (help: {hint})" if hint else "")
