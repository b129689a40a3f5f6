"""The edge node's error tree (every layer keeps its errors in its own ``errors.py``)::

    NodeError               base: a message and a ``hint`` (how to fix it); the CLI prints one line
    ├── ConfigError         NODE.toml missing, unreadable, a bad or unknown key
    ├── InvalidInput        an inference or sample request with wrong names, shapes, dtypes or labels
    ├── StoreError          the sample store is full (retention "reject") or unusable
    ├── NodeBusy            a round command arrived while another round runs
    └── RoundFailed         a training round could not finish (nothing of it was applied)
"""

from __future__ import annotations

from fractal import FractalError

__all__ = ["NodeError", "ConfigError", "InvalidInput", "StoreError", "NodeBusy", "RoundFailed"]


class NodeError(FractalError):
    """Base of every error the edge node raises on purpose (a user can act on it)."""


class ConfigError(NodeError):
    pass


class InvalidInput(NodeError):
    """Bad request data; the HTTP layer answers 400 (or 404 for an unknown model)."""


class StoreError(NodeError):
    pass


class NodeBusy(NodeError):
    pass


class RoundFailed(NodeError):
    def __init__(self, message: str, *, member: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.member = member
