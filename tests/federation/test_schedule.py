"""The pure ring schedule, checked symbolically (no transport, no numpy)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation import schedule as sch


@given(n=st.integers(1, 64), length=st.integers(0, 5000))
def test_chunk_bounds_cover_the_vector_evenly(n: int, length: int) -> None:
    bounds = sch.chunk_bounds(n, length)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    for (_, b), (c, _) in zip(bounds, bounds[1:], strict=False):
        assert b == c  # contiguous, no gap, no overlap
    sizes = [b - a for a, b in bounds]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert sum(sizes) == length


@given(start=st.integers(0, 1000), count=st.integers(0, 1000), per=st.integers(1, 300), one=st.booleans())
def test_part_bounds_split_a_range(start: int, count: int, per: int, one: bool) -> None:
    parts = sch.part_bounds(start, start + count, per, at_least_one=one)
    covered = [i for a, b in parts for i in range(a, b)]
    assert covered == list(range(start, start + count))
    if count:
        assert all(0 < b - a <= per for a, b in parts)
    else:
        assert parts == ([(start, start)] if one else [])


def simulate(n: int) -> list[list[set[int] | None]]:
    """Run the schedule on symbols: held[r][c] = set of ranks whose contribution rank r holds
    for chunk c. Asserts that sends and receives pair up and nothing is added twice."""
    held: list[list[set[int] | None]] = [[{r} for _ in range(n)] for r in range(n)]
    plans = [sch.plan(n, r) for r in range(n)]
    for stage in (sch.Stage.REDUCE_SCATTER, sch.Stage.ALL_GATHER):
        for step in range(n - 1):
            sends = {}
            for r in range(n):
                (t,) = [t for t in plans[r] if t.stage == stage and t.step == step]
                assert t.dst == (r + 1) % n and t.src == (r - 1) % n
                sends[t.dst] = (t.send_chunk, set(held[r][t.send_chunk]))
            for r in range(n):
                (t,) = [t for t in plans[r] if t.stage == stage and t.step == step]
                chunk, contrib = sends[r]
                assert chunk == t.recv_chunk, "the predecessor sends the chunk this rank expects"
                if stage == sch.Stage.REDUCE_SCATTER:
                    assert not (contrib & held[r][chunk]), "an element would be reduced twice"
                    held[r][chunk] = held[r][chunk] | contrib
                else:
                    assert contrib == set(range(n)), "all-gather forwards only complete chunks"
                    held[r][chunk] = contrib
        if stage == sch.Stage.REDUCE_SCATTER:
            for r in range(n):
                assert held[r][sch.owned_chunk(r, n)] == set(range(n))
                assert sch.owner(sch.owned_chunk(r, n), n) == r
    return held


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24))
def test_every_element_reduced_once_and_every_member_ends_with_every_chunk(n: int) -> None:
    held = simulate(n)
    for r in range(n):
        for c in range(n):
            assert held[r][c] == set(range(n)), f"rank {r} lacks contributions to chunk {c}"


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_each_rank_sends_each_chunk_once_per_stage(n: int) -> None:
    for r in range(n):
        rs = [t.send_chunk for t in sch.reduce_scatter(n, r)]
        ag = [t.send_chunk for t in sch.all_gather(n, r)]
        assert len(set(rs)) == len(rs) == n - 1 and sch.owned_chunk(r, n) not in rs
        assert len(set(ag)) == len(ag) == n - 1 and (ag[0] == sch.owned_chunk(r, n) if n > 1 else True)


def test_chain_and_bad_arguments() -> None:
    assert sch.chain(4, 2) == [2, 3, 0, 1]
    with pytest.raises(ValueError):
        sch.chunk_bounds(0, 10)
    with pytest.raises(ValueError):
        sch.chunk_bounds(3, -1)
    with pytest.raises(ValueError):
        sch.reduce_scatter(3, 3)
    with pytest.raises(ValueError):
        sch.part_bounds(0, 10, 0)
