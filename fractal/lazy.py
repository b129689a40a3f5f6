"""Names a package root re-exports but imports on first use (PEP 562), so that ``import pkg.x``
costs only ``x``: a board's node and its training worker load what they run, not the whole
package (issue 25: a board's memory). Each package root keeps its own table and two one-line
hooks::

    _names = LazyNames(__name__, {"EdgeNode": "edgenode.node", ...}, globals())

    def __getattr__(name: str) -> Any:
        return _names.get(name)

    def __dir__() -> list[str]:
        return _names.dir(__all__)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LazyNames"]


class LazyNames:
    """``name -> module`` for one package root, resolved on first access and then kept in the
    package's namespace (the next access is a plain attribute)."""

    def __init__(self, package: str, names: Mapping[str, str], namespace: dict[str, Any]) -> None:
        self.package, self.names, self.namespace = package, dict(names), namespace

    def get(self, name: str) -> Any:
        module = self.names.get(name)
        if module is None:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        self.namespace[name] = value
        return value

    def dir(self, exported: Iterable[str]) -> list[str]:
        return sorted(set(self.namespace) | set(exported))
