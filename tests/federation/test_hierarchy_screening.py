"""Outlier screening across the hierarchy's levels (federation/hierarchy.py
``HierarchicalCollective._screened``), driven by the real screened mean
(federation/aggregators/screened.py) on the in-memory transport: the round-wide screen keeps the
same members everywhere, and each way a member or a site leader can cheat across levels is
caught (before this, a hierarchical round refused screening, so a round past one ring ran
unscreened)."""

from __future__ import annotations

import numpy as np

from federation.aggregators.base import Step
from federation.aggregators.screened import ScreenedMean
from federation.errors import RoundAborted, UpdateRejected
from federation.hierarchy import LEVEL_CLAIMS, HierarchicalAllreduce, HierarchicalCollective, Topology
from federation.memory import MemoryHub
from federation.ring import RingAllreduce
from tests.federation.ringutil import assert_identical, bits, run_members

FACTOR = 3.0


def _topology(sizes: list[int]) -> Topology:
    return Topology.from_groups({f"s{g}": [f"s{g}n{i}" for i in range(k)] for g, k in enumerate(sizes)})


def _collectives(topo: Topology, engine_of=None) -> dict[str, HierarchicalCollective]:
    sites = {s: MemoryHub() for s, _ in topo.sites}
    backbone = MemoryHub()
    out = {}
    for s, ms in topo.sites:
        for m in ms:
            make = (engine_of or {}).get(m, HierarchicalAllreduce)
            engine = make(RingAllreduce(sites[s].transport(m, max_payload=2048), retransmit_after=0.2),
                          RingAllreduce(backbone.transport(m, max_payload=2048), retransmit_after=0.2))
            col = HierarchicalCollective(engine.site, engine.backbone, topo)
            col.engine = engine
            out[m] = col
    return out


def _combine(cols: dict[str, HierarchicalCollective], topo: Topology, vecs: dict[str, np.ndarray], tag: str,
             timeout: float = 5.0, contributors: tuple[bool, ...] | None = None) -> dict[str, object]:
    group = tuple(topo.members)
    contrib = contributors or tuple(True for _ in group)

    def one(m: str):
        step = Step(cols[m], m, group, contrib, tag, 0, timeout, outlier_factor=FACTOR)
        return ScreenedMean().combine(step, vecs[m])

    try:
        return run_members({m: (lambda m=m: one(m)) for m in group})
    finally:
        for c in cols.values():
            c.engine.close()


def _updates(topo: Topology, seed: int, length: int = 700) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {m: rng.standard_normal(length).astype(np.float32) for m in topo.members}


def test_screening_spans_sites_and_every_member_keeps_the_same_members() -> None:
    topo = _topology([3, 4, 2])
    vecs = _updates(topo, 1)
    vecs["s1n2"] = vecs["s1n2"] * np.float32(50)  # an outlier far from its site's leader
    vecs["s2n1"] = np.full_like(vecs["s2n1"], np.nan)  # a non-finite update at a two-member site
    res = _combine(_collectives(topo), topo, vecs, "scr")
    combined = {m: r for m, r in res.items() if m != "_elapsed"}
    for m, r in combined.items():
        assert not isinstance(r, BaseException), f"{m} raised {r!r}"
    got = assert_identical({m: r.update for m, r in combined.items()})  # type: ignore[union-attr]
    for r in combined.values():
        assert set(r.excluded) == {"s1n2", "s2n1"}  # type: ignore[union-attr]
    kept = [m for m in topo.members if m not in ("s1n2", "s2n1")]
    ref = np.stack([vecs[m].astype(np.float64) for m in kept]).mean(axis=0)
    assert np.max(np.abs(got - ref)) < 1e-5


def test_members_without_samples_send_zeros_and_count_nowhere() -> None:
    topo = _topology([2, 2])
    vecs = _updates(topo, 2)
    vecs["s0n1"] = np.zeros_like(vecs["s0n1"])
    contributors = tuple(m != "s0n1" for m in topo.members)
    res = _combine(_collectives(topo), topo, vecs, "nos", contributors=contributors)
    got = assert_identical({m: r.update for m, r in res.items() if m != "_elapsed"})  # type: ignore[union-attr]
    kept = [m for m in topo.members if m != "s0n1"]
    assert np.max(np.abs(got - np.stack([vecs[m] for m in kept]).astype(np.float64).mean(axis=0))) < 1e-5


class _TamperClaims(HierarchicalAllreduce):
    """A member holding a valid key that writes into another member's slot of the claims gather
    (to get an honest member excluded, or to hide an outlier's norm)."""

    victim = 0

    def allreduce(self, vec, *, topology, tag, op="mean", timeout=30.0, **kw):
        if tag.endswith(LEVEL_CLAIMS):
            vec = np.array(vec, np.float32)
            vec[self.victim] = np.float32(1e6)
        return super().allreduce(vec, topology=topology, tag=tag, op=op, timeout=timeout, **kw)


def test_a_member_that_alters_anothers_claim_in_the_gather_aborts_the_round_everywhere() -> None:
    topo = _topology([3, 3])
    _TamperClaims.victim = topo.members.index("s0n2")  # a member of the other site
    res = _combine(_collectives(topo, {"s1n1": _TamperClaims}), topo, _updates(topo, 3), "tc")
    for m in topo.members:
        assert isinstance(res[m], RoundAborted), f"{m} returned {res[m]!r}: a result from altered claims"
    # The victim's site saw its member's norm differ between the round and its one-hop claim.
    assert any(isinstance(res[m], UpdateRejected) and "altered" in str(res[m]) for m in topo.group("s0"))


class _InflatingLeader(HierarchicalAllreduce):
    """A site leader that adds to its site's sum before the backbone (claiming its real norm)."""

    def _backbone(self, partial, role, topology, tag, op, timeout, backbone_screen=None):
        if not tag.endswith(LEVEL_CLAIMS):  # (altering the claims gather is the test above)
            partial = partial * np.float32(40)
        return super()._backbone(partial, role, topology, tag, op, timeout, backbone_screen)


def test_a_leader_that_inflates_its_site_sum_is_named_by_the_other_leaders() -> None:
    topo = _topology([3, 3])
    leader = topo.leaders()[1]
    res = _combine(_collectives(topo, {leader: _InflatingLeader}), topo, _updates(topo, 4), "il")
    for m in topo.members:
        assert isinstance(res[m], RoundAborted), f"{m} returned {res[m]!r}: an inflated sum committed"
    other = topo.leaders()[0]
    assert isinstance(res[other], UpdateRejected) and res[other].member == leader, res[other]


class _DoctoringLeader(HierarchicalAllreduce):
    """A site leader that broadcasts a different result to its own site."""

    def _backbone(self, partial, role, topology, tag, op, timeout, backbone_screen=None):
        total = super()._backbone(partial, role, topology, tag, op, timeout, backbone_screen)
        return total if tag.endswith(LEVEL_CLAIMS) else total * np.float32(25)


def test_members_reject_a_result_their_leader_doctored_and_name_it() -> None:
    topo = _topology([3, 3])
    leader = topo.leaders()[0]
    res = _combine(_collectives(topo, {leader: _DoctoringLeader}), topo, _updates(topo, 5), "dl")
    for m in topo.group("s0"):
        if m != leader:
            assert isinstance(res[m], UpdateRejected) and res[m].member == leader, res[m]
    # The other site got the honest result (the leader's own broadcast is what it doctored).
    honest = [res[m] for m in topo.group("s1")]
    assert all(not isinstance(r, BaseException) for r in honest)
    assert len({bits(r.update) for r in honest}) == 1  # type: ignore[union-attr]
