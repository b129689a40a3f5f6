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
                       outlier_factor=3.0, aggregation="mean", compression="none",  # screened across sites
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
    assert all(nodes[i].rounds.backbone.stats.data_frames_sent > 0 for i in ("east-n0", "west-n0"))
    assert all(nodes[i].rounds.backbone.stats.data_frames_sent == 0 for i in ("east-n1", "west-n1"))


@pytest.mark.slow
def test_a_site_leader_killed_in_the_vote_fails_the_round_everywhere_then_the_next_leader_commits(
        site_brokers, swarm_id, mqtt_link_factory, digits_artifact, digits_data, tmp_path) -> None:
    """Real `fractal node` processes; the east leader SIGKILLs itself inside the round's vote
    (fault plan ``kill@vote:hk1``, through tests/edgenode/faultnode.py): its vote is out, no
    decision yet. Nobody commits; the next round, without it, is led on east by east-n1 and
    commits on all three."""
    import os

    import httpx

    from federation.broker import free_port
    from tests.edgenode.test_commit_faults import ROOT, NodeProc, _wait
    from tests.fixtures_node import write_node_toml

    backbone, sites = site_brokers
    wait_bridged(sites, swarm_id)
    x, y = digits_data
    site_of = {f"{s}-n{k}": s for s in sites for k in range(2)}
    ids = sorted(site_of)
    victim = "east-n0"
    procs = {}
    for i, s in site_of.items():
        port = free_port()
        cfg = write_node_toml(tmp_path / i / "NODE.toml", {
            "node_id": i, "artifact": str(digits_artifact), "port": port, "data_dir": "data",
            "broker": sites[s].url, "swarm": swarm_id, "site": s, "heartbeat_s": 1.0, "keepalive_s": 2,
            "training": {"nice": 0, "isolation": "thread"}})
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TVM_NUM_THREADS": "1"}
        procs[i] = NodeProc(i, cfg, port, env, tmp_path / f"{i}.log",
                            faults="kill@vote:hk1" if i == victim else None)
    fleet = mqtt_link_factory(backbone, "fleet")
    watch = SwarmWatch(fleet, swarm_id)

    def logs() -> str:
        return "\n".join(f"--- {p.node_id}\n" + p.log.read_text()[-3000:] for p in procs.values())

    try:
        for p in procs.values():
            p.start()
        for k, (i, p) in enumerate(procs.items()):
            _wait(lambda i=i: (st := watch.statuses.get(i)) is not None and st.state == NodeState.ONLINE
                  and procs[i].ready(), 240, f"{i} online\n{logs()}")
            body = {"inputs": {"x": x[k:400:4].tolist()}, "labels": y[k:400:4].tolist()}
            r = httpx.post(f"http://127.0.0.1:{p.port}/v1/samples", json=body, timeout=30)
            assert r.status_code < 300, r.text

        def run(rid: str, members: list[str]) -> dict[str, str]:
            cmd = RoundCommand(round_id=rid, steps=3, lr=0.1, participants=members, step_timeout_s=4,
                               outlier_factor=0, aggregation="mean", compression="none",
                               sites=round_sites(members, site_of))
            fleet.publish(topics.command(swarm_id), cmd)
            outcome: dict[str, str] = {}

            def ended() -> bool:
                with watch.lock:
                    evs = [e for e in watch.events if e.round_id == rid and e.kind != EventKind.STEP]
                for e in evs:
                    outcome.setdefault(e.node_id, "done" if e.kind == EventKind.DONE else "failed")
                if victim in members and procs[victim].proc.poll() is not None:
                    outcome.setdefault(victim, "killed")
                return set(members) <= set(outcome)

            _wait(ended, 60, f"round {rid} to end on every node: {outcome}\n{logs()}")
            return outcome

        assert run("hk1", ids) == {victim: "killed", **{i: "failed" for i in ids if i != victim}}
        survivors = [i for i in ids if i != victim]
        assert {procs[i].info()["model_version"] for i in survivors} == {0}  # no partial commit
        assert run("hk2", survivors) == {i: "done" for i in survivors}
        with watch.lock:
            done = [e for e in watch.events if e.round_id == "hk2" and e.kind == EventKind.DONE]
        assert len({e.params_sha256 for e in done}) == 1 and {e.model_version for e in done} == {1}
        assert {procs[i].info()["params_sha256"] for i in survivors} == {done[0].params_sha256}
    finally:
        for p in procs.values():
            p.stop()
