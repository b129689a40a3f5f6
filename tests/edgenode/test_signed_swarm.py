"""Issue 12's attacks on a signed swarm of real nodes over real Mosquitto: forged commands (lr 1e30,
huge local_steps, ghost participants), a member's key used as the fleet's, forged aborts and
retained offline statuses do nothing; a fleet-signed round still runs, and every drop is counted
per reason in the node's /metrics."""

from __future__ import annotations

import time

import pytest

from deploy.keys import provision
from federation import topics
from federation.messages import EventKind, NodeState, NodeStatus, RoundAbort, RoundCommand
from federation.signed import load_identity
from tests.fixtures_node import SwarmWatch

pytestmark = pytest.mark.mosquitto


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _rejected(node, reason: str) -> float:
    return node.registry.get_sample_value("fractal_node_messages_rejected_total", {"reason": reason}) or 0.0


def test_forged_messages_do_no_harm_to_a_signed_swarm(mosquitto, swarm_id, mqtt_link_factory, node_factory,
                                                       digits_artifact, digits_data, tmp_path):
    x, y = digits_data
    ids = [f"{swarm_id}-n{k}" for k in range(2)]
    keys = tmp_path / "keys"
    provision(keys, swarm_id, ids)
    nodes = []
    for k, i in enumerate(ids):
        # each node loads the artifact itself: the default process isolation (a training worker
        # hosts the ring, the node relays its frames over the signed, MAC'd link), as deployed
        n = node_factory(i, digits_artifact, broker=mosquitto.url, swarm=swarm_id,
                         key_file=str(keys / f"keys/{i}.key"), keyring_file=str(keys / "keyring.json"))
        n.add_samples({"x": x[k:400:2]}, y[k:400:2])
        nodes.append(n)
    fleet_id = load_identity(keys / "keys/fleet.key", keys / "keyring.json")
    fleet = fleet_id.link(mqtt_link_factory(mosquitto, "fleet"))
    watch = SwarmWatch(fleet, swarm_id)
    _wait(lambda: all(watch.statuses.get(i) and watch.statuses[i].samples == 200 for i in ids), 10,
          "signed statuses of both nodes")
    attacker = mqtt_link_factory(mosquitto, "attacker")
    member = load_identity(keys / f"keys/{ids[0]}.key", keys / "keyring.json").link(
        mqtt_link_factory(mosquitto, "stolen-member-key"))

    # 1. forged commands: unsigned, and signed with a member's key instead of the fleet's
    evil = RoundCommand.model_construct(round_id="evil-1", steps=5, lr=1e30, participants=ids,
                                        local_steps=1_000_000_000, step_timeout_s=1e9, v=1,
                                        kind="round.start", sync="gradient", compression="none",
                                        issued_at=time.time(), start_sha256=None)
    attacker.publish(topics.command(swarm_id), evil.model_dump_json().encode())
    ok_looking = RoundCommand(round_id="evil-2", steps=5, lr=0.1, participants=[*ids, "ghost"])
    attacker.publish(topics.command(swarm_id), ok_looking)
    member.publish(topics.command(swarm_id), ok_looking.model_copy(update={"round_id": "evil-3"}))
    _wait(lambda: _rejected(nodes[1], "unsigned") >= 2 and _rejected(nodes[1], "wrong_role") >= 1, 10,
          "forged commands counted")
    assert all(n.model_version == 0 and n.status().state == NodeState.ONLINE for n in nodes)

    # 2. a fleet-signed but out-of-bounds command is refused by the bounds, not run
    fleet.publish(topics.command(swarm_id), evil.model_dump_json().encode())
    _wait(lambda: nodes[0].metrics.commands_rejected >= 1, 10, "out-of-bounds command rejected")

    # 3. a genuine round runs while the attacker forges aborts, failures and offline statuses
    cmd = RoundCommand(round_id="good-1", steps=30, lr=0.1, participants=ids, step_timeout_s=15)
    fleet.publish(topics.command(swarm_id), cmd)
    for _ in range(5):
        attacker.publish(topics.command(swarm_id), RoundAbort(round_id="good-1", reason="forged"))
        for i in ids:
            attacker.publish(topics.status(swarm_id, i), NodeStatus(node_id=i, state=NodeState.OFFLINE))
        time.sleep(0.05)
    def ended() -> bool:
        evs = list(watch.events)
        done = [e for e in evs if e.kind == EventKind.DONE and e.round_id == "good-1"]
        return len(done) == 2 or any(e.kind == EventKind.FAILED for e in evs)

    _wait(ended, 90, "round good-1 to end")
    failed = [e for e in watch.events if e.kind == EventKind.FAILED]
    assert not failed, failed
    assert {n.model_version for n in nodes} == {1}
    assert all(n.training_worker is not None for n in nodes)  # the round ran in worker processes
    assert len({n.params_sha256 for n in nodes}) == 1
    # The forged aborts come from another client and are counted on n0's command thread; the
    # DONE events above came to the fleet's client: nothing orders the two, wait for the count.
    _wait(lambda: _rejected(nodes[0], "unsigned") >= 5, 30, "the forged aborts counted on n0")
    # the node's /metrics exports the counters by reason
    from prometheus_client import generate_latest

    text = generate_latest(nodes[0].registry).decode()
    assert 'fractal_node_messages_rejected_total{reason="unsigned"}' in text
    assert 'fractal_node_messages_rejected_total{reason="bad_signature"} 0.0' in text


