"""A training round across two sites: four nodes, two on each site's Mosquitto, the site brokers
bridged to a backbone Mosquitto (deploy/mosquitto/), the round command published on the backbone
as the fleet would. The command names the sites (federation/PROTOCOL.md section 10): each site
reduces over its own broker, the two leaders over the bridge. Every node commits the same
parameters; the nodes' sites reach the backbone in their statuses."""

from __future__ import annotations

import time

import pytest

from compiler import load_artifact
from federation import topics
from federation.hierarchy import round_sites
from federation.messages import EventKind, NodeState, RoundCommand
from tests.fixtures_node import SwarmWatch
from tests.fixtures_sites import wait_bridged

pytestmark = pytest.mark.mosquitto


def test_a_round_across_two_bridged_sites_commits_the_same_parameters_everywhere(
        site_brokers, swarm_id, mqtt_link_factory, node_factory, digits_artifact, digits_data) -> None:
    backbone, sites = site_brokers
    wait_bridged(sites, swarm_id)
    x, y = digits_data
    art = load_artifact(digits_artifact)
    site_of = {f"{s}-n{k}": s for s in sites for k in range(2)}
    nodes = {}
    for k, (i, s) in enumerate(site_of.items()):
        nodes[i] = node_factory(i, digits_artifact, artifact=art, broker=sites[s].url, swarm=swarm_id, site=s)
        nodes[i].add_samples({"x": x[k:400:4]}, y[k:400:4])
    fleet = mqtt_link_factory(backbone, "fleet")
    watch = SwarmWatch(fleet, swarm_id)
    deadline = time.monotonic() + 20
    while not all((st := watch.statuses.get(i)) and st.state == NodeState.ONLINE and st.samples == 100
                  for i in site_of):
        assert time.monotonic() < deadline, watch.statuses
        time.sleep(0.05)
    assert {i: watch.statuses[i].site for i in site_of} == site_of

    ids = sorted(site_of)
    cmd = RoundCommand(round_id="hier-r1", steps=5, lr=0.1, participants=ids, step_timeout_s=15,
                       outlier_factor=0, aggregation="mean", compression="none",
                       sites=round_sites(ids, site_of))
    assert cmd.sites == {"east": ["east-n0", "east-n1"], "west": ["west-n0", "west-n1"]}
    fleet.publish(topics.command(swarm_id), cmd)
    deadline = time.monotonic() + 90
    while True:
        with watch.lock:
            done = {e.node_id: e for e in watch.events
                    if e.kind == EventKind.DONE and e.round_id == "hier-r1"}
            failed = [e for e in watch.events if e.kind == EventKind.FAILED]
        assert not failed, failed
        if len(done) == len(ids):
            break
        assert time.monotonic() < deadline, watch.events
        time.sleep(0.05)
    assert len({e.params_sha256 for e in done.values()}) == 1
    assert {e.model_version for e in done.values()} == {1}
    assert {n.params_sha256 for n in nodes.values()} == {done[ids[0]].params_sha256}
    # The leaders (east-n0, west-n0) reduced over the bridge; the others never used the backbone.
    assert all(nodes[i]._backbone.stats.data_frames_sent > 0 for i in ("east-n0", "west-n0"))
    assert all(nodes[i]._backbone.stats.data_frames_sent == 0 for i in ("east-n1", "west-n1"))
