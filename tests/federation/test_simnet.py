"""Simulated swarms (federation/linkmodel.py, federation/memory.py SimHub): the link model's
arithmetic, and a hundred members in groups of ten through the real ring, session, hierarchy
and aggregator with the model's clock. Assertions are on the model's time, never on wall clock."""

from __future__ import annotations

import numpy as np
import pytest

from bench.scale import groups_of, run_scale_bench, simulate
from federation.errors import FederationError
from federation.linkmodel import LinkModel, Network, broadcast_bound, ring_bound
from tests.federation.ringutil import bits


def test_uplinks_serialise_a_nodes_frames_and_a_broker_relay_is_shared() -> None:
    net = Network(LinkModel(uplink_bps=1000.0))
    b = net.broker("b", latency_s=0.01, relay_bps=1000.0)
    assert net.transmit(b, "a", "x", 100, ("a", "t", 1))  # uplink 0.1 s, relay 0.1 s, + 10 ms
    assert net.transmit(b, "c", "x", 100, ("c", "t", 1))  # c's own uplink; the relay is busy until 0.2
    assert net.transmit(b, "a", "x", 100, ("a", "t", 2))  # behind a's first frame: leaves a at 0.2
    for frame, at in ((("a", "t", 1), 0.21), (("c", "t", 1), 0.31), (("a", "t", 2), 0.41)):
        net.consumed("x", frame)
        assert net.clock("x") == pytest.approx(at, abs=2e-3)
    # x acts on data that came at 0.41: what it sends now leaves no earlier
    assert net.transmit(b, "x", "a", 50, ("x", "t", 1))
    net.consumed("a", ("x", "t", 1))
    assert net.clock("a") == pytest.approx(0.41 + 0.05 + 0.05 + 0.01, abs=2e-3)
    assert net.elapsed() == pytest.approx(net.clock("a"))
    net.reset()
    assert net.elapsed() == 0.0 and b.relayed == 0


def test_a_lost_frames_resend_leaves_one_modelled_timeout_later() -> None:
    net = Network(LinkModel(uplink_bps=1e9, loss=0.5, rto_s=0.2, seed=3))
    b = net.broker("b", latency_s=0.0)
    tries = 1
    while not net.transmit(b, "a", "x", 10, ("a", "t", 0)):
        tries += 1
    assert tries > 1, "seed 3 loses the first copy"
    net.consumed("x", ("a", "t", 0))
    assert net.clock("x") == pytest.approx(0.2 * (tries - 1), abs=1e-6) and net.lost == tries - 1


def test_bounds() -> None:
    assert ring_bound(10, 1000, 100) == pytest.approx(18.0) and ring_bound(1, 1000, 100) == 0
    assert broadcast_bound(10, 1000, 100) == 10.0 and broadcast_bound(1, 1000, 100) == 0
    with pytest.raises(ValueError, match="loss"):
        LinkModel(loss=1.0)


def test_a_hundred_members_in_groups_of_ten_through_the_real_code() -> None:
    """Flat ring and hierarchy (10 sites of 10, as the fleet cuts them) on a latency-bound network:
    every member ends with the exact sum's bytes; the flat ring pays its 2 (N - 1) alpha, the
    hierarchy far less, and neither beats its bandwidth bound."""
    n, length, alpha, uplink = 100, 1000, 0.005, 1e6
    rng = np.random.default_rng(7)
    members = [f"n{i:03d}" for i in range(n)]
    vecs = {m: rng.integers(-1000, 1000, length).astype(np.float32) for m in members}
    exact = np.stack(list(vecs.values())).sum(axis=0, dtype=np.float32)  # integer sums: exact
    link = LinkModel(uplink_bps=uplink)
    times = {}
    for kind in ("flat", "hierarchical"):
        results, net = simulate(kind, vecs, link=link, latency_s=alpha, relay_bps=1e9, group=10,
                                max_payload=1024, op="sum")
        assert len(results) == n and {bits(r) for r in results.values()} == {bits(exact)}, kind
        times[kind] = net.elapsed()
        assert net.frames > 2 * (n - 1)
    size = length * 4
    assert times["flat"] >= 2 * (n - 1) * alpha
    assert times["flat"] >= ring_bound(n, size, uplink)
    g, s = 10, len(groups_of(members, 10))
    assert s == 10
    hier_bound = ring_bound(g, size, uplink) + ring_bound(s, size, uplink) + broadcast_bound(g, size, uplink)
    # each level is a ring of 10 (or a chain of 10): 2 x 9 + 2 x 9 + 9 latencies at least
    assert times["hierarchical"] >= max(hier_bound, (2 * 9 + 2 * 9 + 9) * alpha)
    assert times["hierarchical"] < times["flat"] / 2


def test_lost_frames_are_healed_by_the_session_and_cost_modelled_time() -> None:
    rng = np.random.default_rng(1)
    vecs = {f"m{i}": rng.integers(-9, 9, 600).astype(np.float32) for i in range(6)}
    exact = np.stack(list(vecs.values())).sum(axis=0, dtype=np.float32)
    kw = {"latency_s": 0.001, "relay_bps": 1e9, "group": 3, "max_payload": 1024, "op": "sum"}
    clean, net0 = simulate("flat", vecs, link=LinkModel(uplink_bps=1e6), **kw)
    lossy, net1 = simulate("flat", vecs, link=LinkModel(uplink_bps=1e6, loss=0.1, rto_s=0.2, seed=5), **kw)
    assert net1.lost > 0
    for got in (clean, lossy):
        assert {bits(r) for r in got.values()} == {bits(exact)}
    assert net1.elapsed() >= net0.elapsed() + 0.2


def test_bench_scale_reports_every_figure_and_refuses_bad_sizes() -> None:
    r = run_scale_bench(12, group=4, elements=240, uplink_bps=1e5, latency_s=0.002)
    for key in ("nodes", "flat_s", "star_s", "hierarchical_s", "bound_s", "hierarchical_over_bound", "group",
                "M_bytes", "B_bytes_per_s", "flat_latency_s"):
        assert r[key] is not None, key
    assert (r["nodes"], r["group"], r["sites"], r["M_bytes"]) == (12, 4, 3, 960)
    assert r["hierarchical_over_bound"] == pytest.approx(r["hierarchical_s"] / r["bound_s"], rel=1e-2)
    assert r["hierarchical_over_bound"] >= 1.0 and r["flat_s"] >= r["flat_latency_s"]
    assert r["star_s"] >= r["star_bound_s"]
    with pytest.raises(FederationError, match="at most 64"):
        run_scale_bench(1000, group=10, elements=1000)
