"""`fractal bench scale`: flat ring vs star vs hierarchical ring on a *modelled* network, up to
a thousand members in one process.

Every member is a real :class:`~federation.ring.RingAllreduce` (or
:class:`~federation.star.StarAllreduce`) with its real session, on a
:class:`~federation.memory.SimHub` of one :class:`~federation.linkmodel.Network`: the flat ring
and the star on one broker, the hierarchy (:func:`federation.hierarchy.round_sites` cuts the
members into groups of ``group``, as the fleet does) on one broker per group plus a backbone.
The flat ring and the hierarchy combine through the round's mean aggregator
(:class:`federation.aggregators.mean.Mean`, the hierarchy through its
:class:`~federation.hierarchy.HierarchicalCollective`); the star is the baseline's allreduce(mean).
Every member's result must have the same bytes, within float32 rounding of numpy's mean.

Reported times are the model's (causal virtual time, :mod:`federation.linkmodel`), not wall
clock: ``flat_s``, ``star_s``, ``hierarchical_s``. ``bound_s`` is the hierarchy's bandwidth bound,
the sum over its levels of 2(n-1)/n x M / B (group ring, leaders' ring) plus M / B for the
broadcast back down the group; ``flat_bound_s`` is 2(N-1)/N x M / B and ``flat_latency_s`` the
ring's latency term 2(N-1) x alpha, which with the frame headers (``flat_header_s``: 2(N-1)
frames of ``frame_overhead`` bytes each per member) accounts for the flat ring's growth in N.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.host import machine_line
from federation.aggregators.base import Step
from federation.aggregators.mean import Mean
from federation.errors import FederationError
from federation.hierarchy import HierarchicalCollective, Topology, round_sites
from federation.linkmodel import LinkModel, Network, broadcast_bound, ring_bound
from federation.memory import SimHub
from federation.ring import RingAllreduce
from federation.star import StarAllreduce

__all__ = ["run_scale_bench", "simulate", "groups_of", "engine_kw", "frame_overhead"]

_SWARM = "s"
_TIMEOUT = 3600.0  # real seconds: a thousand members on two shared cores are slow, never stuck


def engine_kw(link: LinkModel) -> dict[str, Any]:
    """Session settings of a simulated member: a window no call fills (the model assumes the
    window does not bind) and a real retransmit timer, short when the model loses frames. Without
    loss nothing should need a resend; 5 s (not "never") keeps a frame the session did drop from
    stalling a thousand threads for minutes (a 30 s timer doubles to 240 s)."""
    return {"swarm": _SWARM, "max_in_flight": 1 << 16, "retransmit_after": 0.3 if link.loss else 5.0,
            "max_retransmits": 1000}


def frame_overhead(tag: str = "r/0.g", sender: str = "n0000") -> int:
    """Bytes of a DATA frame that are not payload (header, ids, padding, CRC), about."""
    from federation.framing import Codec, FrameKind, Phase, encode
    empty = encode(FrameKind.DATA, Phase.REDUCE_SCATTER, swarm=_SWARM, tag=tag, sender=sender,
                   codec=Codec.F32, payload=[], nparts=1)
    return len(empty) + 4  # + alignment of a float payload, on average


def groups_of(members: list[str], group: int) -> dict[str, list[str]]:
    """The hierarchy's groups as the fleet cuts them (:func:`federation.hierarchy.round_sites`:
    near-equal groups of at most ``group``), one group when they all fit one."""
    try:
        return round_sites(members, {}, per_site=group) or {"default": list(members)}
    except ValueError as e:
        raise FederationError(str(e), hint="raise --group (a round has at most 64 sites)") from None


def _members(n: int) -> list[str]:
    return [f"n{i:04d}" for i in range(n)]


def _run_threads(fns: dict[str, Callable[[], np.ndarray]]) -> dict[str, np.ndarray]:
    out: dict[str, Any] = {}

    def work(m: str, fn: Callable[[], np.ndarray]) -> None:
        try:
            out[m] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            out[m] = e

    threads = [threading.Thread(target=work, args=(m, fn), daemon=True, name=f"sim-{m}")
               for m, fn in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = {m: r for m, r in out.items() if isinstance(r, BaseException)}
    if bad:
        m, e = next(iter(bad.items()))
        raise FederationError(f"{len(bad)} simulated members failed, e.g. {m}: {e}")
    return out


def _check(results: dict[str, np.ndarray], expect: np.ndarray, what: str) -> None:
    first = next(iter(results.values()))
    if any(r.tobytes() != first.tobytes() for r in results.values()):
        raise FederationError(f"{what}: members ended with different bytes")
    tol = 1e-4 * (1.0 + np.abs(expect))
    if not np.all(np.abs(first.astype(np.float64) - expect) <= tol):
        raise FederationError(f"{what}: result differs from numpy's mean")


def simulate(kind: str, vecs: dict[str, np.ndarray], *, link: LinkModel, latency_s: float,
             relay_bps: float, group: int, max_payload: int, tag: str = "r",
             op: str = "mean") -> tuple[dict[str, np.ndarray], Network]:
    """One mean (through the round's aggregator) or sum (the collective's allreduce) over ``vecs``
    (member -> vector) by ``kind`` (flat, star or hierarchical) on a fresh modelled network;
    returns every member's result and the network (``elapsed()``: the modelled time)."""
    net = Network(link)
    members = sorted(vecs)
    kw = engine_kw(link)
    engines: list[Any] = []
    fns: dict[str, Callable[[], np.ndarray]] = {}
    if kind in ("flat", "star"):
        hub = SimHub(net, "broker", latency_s=latency_s, relay_bps=relay_bps)
        for m in members:
            t = hub.transport(m, max_payload=max_payload)
            if kind == "star":
                star = StarAllreduce(t, **kw)
                engines.append(star)
                fns[m] = functools.partial(star.allreduce, vecs[m], group=members, tag=tag, op=op,
                                           timeout=_TIMEOUT)
            else:
                ring = RingAllreduce(t, direct_max_bytes=0, **kw)
                engines.append(ring)
                fns[m] = _step(ring, m, members, vecs[m], tag, op)
    elif kind == "hierarchical":
        topo = Topology.from_groups(groups_of(members, group))
        backbone = SimHub(net, "backbone", latency_s=latency_s, relay_bps=relay_bps)
        leaders = set(topo.leaders())
        for s, ms in topo.sites:
            hub = SimHub(net, f"site-{s}", latency_s=latency_s, relay_bps=relay_bps)
            for m in ms:
                site = RingAllreduce(hub.transport(m, max_payload=max_payload), direct_max_bytes=0, **kw)
                bb = (RingAllreduce(backbone.transport(m, max_payload=max_payload), direct_max_bytes=0, **kw)
                      if m in leaders else None)
                engines += [e for e in (site, bb) if e is not None]
                fns[m] = _step(HierarchicalCollective(site, bb, topo), m, members, vecs[m], tag, op)
    else:
        raise ValueError(f"unknown kind {kind!r} (flat, star or hierarchical)")
    try:
        return _run_threads(fns), net
    finally:
        for e in engines:
            e.close()


