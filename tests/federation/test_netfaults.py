"""Faults on a real network: Mosquitto on a "broker host", three `fractal node` processes on a
"nodes host" (Linux network namespaces joined by veth pairs), the project's fault proxy on the
"router" between them (harness/netns.py, harness/netswarm.py). The fleet role is the real
RoundManager; the truth about parameters is each node's ``GET /v1/node``.

* 50 ms one-way delay: rounds commit and every node holds the same parameters.
* A partition during a round (one node blackholed, or the broker refusing every node): the round
  fails with a reason naming a missing node, no node commits (nothing on a partial ring), the
  swarm recovers once healed (the next round commits on all), and every sample acknowledged with
  a 2xx during the partition is still there.
* Every node's connection cut once during a round (each fires its Last Will, each reconnects):
  the round commits on every node.
* Connections dropped every 1.5 s (per node) during rounds: each round commits with agreeing parameters or
  fails with a reason leaving every node on the same parameters; without drops it commits again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from harness.faultproxy import PartitionMode
from harness.netswarm import NetSwarm, NetSwarmOptions, RoundOutcome

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]

NODES = 3
FIRST_SAMPLES = 150


@pytest.fixture(scope="module")
def netswarm(digits_artifact: Path, digits_data: tuple[np.ndarray, np.ndarray],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetSwarm]:
    x, y = digits_data
    sw = NetSwarm(NetSwarmOptions(artifact=digits_artifact, workdir=tmp_path_factory.mktemp("netswarm"),
                                  nodes=NODES, tag="t"))
    with sw:
        for k in range(NODES):
            sw.wait_http(k)
            mine = slice(k, FIRST_SAMPLES * NODES, NODES)
            assert sw.post_samples(k, x[mine], y[mine]) == 200
        sw.wait_online()
        yield sw


@pytest.fixture
def swarm(netswarm: NetSwarm) -> Iterator[NetSwarm]:
    """The module's swarm with a clean network before and after each test. The nodes' log tails
    go to stdout at teardown: pytest shows them with a failure (and only then)."""
    yield netswarm
    for k in range(NODES):
        print(f"--- n{k} log tail ---\n{netswarm.log_tail(k, 3000)}")
    for p in netswarm.proxies:
        p.drop_every(None)
        p.heal()
        p.set_delay(0)


def _agreeing(sw: NetSwarm) -> tuple[int, str]:
    """Every node's (model_version, params_sha256), asserted identical; returns it."""
    params = sw.params()
    assert len(params) == NODES and len(set(params.values())) == 1, params
    return next(iter(params.values()))


def _assert_committed(sw: NetSwarm, out: RoundOutcome, before: tuple[int, str]) -> tuple[int, str]:
    assert out.committed, (out.reason, out.fleet)
    assert out.fleet["params_agree"] is True
    sw.wait_idle()
    now = _agreeing(sw)
    assert now[0] == before[0] + 1 and now[1] == out.fleet["params_sha256"], (before, now, out.fleet)
    return now


def _first_step_seen(sw: NetSwarm, round_id: str, timeout: float = 30.0) -> None:
    sw.wait_for(lambda: bool((sw.rounds.get(round_id) or {}).get("loss")), timeout, f"a step of {round_id}")


def test_rounds_commit_under_50ms_delay(swarm: NetSwarm) -> None:
    before = _agreeing(swarm)
    for p in swarm.proxies:
        p.set_delay(50)
    t0 = time.monotonic()
    for _ in range(2):
        swarm.wait_online()
        before = _assert_committed(swarm, swarm.run_round(4), before)
    # four ring hops per allreduce through a 50 ms + 50 ms path: a round cannot be faster than that
    assert time.monotonic() - t0 > 2 * 4 * 4 * 0.1


