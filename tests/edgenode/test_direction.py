"""The direction check of the screened aggregators (issue 26 finding 9, issue 27), on four real
EdgeNodes in one process (MemoryHub, the compiled digits-mlp training step) over the non-IID
digits split of tests/edgenode/learning.py.

A member sending its gradient x -4 stays under the norm screen (4 x is below the outlier factor
of 10) but points against the other members' median: it is excluded and named in every step on
every member, and the round commits without it. Honest non-IID members are never excluded.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from federation import robust
from tests.edgenode import learning


@pytest.fixture
def opposed_calls(monkeypatch):
    """Every result of the direction check (one per member and step), in call order."""
    calls: list[dict[int, str]] = []
    lock = threading.Lock()
    real = robust.opposed

    def spy(rows, kept, min_cosine):
        out = real(rows, kept, min_cosine)
        with lock:
            calls.append(dict(out))
        return out

    monkeypatch.setattr(robust, "opposed", spy)
    return calls


def _swarm(digits_artifact, hostile, aggregation="mean", epochs=4):
    from compiler import load_artifact

    art = load_artifact(digits_artifact)
    xtr, _, ytr, _ = learning.load_split()
    shards = learning.non_iid_shards(ytr)
    with tempfile.TemporaryDirectory() as tmp:
        nodes, steps, _ = learning.swarm(digits_artifact, art, xtr, ytr, shards, epochs=epochs, lr=0.1,
                                         workdir=Path(tmp), aggregation=aggregation, hostile=hostile)
        try:
            return steps, {n.node_id: (n.last_result.excluded, n.params_sha256, n.model_version)
                           for n in nodes}
        finally:
            for n in nodes:
                n.stop()


def test_a_member_sending_its_gradient_times_minus_4_is_excluded_in_every_step(digits_artifact,
                                                                              opposed_calls):
    steps, out = _swarm(digits_artifact, hostile=-4.0)
    assert len(opposed_calls) == 4 * steps  # every member checked every step (the direct path)
    assert all(set(c) == {1} for c in opposed_calls), [c for c in opposed_calls if set(c) != {1}][:3]
    assert all("points away from the members' median" in c[1] for c in opposed_calls)
    assert {v[2] for v in out.values()} == {1} and len({v[1] for v in out.values()}) == 1  # committed
    assert all(list(v[0]) == ["lq1"] and v[0]["lq1"].startswith("step 0: ") for v in out.values()), out


@pytest.mark.parametrize("aggregation", ["mean", "median"])
def test_honest_non_iid_members_are_never_excluded(digits_artifact, opposed_calls, aggregation):
    steps, out = _swarm(digits_artifact, hostile=None, aggregation=aggregation)
    assert len(opposed_calls) == 4 * steps
    assert not any(opposed_calls), [c for c in opposed_calls if c][:3]
    assert all(v[0] == {} and v[2] == 1 for v in out.values()), out


def test_the_direction_check_is_a_pure_rule():
    rng = np.random.default_rng(0)
    honest = rng.standard_normal((3, 100)).astype(np.float32) + 1.0  # a shared direction plus noise
    rows = np.vstack([honest, -4 * honest[1]])
    got = robust.opposed(rows, (0, 1, 2, 3), 0.0)
    assert set(got) == {3} and "cosine -" in got[3]
    assert robust.opposed(rows, (0, 1, 2), 0.0) == {}  # honest rows agree
    assert robust.opposed(rows[:2], (0, 1), 0.0) == {}  # 2 rows: nothing to tell apart
    assert robust.opposed(np.zeros((4, 100), np.float32), (0, 1, 2, 3), 0.0) == {}  # no direction
