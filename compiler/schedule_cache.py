"""Per-machine cache of the default schedules' measured choices (untuned builds).

On a machine that runs the target, :func:`compiler.schedules.schedule_prepared` times a few
schedule variants of each kernel and keeps the fastest; that timing was most of an untuned
compile (ResNet-50: ~120 s of ~180 s on this 2-core machine). A :class:`Decisions` remembers
each choice by the kernel's workload, so a kernel seen before (the same model compiled again,
another model with the same layer shapes) is not built and timed again, and identical kernels
in one compile are timed once. Layout (``root``, default ``user_cache_dir("fractal-edge")/schedules``,
beside the tuning databases; ``$FRACTAL_SCHEDULE_CACHE`` overrides it, ``off`` disables it)::

    root/<target key>/<compiler version>.json   {"format": 1, "decisions": {<workload>: {...}}}

``<target key>`` is the tuning databases' (:func:`compiler.tuning._target_key`: the target without
its core count); ``<compiler version>`` hashes TVM's version and the source of
:mod:`compiler.schedules`, so changed rules or variants never reuse an old choice; ``<workload>``
hashes the kernel's TIR as the scheduler sees it (shapes, dtypes, layout, fused epilogue; not
its name). A choice is a variant label of :func:`compiler.schedules.schedule_prepared`
(``naive``, ``fused``, ``rows``, ``narrow``, ``tile1x8``, ...), with the times (us) it was made on.
Only untuned builds use the cache; tuned builds race their records against freshly timed defaults.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from fractal.files import atomic_write

__all__ = ["Decisions", "cache_root", "workload_key"]

FORMAT = 1
_ENV = "FRACTAL_SCHEDULE_CACHE"


def cache_root() -> Path | None:
    """Where decisions live: ``$FRACTAL_SCHEDULE_CACHE`` (``off``: nowhere), else
    ``platformdirs.user_cache_dir("fractal-edge")/schedules``."""
    env = os.environ.get(_ENV)
    if env is not None and env.strip().lower() in ("off", "0", "none", ""):
        return None
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("fractal-edge")) / "schedules"


def workload_key(func: Any) -> str:
    """A kernel's workload: the hash of its printed TIR (deterministic across processes; fused
    kernels are private functions, printed as ``main``, so the name does not enter)."""
    return hashlib.sha256(func.script().encode()).hexdigest()[:24]


def _version() -> str:
    import tvm

    src = (Path(__file__).resolve().parent / "schedules.py").read_bytes()
    return hashlib.sha256(tvm.__version__.encode() + b"\0" + src).hexdigest()[:16]


class Decisions:
    """The measured choices for one target: read from ``root`` (when given) at creation,
    written back by :meth:`save` (merged with what other compiles wrote meanwhile)."""

    def __init__(self, target: Any, root: Path | None) -> None:
        from compiler.tuning import _target_key

        self.path = root / _target_key(target) / f"{_version()}.json" if root is not None else None
        self._known: dict[str, dict[str, Any]] = self._read()
        self._new: dict[str, dict[str, Any]] = {}
        self.hits = 0  # kernels whose choice came from the cache
        self.timed = 0  # workloads timed in this process

    def _read(self) -> dict[str, dict[str, Any]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return {}
        found = data.get("decisions")
        return found if isinstance(found, dict) else {}

    def get(self, key: str) -> str | None:
        """The variant chosen for workload ``key`` before, or None."""
        entry = self._new.get(key) or self._known.get(key)
        choice = entry.get("choice") if isinstance(entry, dict) else None
        return choice if isinstance(choice, str) else None

    def put(self, key: str, choice: str, times_us: dict[str, float], *, timed: bool = True) -> None:
        """Record ``choice`` for workload ``key`` (``timed``: its variants were timed here)."""
        self._new[key] = {"choice": choice, "us": {k: round(v, 2) for k, v in times_us.items()}}
        self.timed += timed

    def save(self) -> None:
        """Write the new choices (atomically; a compile running beside this one may have added
        others since this one read the file: they are kept). A cache that cannot be written is
        skipped: the build does not depend on it."""
        if self.path is None or not self._new:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), **self._new}
            atomic_write(self.path, json.dumps({"format": FORMAT, "decisions": merged}, sort_keys=True))
        except OSError:
            return
        self._known, self._new = merged, {}