@pytest.mark.parametrize(("mode", "victims"), [
    (PartitionMode.BLACKHOLE, [NODES - 1]),  # one node silently cut off: the others wait, then give up
    (PartitionMode.REFUSE, list(range(NODES))),  # the broker host unreachable for every node (resets)
], ids=["blackhole-one-node", "refuse-all-nodes"])
def test_partition_fails_the_round_and_the_swarm_recovers(swarm: NetSwarm, mode: PartitionMode,
                                                          victims: list[int],
                                                          digits_data: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits_data
    swarm.wait_online()
    before = _agreeing(swarm)
    counts = {k: int(swarm.node_info(k)["samples"]) for k in range(NODES)}
    for p in swarm.proxies:
        p.set_delay(20)  # slows steps down so that the partition surely lands inside the round
    acked = dict.fromkeys(range(NODES), 0)

    def partition_mid_round(round_id: str) -> None:
        _first_step_seen(swarm, round_id)
        for v in victims:
            swarm.proxies[v].partition(mode)
        for k in range(NODES):  # sensors keep posting while the node is cut off from the broker
            lo = 1000 + 20 * k
            if swarm.post_samples(k, x[lo:lo + 20], y[lo:lo + 20]) // 100 == 2:
                acked[k] += 20

    out = swarm.run_round(200, during=partition_mid_round)
    print(f"partitioned round: {out.state} after {out.seconds:.1f}s: {out.reason}")
    assert not out.committed and out.reason, out.fleet
    assert any(f"n{v}" in out.reason for v in victims), out.reason  # names who is missing
    # no node commits on a ring that lost a member (the ones still connected included)
    for k in range(NODES):
        swarm.wait_for(lambda k=k: swarm.node_info(k)["round_id"] is None, 30, f"n{k} idle")  # type: ignore[misc]
        info = swarm.node_info(k)
        assert (info["model_version"], info["params_sha256"]) == before, info

    for v in victims:
        swarm.proxies[v].heal()
    swarm.wait_online(timeout=60)
    swarm.wait_idle()
    assert _agreeing(swarm) == before  # nothing half-applied anywhere
    for p in swarm.proxies:
        p.set_delay(0)
    after = _assert_committed(swarm, swarm.run_round(4), before)
    assert after != before
    assert acked == dict.fromkeys(range(NODES), 20)  # the nodes' HTTP side never depended on the broker
    for k in range(NODES):
        assert int(swarm.node_info(k)["samples"]) == counts[k] + acked[k]


def test_a_round_survives_every_node_losing_its_connection_once(swarm: NetSwarm) -> None:
    """A dropped connection fires the node's Last Will (an offline status), but paho reconnects
    within ~0.2 s, the node reports again and the ring retransmits what the gap lost: the fleet's
    grace (``offline_grace_s``) keeps the round, which commits everywhere. Before the grace the
    fleet failed the round on the first Last Will."""
    before = _agreeing(swarm)
    for p in swarm.proxies:
        p.set_delay(10)  # a few seconds of round: the cuts land inside it
    offline0 = swarm.offline_statuses
    cut: list[int] = []

    def cut_each_node_once(round_id: str) -> None:
        _first_step_seen(swarm, round_id)
        for k, p in enumerate(swarm.proxies):
            cut.append(p.cut())
            seen = offline0 + k
            swarm.wait_for(lambda seen=seen: swarm.offline_statuses > seen, 10, f"n{k}'s Last Will")  # type: ignore[misc]

    out = swarm.run_round(60, during=cut_each_node_once)
    print(f"round with a cut per node: {out.state} in {out.seconds:.1f}s: {out.reason}")
    assert all(n >= 1 for n in cut), cut  # every node's live connection was cut
    assert swarm.offline_statuses >= offline0 + NODES
    _assert_committed(swarm, out, before)


def test_periodic_drops_commit_or_fail_cleanly(swarm: NetSwarm) -> None:
    swarm.wait_online()
    state = _agreeing(swarm)
    for p in swarm.proxies:
        p.set_delay(10)
        p.drop_every(1.5)
    outcomes: list[RoundOutcome] = []

    def cuts() -> int:
        return sum(p.describe()["cut"] for p in swarm.proxies)

    while len(outcomes) < 4 or cuts() < NODES:  # enough rounds, and every node's link dropped once
        assert len(outcomes) < 15, [(o.state, o.reason) for o in outcomes]
        swarm.wait_online(timeout=60)
        out = swarm.run_round(6)
        outcomes.append(out)
        print(f"round under drops: {out.state} in {out.seconds:.1f}s: {out.reason}")
        swarm.wait_idle()
        now = _agreeing(swarm)  # committed everywhere or nowhere
        if out.committed:
            assert out.fleet["params_agree"] and now == (state[0] + 1, out.fleet["params_sha256"]), (out, now)
        else:
            assert out.reason, out.fleet
            # the fleet may give up on a ring that then finished: all committed, or none did
            assert now[0] in (state[0], state[0] + 1), now
        state = now
    for p in swarm.proxies:
        p.drop_every(None)
    swarm.wait_online(timeout=60)
    _assert_committed(swarm, swarm.run_round(4), state)
