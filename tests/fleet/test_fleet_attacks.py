"""Attacks on the fleet through the broker (issue 12), each one a test that now fails to do harm.

Real Mosquitto (the session broker), real fleet service; the attacker is a plain MQTT client on
the same broker publishing forged messages. With a keyring (signed swarm) the fleet drops what
is not signed by the member the topic names; without one, bounds and the registry cap still hold.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from deploy.keys import provision
from federation import topics
from federation.auth import Keyring, Role, Signer, Verifier, generate_key
from federation.messages import EventKind, NodeState, NodeStatus, RoundEvent
from federation.signed import SignedLink, load_identity


def _status(node: str, state: NodeState = NodeState.ONLINE, **kw) -> NodeStatus:
    return NodeStatus(node_id=node, state=state, arch="x86_64", model="digits-mlp", model_version=1,
                      params_sha256="ab" * 32, samples=10, **kw)


# --- unsigned swarm: bounds and the registry cap ----------------------------------------------

def test_ghost_statuses_are_bounded_and_validated(fleet):
    fleet.service.registry.max_nodes = 5
    ln = fleet.link("ghosts")
    bad = [
        ("x" * 5000, {"v": 1, "node_id": "x" * 5000, "state": "online"}),  # huge id (topic level)
        ("h1", {"v": 1, "node_id": "h1", "state": "online", "keepalive_s": "Infinity"}),
        ("h2", {"v": 1, "node_id": "h2", "state": "online", "model": "<script>" * 100}),
        ("h3", {"node_id": "h3", "state": "online"}),  # no "v"
        ("h4", {"v": 1, "node_id": "h4", "state": "online", "samples": -1}),
    ]
    for node, doc in bad:
        ln.publish(topics.status(fleet.swarm, node), json.dumps(doc).encode(), retain=True)
    for i in range(12):  # ghost nodes, valid on their face: only max_nodes get in
        ln.publish(topics.status(fleet.swarm, f"ghost-{i}"), _status(f"ghost-{i}"), retain=True)
    fleet.wait_for(lambda: fleet.service.rejected_messages >= len(bad) + 7, what="rejections")
    body = fleet.get("/api/nodes").json()
    assert len(body["nodes"]) == 5
    assert body["rejected"]["malformed"] == len(bad) and body["rejected"]["registry_full"] == 7
    for i in range(12):  # clean up the retained ghosts on the shared broker
        ln.publish(topics.status(fleet.swarm, f"ghost-{i}"), b"", retain=True).wait_for_publish(5)
    for node, _ in bad:
        ln.publish(topics.status(fleet.swarm, node), b"", retain=True).wait_for_publish(5)


def test_nan_loss_never_reaches_the_event_stream(fleet):
    ln1, _ = fleet.announce("n1"), fleet.announce("n2")
    fleet.wait_for(lambda: len([n for n in fleet.get("/api/nodes").json()["nodes"] if n["online"]]) == 2)
    rid = fleet.post("/api/rounds", json={"steps": 3}).json()["round_id"]
    raw = b'{"v":1,"kind":"round.step","round_id":"%s","node_id":"n1","step":1,"loss":NaN}' % rid.encode()
    ln1.publish(topics.round_events(fleet.swarm, rid, "n1"), raw).wait_for_publish(5)
    fleet.event(ln1, rid, "n1", EventKind.STEP, step=2, loss=0.5)  # same connection: after the NaN
    fleet.wait_for(lambda: fleet.get(f"/api/rounds/{rid}").json()["nodes"]["n1"]["last_step"] == 2,
                   what="step 2 of n1")
    text = fleet.get(f"/api/rounds/{rid}").text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    from api.fleet.events import json_safe

    assert json_safe({"a": [math.nan, 1.0, {"b": math.inf}]}) == {"a": [None, 1.0, {"b": None}]}


# --- signed swarm -----------------------------------------------------------------------------

@pytest.fixture
def signed(make_fleet, tmp_path):
    swarm = f"sig{int(time.time() * 1000) % 10**8}"
    keys = tmp_path / "keys"
    provision(keys, swarm, ["n1", "n2"])
    fleet = make_fleet(swarm=swarm, key_file=str(keys / "keys/fleet.key"),
                       keyring_file=str(keys / "keyring.json"))
    members = {}
    for n in ("n1", "n2"):
        ident = load_identity(keys / f"keys/{n}.key", keys / "keyring.json")
        members[n] = SignedLink(fleet.link(n), ident.signer, ident.verifier())
    return fleet, members, Keyring.load(keys / "keyring.json")


def _online(fleet) -> set[str]:
    return {n["node_id"] for n in fleet.get("/api/nodes").json()["nodes"] if n["online"]}


def test_signed_statuses_only_from_their_own_node(signed):
    fleet, m, _ = signed
    attacker = fleet.link("attacker")
    attacker.publish(topics.status(fleet.swarm, "evil"), _status("evil"), retain=True).wait_for_publish(5)
    rogue = Signer("evil", "evil-k1", generate_key())
    forged = rogue.sign(topics.status(fleet.swarm, "evil"), _status("evil").model_dump_json().encode())
    attacker.publish(topics.status(fleet.swarm, "evil"), forged, retain=True).wait_for_publish(5)
    # n2 (a real member) signs a status for n1 on n1's topic: wrong role.
    m["n2"].publish(topics.status(fleet.swarm, "n1"), _status("n1")).wait_for_publish(5)
    m["n1"].publish(topics.status(fleet.swarm, "n1"), _status("n1"), retain=True).wait_for_publish(5)
    fleet.wait_for(lambda: _online(fleet) == {"n1"}, what="n1 online")
    rejected = fleet.get("/api/nodes").json()["rejected"]
    assert rejected == {"unsigned": 1, "unknown_key": 1, "wrong_role": 1}
    for t in (topics.status(fleet.swarm, "evil"), topics.status(fleet.swarm, "n1")):
        attacker.publish(t, b"", retain=True).wait_for_publish(5)


def test_forged_offline_status_and_replays_do_not_kill_a_round(signed):
    fleet, m, _ = signed
    for n in ("n1", "n2"):
        m[n].publish(topics.status(fleet.swarm, n), _status(n), retain=True).wait_for_publish(5)
    fleet.wait_for(lambda: _online(fleet) == {"n1", "n2"}, what="two members online")
    rid = fleet.post("/api/rounds", json={"steps": 5}).json()["round_id"]
    attacker = fleet.link("attacker")
    # Capture n1's own signed "training" status, then replay it; forge an unsigned offline status,
    # a forged round.failed and a forged round.done for n1 and n2.
    seen = []
    attacker.subscribe(topics.status(fleet.swarm, "n1"), lambda t, p: seen.append(p))
    m["n1"].publish(topics.status(fleet.swarm, "n1"), _status("n1", NodeState.TRAINING, round_id=rid),
                    retain=True).wait_for_publish(5)
    fleet.wait_for(lambda: seen, what="captured status")
    attacker.publish(topics.status(fleet.swarm, "n1"), seen[-1]).wait_for_publish(5)  # replay
    attacker.publish(topics.status(fleet.swarm, "n1"), _status("n1", NodeState.OFFLINE)).wait_for_publish(5)
    for n, kind in (("n1", EventKind.FAILED), ("n2", EventKind.DONE), ("n1", EventKind.DONE)):
        ev = RoundEvent(kind=kind, round_id=rid, node_id=n, step=5, reason="forged",
                        params_sha256="cd" * 32, model_version=2)
        attacker.publish(topics.round_events(fleet.swarm, rid, n), ev).wait_for_publish(5)
    fleet.wait_for(lambda: fleet.service.rejected_messages >= 5, what="5 rejections")
    assert dict(fleet.service.rejected) == {"replayed": 1, "unsigned": 4}
    assert fleet.get(f"/api/rounds/{rid}").json()["state"] == "running"
    assert _online(fleet) == {"n1", "n2"}
    # The genuine events still work.
    for n in ("n1", "n2"):
        ev = RoundEvent(kind=EventKind.DONE, round_id=rid, node_id=n, step=5, params_sha256="cd" * 32,
                        model_version=2)
        m[n].publish(topics.round_events(fleet.swarm, rid, n), ev).wait_for_publish(5)
    fleet.wait_for(lambda: fleet.get(f"/api/rounds/{rid}").json()["state"] == "done", what="round done")
    for n in ("n1", "n2"):
        attacker.publish(topics.status(fleet.swarm, n), b"", retain=True).wait_for_publish(5)


def test_fleet_commands_are_signed_by_the_fleet_key(signed):
    fleet, m, ring = signed
    got = []
    raw = fleet.link("observer")
    raw.subscribe(topics.command(fleet.swarm), lambda t, p: got.append((t, p)))
    for n in ("n1", "n2"):
        m[n].publish(topics.status(fleet.swarm, n), _status(n), retain=True).wait_for_publish(5)
    fleet.wait_for(lambda: _online(fleet) == {"n1", "n2"}, what="two members online")
    fleet.post("/api/rounds", json={"steps": 3})
    fleet.wait_for(lambda: got, what="the command")
    topic, payload = got[0]
    msg = Verifier(ring).verify(topic, payload)
    assert msg.sender == "fleet" and msg.role == Role.FLEET
    assert json.loads(bytes(msg.payload))["kind"] == "round.start"
    for n in ("n1", "n2"):
        raw.publish(topics.status(fleet.swarm, n), b"", retain=True).wait_for_publish(5)


def test_a_member_claiming_a_huge_version_cannot_impose_its_parameters(fleet):
    from tests.fleet.conftest import collect

    cmds = collect(fleet.link("observer"), topics.command(fleet.swarm))
    fleet.announce("honest-1")
    fleet.announce("honest-2")
    evil = fleet.link("evil")
    evil.publish(topics.status(fleet.swarm, "evil"),
                 _status("evil").model_copy(update={"params_sha256": "ee" * 32, "model_version": 1_000_000}),
                 retain=True).wait_for_publish(5)
    fleet.wait_for(lambda: len(_online(fleet)) == 3, what="3 nodes online")
    # One honest member against the rogue, no committed round yet: no majority -> refused.
    r = fleet.post("/api/rounds", json={"steps": 2, "nodes": ["honest-1", "evil"]})
    assert r.status_code == 409 and "majority" in r.json()["error"]
    r = fleet.post("/api/rounds", json={"steps": 2})
    assert r.status_code == 201, r.text
    cmd = json.loads(cmds.get(timeout=5)[1])
    assert cmd["start_sha256"] == "ab" * 32  # the majority's parameters, not the highest version's
    evil.publish(topics.status(fleet.swarm, "evil"), b"", retain=True).wait_for_publish(5)


# --- the counts themselves --------------------------------------------------------------------

def test_rejections_from_both_subscription_threads_are_all_counted(tmp_path, caplog):
    """Statuses and events are rejected on two subscription threads at once. A Counter's first
    count of a reason runs Python code (``__missing__``), where the other thread could slip in:
    both read 0, both wrote 1, one rejection lost (the attack tests compare exact counts). Many
    distinct reasons make every count a first count; a tiny switch interval makes switches there
    likely (without the lock this lost a few counts of 40,000 every run)."""
    import logging
    import sys
    import threading

    from api.fleet.service import FleetService
    from api.fleet.settings import FleetSettings
    from tests.fleet.fake_link import FakeLink

    service = FleetService(FleetSettings(swarm="count", token="t", broker="mqtt://unused:1",
                                         db=str(tmp_path / "f.sqlite")), link_factory=lambda s: FakeLink())
    caplog.set_level(logging.ERROR, logger="fractal.fleet")  # not 40,000 warning lines
    n = 20_000
    barrier = threading.Barrier(2)

    def reject() -> None:
        barrier.wait()
        for i in range(n):
            service._reject("t", "bad", reason=f"r{i}")  # noqa: SLF001 - the counting itself
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=reject) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
        service.history.close()
    assert service.rejected_messages == 2 * n
    assert sum(service.rejected.values()) == 2 * n and set(service.rejected.values()) == {2}
