"""Hierarchical allreduce (federation/hierarchy.py) on the in-memory transport: the pure plan,
results against numpy (bit for bit where the sums are exact), bit-identical members in every
site, a leader killed mid-round (everyone aborts, nobody returns a result; the next round elects
the next member and commits), and the vote across levels."""

from __future__ import annotations

import numpy as np
import pytest

from federation.errors import RoundAborted
from federation.hierarchy import HierarchicalAllreduce, Topology, plan
from federation.memory import MemoryHub
from federation.ring import RingAllreduce
from tests.federation.ringutil import assert_identical, bits, run_members


def _topology(sizes: list[int]) -> Topology:
    return Topology.from_groups({f"s{g}": [f"s{g}n{i}" for i in range(k)] for g, k in enumerate(sizes)})


def _engines(topo: Topology, **kw) -> tuple[dict[str, MemoryHub], MemoryHub,
                                            dict[str, HierarchicalAllreduce]]:
    """One hub per site (its broker), one backbone hub; every member gets both engines."""
    sites = {s: MemoryHub() for s, _ in topo.sites}
    backbone = MemoryHub()
    engines = {}
    for s, ms in topo.sites:
        for m in ms:
            engines[m] = HierarchicalAllreduce(
                RingAllreduce(sites[s].transport(m, max_payload=2048), retransmit_after=0.2, **kw),
                RingAllreduce(backbone.transport(m, max_payload=2048), retransmit_after=0.2, **kw))
    return sites, backbone, engines


def _run(engines, topo, vecs, *, tag, op, timeout=10.0, members=None):
    members = members or topo.members
    return run_members({m: (lambda m=m: engines[m].allreduce(vecs[m], topology=topo, tag=tag, op=op,
                                                             timeout=timeout)) for m in members})


def test_plan_elects_the_lowest_member_of_each_site_and_reelects_without_it() -> None:
    topo = Topology.of({"b2": "B", "a1": "A", "b1": "B", "a0": "A", "c9": "C"})
    assert topo.sites == (("A", ("a0", "a1")), ("B", ("b1", "b2")), ("C", ("c9",)))
    assert topo.leaders() == ["a0", "b1", "c9"]
    r = plan(topo, "a1")
    assert (r.site, r.leader, r.is_leader, r.leaders) == ("A", "a0", False, ("a0", "b1", "c9"))
    assert plan(topo, "b1").is_leader
    nxt = topo.without(["a0", "c9"])
    assert nxt.leaders() == ["a1", "b1"] and nxt.size == 3
    with pytest.raises(ValueError, match="sites"):
        Topology.from_groups({"A": ["x"], "B": ["x"]})
    with pytest.raises(ValueError, match="not a participant"):
        plan(topo, "zz")


@pytest.mark.parametrize("sizes", [[1], [3], [2, 3], [4, 1, 3], [5, 5, 5, 5]])
def test_result_equals_numpy_bit_for_bit_on_exact_sums_and_is_identical(sizes: list[int]) -> None:
    topo = _topology(sizes)
    n = topo.size
    rng = np.random.default_rng(n)
    _, _, engines = _engines(topo)
    try:
        for i, length in enumerate([0, 1, n + 1, 1500]):
            # Integer-valued floats: every partial sum is exact, so any summation order gives
            # numpy's bits; the mean rounds once (sum / n), as numpy's does.
            vecs = {m: rng.integers(-1000, 1000, length).astype(np.float32) for m in topo.members}
            stack = np.stack([vecs[m] for m in topo.members]) if length else np.zeros((n, 0), np.float32)
            for op in ("sum", "mean"):
                got = assert_identical(_run(engines, topo, vecs, tag=f"e{i}{op}", op=op))
                ref = (stack.sum(axis=0, dtype=np.float32) if op == "sum"
                       else stack.mean(axis=0, dtype=np.float32))
                assert bits(got) == bits(ref)
            # Arbitrary floats: identical on every member, within float32 rounding of numpy.
            vecs = {m: rng.standard_normal(length).astype(np.float32) for m in topo.members}
            got = assert_identical(_run(engines, topo, vecs, tag=f"f{i}", op="sum"))
            ref = np.stack([vecs[m].astype(np.float64) for m in topo.members]).sum(axis=0) if length else 0
            tol = n * np.finfo(np.float32).eps * sum(np.abs(v) for v in vecs.values()) + 1e-6
            assert np.all(np.abs(got - ref) <= tol)
    finally:
        for e in engines.values():
            e.close()


def test_a_leader_killed_mid_round_aborts_everywhere_and_the_next_round_reelects() -> None:
    topo = _topology([3, 3])
    sites, backbone, engines = _engines(topo)
    victim = topo.leaders()[0]  # s0n0
    # The victim dies (both links) right after its first backbone frame: its site has reduced,
    # the leaders' ring has started, its site waits for its broadcast.
    bt = engines[victim].backbone.endpoint.transport
    send = bt.send

    def send_then_die(dst: str, payload: bytes) -> None:
        send(dst, payload)
        sites["s0"].kill(victim)
        backbone.kill(victim)

    bt.send = send_then_die  # type: ignore[method-assign]
    vecs = {m: np.full(20000, i + 1, np.float32) for i, m in enumerate(topo.members)}
    try:
        res = _run(engines, topo, vecs, tag="k1", op="mean", timeout=3.0)
        alive = [m for m in topo.members if m != victim]
        for m in alive:
            assert isinstance(res[m], RoundAborted), f"{m} returned {res[m]!r}: a partial commit"
        # The site of the dead leader heard its ABORT or timed out; nobody waited past the deadline.
        assert max(res["_elapsed"][m] for m in alive) < 3.0 * 2.5
        # The fleet sees it offline; the next round leaves it out and s0n1 leads site s0.
        nxt = topo.without([victim])
        assert nxt.leaders() == ["s0n1", "s1n0"]
        got = assert_identical(_run(engines, nxt, vecs, tag="k2", op="sum", members=nxt.members))
        assert bits(got) == bits(np.full(20000, sum(i + 1 for i in range(1, 6)), np.float32))
    finally:
        for e in engines.values():
            e.close()


