"""The fleet as the aggregator of asynchronous rounds (federation/PROTOCOL.md section 13).

Only the leading fleet process aggregates (federation/PROTOCOL.md section 12); it keeps the
current version in the fleet's database, so a process that takes the lead resumes from it.
Version 0 is read from the artifact's ``params.npz`` (keys ``p0000``.. in manifest order, the
order a node flattens its parameters in) with numpy alone: the fleet loads no compiler.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import numpy as np

from api.fleet.errors import FleetError
from api.fleet.history import FleetHistory
from api.fleet.settings import FleetSettings
from federation.asyncagg import Aggregator, fits_one_message, initial_version
from federation.transport import PubSubLink

__all__ = ["load_version0", "start_aggregator"]


def load_version0(path: str | Path) -> np.ndarray:
    """The flat float32 parameters of an artifact directory (or its params.npz)."""
    p = Path(path)
    if p.is_dir():
        p = p / "params.npz"
    try:
        with np.load(p, allow_pickle=False) as z:
            keys = sorted(k for k in z.files if k.startswith("p"))
            if not keys:
                raise ValueError("no parameters p0000.. in it")
            params = np.concatenate([np.asarray(z[k], np.float32).ravel() for k in keys])
    except (OSError, ValueError) as exc:
        raise FleetError(f"cannot read async version 0 from {p}: {exc}",
                         hint="point async_params at the artifact directory the nodes run") from None
    if not fits_one_message(params.size):
        raise FleetError(f"the model in {p} ({params.size} parameters) is too large for asynchronous rounds "
                         "(a version travels as one 2 MiB message)", hint="run synchronous rounds for it")
    return params


class KvVersionStore:
    """The current version in the fleet's database (``kv`` row ``async.version``, base64): on
    PostgreSQL the process that takes the lead resumes from the version the last leader made."""

    KEY = "async.version"

    def __init__(self, history: FleetHistory) -> None:
        self.history = history

    def load(self) -> bytes | None:
        raw = self.history.get_value(self.KEY)
        return None if raw is None else base64.b64decode(raw)

    def save(self, data: bytes) -> None:
        self.history.set_value(self.KEY, base64.b64encode(data).decode())


def start_aggregator(settings: FleetSettings, link: PubSubLink, history: FleetHistory, *,
                     on_change: Callable[[], None] | None = None) -> Aggregator:
    """The leading fleet process's aggregator, resumed from the version in the database;
    ``on_change`` is called after every update it takes, refuses or aggregates."""
    v0 = initial_version(load_version0(settings.async_params))
    return Aggregator(link, v0, buffer=settings.async_buffer, max_staleness=settings.async_max_staleness,
                      refresh_s=settings.async_refresh_s, on_change=on_change,
                      store=KvVersionStore(history)).start()