def _step(collective: Any, me: str, members: list[str], vec: np.ndarray, tag: str,
          op: str) -> Callable[[], np.ndarray]:
    if op != "mean":
        return lambda: collective.allreduce(vec, group=members, tag=tag, op=op, timeout=_TIMEOUT)
    step = Step(collective=collective, node_id=me, group=tuple(members), contributors=(True,) * len(members),
                round_id=tag, step=0, timeout=_TIMEOUT)
    return lambda: Mean().combine(step, vec).update


def run_scale_bench(nodes: int, *, group: int = 16, elements: int = 16384, uplink_bps: float = 64 * 1024.0,
                    latency_s: float = 0.001, relay_bps: float | None = None, loss: float = 0.0,
                    max_payload: int = 2048, star: bool = True, flat: bool = True) -> dict[str, Any]:
    """Model one round's mean of ``elements`` floats over ``nodes`` members three ways."""
    if nodes < 2:
        raise FederationError("bench scale needs at least 2 nodes", hint="pass --nodes 2 or more")
    if group < 2:
        raise FederationError(f"--group {group} must be at least 2",
                              hint="a group size of 10 to 16 is typical")
    if elements < nodes:
        raise FederationError(f"--elements {elements} must be at least --nodes {nodes} (one per ring chunk)")
    relay = relay_bps if relay_bps is not None else 1000 * uplink_bps
    link = LinkModel(uplink_bps=uplink_bps, loss=loss)
    rng = np.random.default_rng(nodes)
    members = _members(nodes)
    vecs = {m: rng.integers(-64, 64, elements).astype(np.float32) for m in members}
    expect = np.stack([vecs[m].astype(np.float64) for m in members]).mean(axis=0)
    size = elements * 4
    sites = groups_of(members, group)
    sizes = [len(ms) for ms in sites.values()]
    g, s = max(sizes), len(sizes)
    bound = (ring_bound(g, size, uplink_bps) + ring_bound(s, size, uplink_bps)
             + broadcast_bound(g, size, uplink_bps))
    out: dict[str, Any] = {"nodes": nodes, "group": g, "sites": s, "elements": elements, "M_bytes": size,
                           "B_bytes_per_s": uplink_bps, "alpha_s": latency_s, "relay_bytes_per_s": relay,
                           "loss": loss, "max_payload": max_payload}
    wall: dict[str, float] = {}
    for kind, on in (("hierarchical", True), ("flat", flat), ("star", star)):
        if not on:
            out[f"{kind}_s"] = None
            continue
        t0 = time.monotonic()
        results, net = simulate(kind, vecs, link=link, latency_s=latency_s, relay_bps=relay, group=group,
                                max_payload=max_payload)
        wall[kind] = round(time.monotonic() - t0, 1)
        _check(results, expect, kind)
        out[f"{kind}_s"] = round(net.elapsed(), 4)
        out[f"{kind}_frames"] = net.frames
    h = frame_overhead()
    out["bound_s"] = round(bound, 4)
    out["hierarchical_over_bound"] = round(out["hierarchical_s"] / bound, 3)
    out["flat_bound_s"] = round(ring_bound(nodes, size, uplink_bps), 4)
    out["flat_latency_s"] = round(2 * (nodes - 1) * latency_s, 4)
    out["frame_overhead"] = h
    out["flat_header_s"] = round(2 * (nodes - 1) * h / uplink_bps, 4)
    out["flat_model_s"] = round(out["flat_bound_s"] + out["flat_latency_s"] + out["flat_header_s"], 4)
    out["star_bound_s"] = round((nodes - 1) * size / uplink_bps, 4)
    out["wall_s"] = wall
    out["machine"] = machine_line()
    if not all(math.isfinite(v) for v in (bound, out["hierarchical_s"])):
        raise FederationError("the model produced a non-finite time")
    return out
