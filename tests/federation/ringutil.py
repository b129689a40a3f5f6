"""Helpers to run N ring members as threads in one process over a MemoryHub."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from federation.memory import MemoryHub
from federation.ring import RingAllreduce


def ids(n: int) -> list[str]:
    return [f"m{i}" for i in range(n)]


def make_ring(n: int, *, faults: dict[str, dict] | None = None, max_payload: int = 128 * 1024,
              engine_kw: dict | None = None, hub: MemoryHub | None = None):
    """(hub, {member: RingAllreduce}) for members m0..m{n-1}."""
    hub = hub or MemoryHub()
    faults = faults or {}
    engines = {
        m: RingAllreduce(hub.transport(m, max_payload=max_payload, **faults.get(m, {})), **(engine_kw or {}))
        for m in ids(n)
    }
    return hub, engines


def close_all(engines: dict[str, RingAllreduce]) -> None:
    for e in engines.values():
        e.close()


def run_members(fns: dict[str, Callable[[], object]], *, join_timeout: float = 60.0) -> dict[str, object]:
    """Run one callable per member in threads; returns member -> result or raised exception,
    plus ``_elapsed`` -> member -> seconds until that member returned or raised."""
    out: dict[str, object] = {}
    elapsed: dict[str, float] = {}
    t0 = time.monotonic()

    def work(m: str, fn: Callable[[], object]) -> None:
        try:
            out[m] = fn()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out[m] = e
        elapsed[m] = time.monotonic() - t0

    threads = [threading.Thread(target=work, args=(m, fn), daemon=True) for m, fn in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    assert not any(t.is_alive() for t in threads), "a member hung"
    out["_elapsed"] = elapsed
    return out


def allreduce_all(engines: dict[str, RingAllreduce], vecs: dict[str, np.ndarray], *,
                  group: Sequence[str] | None = None, **kw) -> dict[str, object]:
    group = list(group or engines)
    return run_members({m: (lambda m=m: engines[m].allreduce(vecs[m], group=group, **kw)) for m in group})


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def assert_identical(results: dict[str, object]) -> np.ndarray:
    """Every member returned an array and all are bit-identical; returns one of them."""
    arrays = {m: r for m, r in results.items() if m != "_elapsed"}
    for m, r in arrays.items():
        assert isinstance(r, np.ndarray), f"{m} raised {r!r}"
    first = next(iter(arrays.values()))
    for m, r in arrays.items():
        assert bits(r) == bits(first), f"{m}'s result differs from the others"
    return first