def test_a_round_start_replayed_after_a_restart_does_not_run_again(mosquitto, swarm_id, mqtt_link_factory,
                                                                   node_factory, digits_artifact, digits_data,
                                                                   tmp_path):
    """A genuine signed round.start captured off the broker and replayed within its freshness
    window, just after a node restarted (its replay window starts empty): the node remembers the
    rounds it started in its data directory and does not run that round again; the member that
    did not restart drops it as replayed; the next genuine round runs on both."""
    x, y = digits_data
    ids = [f"{swarm_id}-n{k}" for k in range(2)]
    keys = tmp_path / "keys"
    provision(keys, swarm_id, ids)

    def start(k: int):
        i = ids[k]
        n = node_factory(i, digits_artifact, broker=mosquitto.url, swarm=swarm_id,
                         key_file=str(keys / f"keys/{i}.key"), keyring_file=str(keys / "keyring.json"))
        if n.store.count == 0:
            n.add_samples({"x": x[k:400:2]}, y[k:400:2])
        return n

    nodes = [start(0), start(1)]
    fleet_key = load_identity(keys / "keys/fleet.key", keys / "keyring.json")
    fleet = fleet_key.link(mqtt_link_factory(mosquitto, "fleet"))
    watch = SwarmWatch(fleet, swarm_id)
    attacker = mqtt_link_factory(mosquitto, "attacker")

    def status(i: str):
        with watch.lock:
            return watch.statuses.get(i)

    def done(rid: str) -> set[str]:
        with watch.lock:
            bad = [e for e in watch.events if e.round_id == rid and e.kind == EventKind.FAILED]
            assert not bad, bad
            return {e.node_id for e in watch.events if e.round_id == rid and e.kind == EventKind.DONE}

    _wait(lambda: all(status(i) and status(i).samples == 200 for i in ids), 30, "both nodes online")
    t = topics.command(swarm_id)
    r1 = RoundCommand(round_id="r1", steps=5, lr=0.1, participants=ids, step_timeout_s=15)
    captured = fleet.sign(t, r1)
    attacker.publish(t, captured)  # the genuine command, as the broker carried it
    _wait(lambda: done("r1") == set(ids), 60, "round r1 done on both")

    nodes[1].stop(timeout=10)
    _wait(lambda: status(ids[1]).state == NodeState.OFFLINE, 30, "n1 offline")
    nodes[1] = start(1)
    _wait(lambda: status(ids[1]).state == NodeState.ONLINE and status(ids[1]).model_version == 1, 30,
          "n1 back online")
    with watch.lock:
        seen = len(watch.events)
    replayed = _rejected(nodes[0], "replayed")
    attacker.publish(t, captured)  # seconds old: fresh for the signature check of a new process
    _wait(lambda: _rejected(nodes[0], "replayed") > replayed, 30, "the replay reached n0")
    fleet.publish(t, RoundCommand(round_id="r2", steps=5, lr=0.1, participants=ids, step_timeout_s=15))
    _wait(lambda: done("r2") == set(ids), 60, "round r2 done on both")
    with watch.lock:
        after = [e for e in watch.events[seen:] if e.round_id == "r1"]
    assert not after, after  # n1 did not start r1 again (it would have failed it, alone)
    assert [n.model_version for n in nodes] == [2, 2] and len({n.params_sha256 for n in nodes}) == 1
