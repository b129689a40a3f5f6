"""StarAllreduce (the baseline) over the in-memory transport."""

from __future__ import annotations

import numpy as np
import pytest

from federation.errors import RoundAborted, UpdateRejected
from federation.memory import MemoryHub
from federation.star import StarAllreduce
from tests.federation.ringutil import assert_identical, ids, run_members


def _star(n, **faults):
    hub = MemoryHub()
    return {m: StarAllreduce(hub.transport(m, max_payload=1024, **faults.get(m, {}))) for m in ids(n)}


def _run(engines, vecs, tag, **kw):
    group = list(engines)
    return run_members({m: (lambda m=m: engines[m].allreduce(vecs[m], group=group, tag=tag, **kw))
                        for m in engines})


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_star_matches_numpy_and_is_bit_identical(n: int) -> None:
    engines = _star(n)
    try:
        for i, length in enumerate([0, 1, n + 1, 1234]):
            rng = np.random.default_rng(i)
            vecs = {m: rng.standard_normal(length).astype(np.float32) for m in engines}
            for op in ("sum", "mean"):
                got = assert_identical(_run(engines, vecs, f"s{i}{op}", op=op, timeout=10))
                ref = np.sum([v.astype(np.float64) for v in vecs.values()], axis=0)
                np.testing.assert_allclose(got, ref / (n if op == "mean" else 1), rtol=1e-5, atol=1e-5)
        # The coordinator carries (n - 1) vectors out, every other member one vector in.
        if n > 1:
            assert engines["m0"].stats.bytes_sent > (n - 1.5) * engines["m1"].stats.bytes_sent
    finally:
        for e in engines.values():
            e.close()


def test_star_with_int8_is_bit_identical_and_close() -> None:
    engines = _star(4)
    try:
        rng = np.random.default_rng(1)
        vecs = {m: rng.standard_normal(3000).astype(np.float32) for m in engines}
        got = assert_identical(_run(engines, vecs, "q", op="mean", compression="int8", timeout=10))
        ref = np.mean([v.astype(np.float64) for v in vecs.values()], axis=0)
        assert np.abs(got - ref).max() < 0.05
    finally:
        for e in engines.values():
            e.close()


def test_star_nan_and_dead_coordinator() -> None:
    engines = _star(3)
    try:
        vecs = {m: np.ones(100, np.float32) for m in engines}
        vecs["m1"][3] = np.nan
        res = _run(engines, vecs, "nan", timeout=5)
        assert all(isinstance(res[m], UpdateRejected) and res[m].member == "m1" for m in engines)
        engines["m0"].endpoint.transport.kill()
        vecs["m1"][3] = 1
        res = run_members({m: (lambda m=m: engines[m].allreduce(vecs[m], group=ids(3), tag="dead",
                                                               timeout=0.5)) for m in ("m1", "m2")})
        for m in ("m1", "m2"):
            assert isinstance(res[m], RoundAborted) and res[m].member == "m0", res[m]
    finally:
        for e in engines.values():
            e.close()