def test_vote_aggregates_per_site_and_names_the_site_that_did_not_prepare() -> None:
    topo = _topology([2, 3, 2])
    _, _, engines = _engines(topo)
    try:
        res = run_members({m: (lambda m=m: engines[m].vote(True, topology=topo, tag="v1", timeout=5))
                           for m in topo.members})
        assert all(res[m] == [] for m in topo.members)
        res = run_members({m: (lambda m=m: engines[m].vote(m != "s1n2", topology=topo, tag="v2", timeout=5))
                           for m in topo.members})
        assert all(res[m] == ["s1"] for m in topo.members)
    finally:
        for e in engines.values():
            e.close()


def test_round_sites_and_the_command_keep_every_ring_within_one_ring_size() -> None:
    from pydantic import ValidationError

    from federation import bounds as b
    from federation.hierarchy import round_sites
    from federation.messages import RoundCommand

    few = [f"n{i}" for i in range(10)]
    assert round_sites(few, {}) is None  # one site, one ring: flat, as before
    assert round_sites(few, {"n0": "a"}) == {"a": ["n0"], "default": few[1:]}
    many = [f"n{i:03d}" for i in range(130)]
    sites = round_sites(many, {})
    assert sites is not None and [len(v) for v in sites.values()] == [44, 43, 43]
    cmd = RoundCommand(round_id="r", participants=many, steps=1, sites=sites)
    assert Topology.from_groups(cmd.sites or {}).leaders() == ["n000", "n044", "n087"]
    with pytest.raises(ValidationError, match="flat ring takes at most"):
        RoundCommand(round_id="r", participants=many, steps=1)
    with pytest.raises(ValidationError, match="per site"):
        RoundCommand(round_id="r", participants=many, steps=1, sites={"a": many[:65], "b": many[65:]})
    with pytest.raises(ValidationError, match="exactly once"):
        RoundCommand(round_id="r", participants=few, steps=1, sites={"a": few[:5], "b": few[4:]})
    with pytest.raises(ValidationError):
        RoundCommand(round_id="r", participants=[f"n{i}" for i in range(b.PARTICIPANTS_MAX + 1)], steps=1,
                     sites=round_sites([f"n{i}" for i in range(b.PARTICIPANTS_MAX + 1)], {}))


def test_a_round_of_130_members_in_sites_of_at_most_one_ring_sums_exactly() -> None:
    from federation.hierarchy import round_sites
    from federation.messages import RoundCommand

    members = [f"n{i:03d}" for i in range(130)]
    site_of = {m: ("east" if i < 70 else "west") for i, m in enumerate(members)}
    cmd = RoundCommand(round_id="big", participants=members, steps=1, sites=round_sites(members, site_of))
    assert cmd.sites is not None and sorted(map(len, cmd.sites.values())) == [35, 35, 60]
    topo = Topology.from_groups(cmd.sites)
    hubs = {s: MemoryHub() for s, _ in topo.sites}
    backbone = MemoryHub()
    leaders = set(topo.leaders())
    engines = {m: HierarchicalAllreduce(
        RingAllreduce(hubs[topo.site_of(m)].transport(m), retransmit_after=0.5),
        RingAllreduce(backbone.transport(m), retransmit_after=0.5) if m in leaders else None)
        for m in members}
    try:
        vecs = {m: np.full(3000, i % 7 - 3, np.float32) for i, m in enumerate(members)}
        got = assert_identical(_run(engines, topo, vecs, tag="big", op="mean", timeout=30))
        stack = np.stack([vecs[m] for m in members])
        assert bits(got) == bits(stack.mean(axis=0, dtype=np.float32))
        # The three leaders reduced over the backbone; nobody else has a backbone engine.
        assert all(engines[m].backbone.stats.data_frames_sent > 0 for m in leaders)  # type: ignore[union-attr]
    finally:
        for e in engines.values():
            e.close()


def test_the_collective_broadcasts_the_roots_exact_bytes_and_refuses_what_spans_no_levels() -> None:
    from federation.hierarchy import HierarchicalCollective

    topo = _topology([2, 3])
    _, _, engines = _engines(topo)
    cols = {m: HierarchicalCollective(e.site, e.backbone, topo) for m, e in engines.items()}
    root = "s1n2"  # not a leader: its bytes cross its site, the backbone and the other site
    vec = np.array([0.0, -0.0, 1e-45, -3.0e38, 7.25, -1e-30], np.float32)
    try:
        res = run_members({m: (lambda m=m: cols[m].broadcast(vec if m == root else None, root=root,
                                                             group=topo.members, tag="p/params", timeout=10))
                           for m in topo.members})
        assert bits(assert_identical(res)) == bits(vec)
        with pytest.raises(RoundAborted, match="uncompressed"):
            cols["s0n0"].allreduce(vec, group=topo.members, tag="s", compression="int8")
        with pytest.raises(RoundAborted, match="all-gather"):
            cols["s0n0"].exchange(vec, group=topo.members, tag="x")
        with pytest.raises(ValueError, match="participants"):
            cols["s0n0"].allreduce(vec, group=["s0n0", "s0n1"], tag="g")
    finally:
        for e in engines.values():
            e.close()
