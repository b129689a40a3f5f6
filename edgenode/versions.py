"""The last few committed parameter versions of a node, on disk, for a swarm-wide rollback.

``data_dir/versions/v{N}.npz`` holds version N (the float32 arrays and their sha256, written
atomically); only the newest ``keep`` are kept. Version 0, the artifact's shipped parameters, is
always available from the artifact itself. Rolling back to N forgets the versions above N: the
next round commits N+1 again, so a version number names one parameter set per node history.
"""

from __future__ import annotations

import io
import json
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgenode.common import get_logger, params_sha256
from edgenode.errors import NodeError
from fractal.files import atomic_write

__all__ = ["ParamVersions"]

log = get_logger("versions")
_NAME = re.compile(r"^v(\d+)\.npz$")


class ParamVersions:
    """Thread-safe; ``shipped()`` returns the artifact's parameters (version 0)."""

    def __init__(self, directory: str | Path, *, keep: int,
                 shipped: Callable[[], Sequence[np.ndarray]]) -> None:
        if keep < 1:
            raise NodeError(f"keep_versions must be at least 1, not {keep}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._shipped = shipped
        self._lock = threading.Lock()

    def _on_disk(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.match(p.name)))

    def available(self) -> list[int]:
        """Versions a rollback can go to (0 always), ascending."""
        with self._lock:
            return sorted({0, *self._on_disk()})

    def save(self, version: int, params: Sequence[np.ndarray]) -> None:
        """Keep ``params`` as ``version`` (replacing a file of that number), then drop the oldest
        beyond ``keep``. Version 0 needs no file."""
        if version == 0:
            return
        arrays: dict[str, Any] = {f"p{i}": np.asarray(p, np.float32) for i, p in enumerate(params)}
        arrays["__meta__"] = np.array(json.dumps({"version": version, "sha256": params_sha256(params),
                                                  "count": len(params)}))
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        with self._lock:
            atomic_write(self.dir / f"v{version}.npz", buf.getvalue())
            for old in self._on_disk()[:-self.keep]:
                (self.dir / f"v{old}.npz").unlink(missing_ok=True)

    def has(self, version: int) -> bool:
        return version in self.available()

    def load(self, version: int) -> list[np.ndarray]:
        """The parameters of ``version``; NodeError when they are not kept (or the file is damaged)."""
        if version == 0:
            return [np.array(p, np.float32) for p in self._shipped()]
        path = self.dir / f"v{version}.npz"
        try:
            with self._lock, np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["__meta__"]))
                params = [np.array(z[f"p{i}"]) for i in range(int(meta["count"]))]
        except FileNotFoundError:
            raise NodeError(f"parameter version {version} is not kept here (kept: {self.available()})",
                            hint="roll back to a kept version") from None
        except Exception as exc:  # noqa: BLE001 - damaged file: refuse, never load half of it
            raise NodeError(f"parameter version {version} is unreadable: {exc}") from None
        if params_sha256(params) != meta["sha256"]:
            raise NodeError(f"parameter version {version} fails its sha256 check")
        return params

    def drop_after(self, version: int) -> None:
        """Forget every version above ``version`` (after a rollback to it)."""
        with self._lock:
            for v in self._on_disk():
                if v > version:
                    (self.dir / f"v{v}.npz").unlink(missing_ok=True)
