"""Fleet API against a real Mosquitto: node registry, Last Will, rounds, auth, validation."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from api.fleet.settings import FleetSettings
from federation import topics
from federation.messages import EventKind, NodeState, NodeStatus, RoundAbort, parse_command
from federation.mqtt import MqttLink
from tests.fleet.conftest import TOKEN, collect

pytestmark = pytest.mark.mosquitto


def _round(fleet, **body):
    r = fleet.post("/api/rounds", json={"steps": 3, **body})
    assert r.status_code == 201, r.text
    return r.json()["round_id"]


def test_nodes_appear_from_retained_statuses(broker, make_fleet):
    swarm = f"retained-{os.getpid()}"
    # The nodes announce BEFORE the fleet exists: the fleet learns them from retained messages.
    pre = MqttLink(broker.url, swarm=swarm, client_id="pre-announcer")
    try:
        from federation.messages import NodeStatus
        for i, arch in enumerate(["x86_64", "aarch64", "x86_64"]):
            st = NodeStatus(node_id=f"n{i}", state=NodeState.ONLINE, arch=arch,
                            board="rpi4" if i == 1 else "", model="digits-mlp", model_version=i,
                            params_sha256=f"{i:x}" * 64, samples=10 * i)
            pre.publish(topics.status(swarm, f"n{i}"), st, retain=True).wait_for_publish(5)
        fleet = make_fleet(swarm=swarm)
        nodes = fleet.wait_for(
            lambda: (ns := fleet.get("/api/nodes").json()["nodes"]) and len(ns) == 3 and ns,
            what="3 retained nodes")
        assert [n["node_id"] for n in nodes] == ["n0", "n1", "n2"]
        n1 = nodes[1]
        assert (n1["arch"], n1["board"], n1["model"], n1["model_version"], n1["samples"]) == \
            ("aarch64", "rpi4", "digits-mlp", 1, 10)
        assert n1["params_short"] == "1" * 12 and n1["online"] and n1["state"] == "online"
    finally:
        for i in range(3):  # clear the retained statuses
            pre.publish(topics.status(swarm, f"n{i}"), b"", retain=True).wait_for_publish(5)
        pre.close()


def _spawn_node(fleet, node_id: str, keepalive: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.fleet.node_proc", fleet.broker_url, fleet.swarm,
                             node_id, str(keepalive)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    line = proc.stdout.readline().strip()
    assert line == "READY", f"node process did not start: {line!r}"
    return proc


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_dead_node_goes_offline_within_1_5x_keepalive(fleet, how):
    keepalive = 2
    proc = _spawn_node(fleet, "victim", keepalive)
    try:
        fleet.wait_for(lambda: (n := fleet.node("victim")) and n["online"], what="victim online")
        # SIGKILL: the socket closes without DISCONNECT -> the broker sends the Last Will.
        # SIGSTOP: the socket stays open but silent -> keepalive expiry (broker Will + fleet heartbeat check).
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        node = fleet.wait_for(lambda: (n := fleet.node("victim")) and not n["online"] and n,
                              timeout=1.5 * keepalive + 1.5, what="victim offline")
        elapsed = time.monotonic() - t0
        assert node["state"] == "offline" and node["offline_reason"]
        # Offline at most 1.5x keepalive after the node's last sign of life (its last heartbeat,
        # up to keepalive/2 before the signal), plus polling slack.
        assert elapsed <= 1.5 * keepalive + 1.0, elapsed
        if how == "sigstop":
            assert time.time() - node["last_seen"] <= 1.5 * keepalive + 1.0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(5)


def test_round_command_goes_on_the_wire_and_done_from_events(fleet):
    a, b = fleet.announce("node-a"), fleet.announce("node-b")
    fleet.announce("node-c", state=NodeState.OFFLINE)
    cmds = collect(fleet.link("spy"), topics.command(fleet.swarm))
    fleet.wait_for(lambda: len(fleet.get("/api/nodes").json()["nodes"]) == 3, what="3 nodes")

    r = fleet.post("/api/rounds", json={"steps": 2, "lr": 0.05, "sync": "local-sgd", "nodes": None})
    assert r.status_code == 201, r.text
    rid = r.json()["round_id"]
    assert r.json()["participants"] == ["node-a", "node-b"]
    topics.validate_id(rid, "round id")

    topic, payload = cmds.get(timeout=5)
    cmd = parse_command(payload)
    assert topic == topics.command(fleet.swarm)
    assert (cmd.round_id, cmd.steps, cmd.lr, cmd.sync.value, cmd.participants) == \
        (rid, 2, 0.05, "local-sgd", ["node-a", "node-b"])

    # Watch the SSE stream while the nodes report.
    seen: list[dict] = []

    def listen():
        with httpx.stream("GET", f"{fleet.url}/api/events?token={TOKEN}", timeout=10) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    data = json.loads(line[5:])
                    seen.append(data)
                    if data.get("round_id") == rid and data.get("state") == "done":
                        return

    th = threading.Thread(target=listen, daemon=True)
    th.start()
    fleet.wait_for(lambda: seen, what="SSE snapshot")
    assert seen[0]["swarm"] == fleet.swarm
    assert {n["node_id"] for n in seen[0]["nodes"]} >= {"node-a", "node-b"}

    for step, (la, lb) in enumerate([(2.0, 1.0), (1.0, 0.5)]):
        fleet.event(a, rid, "node-a", EventKind.STEP, step=step, loss=la)
        fleet.event(b, rid, "node-b", EventKind.STEP, step=step, loss=lb)
    assert fleet.wait_for(lambda: fleet.get(f"/api/rounds/{rid}").json()["loss"][-1:] and
                          len(fleet.get(f"/api/rounds/{rid}").json()["loss"]) == 2, what="2 steps")
    assert fleet.get(f"/api/rounds/{rid}").json()["state"] == "running"
    for ln, n in ((a, "node-a"), (b, "node-b")):
        fleet.event(ln, rid, n, EventKind.DONE, step=2, params_sha256="cd" * 32, model_version=2)
    got = fleet.wait_for(lambda: (g := fleet.get(f"/api/rounds/{rid}").json())["state"] != "running" and g,
                         what="round finished")
    assert got["state"] == "done" and got["reason"] is None
    assert got["params_agree"] is True and got["params_sha256"] == "cd" * 32
    assert [s["mean"] for s in got["loss"]] == pytest.approx([1.5, 0.75])
    assert got["loss"][1]["nodes"] == {"node-a": 1.0, "node-b": 0.5}
    th.join(30)  # the stream's copy of the done round travels on another thread than our GETs
    assert not th.is_alive(), "SSE stream never delivered the done round"
    assert fleet.get("/api/rounds").json()["rounds"][0]["round_id"] == rid
    # Every round state on the stream carries the fleet's event sequence number, increasing; an
    # HTTP read carries the number of the last event published before it (the dashboard keeps
    # the copy with the higher number: an HTTP answer can arrive after a newer event). (The
    # ticker may publish the round once more after the done event the listener stopped at.)
    seqs = [d["seq"] for d in seen[1:] if d.get("round_id") == rid]
    assert len(seqs) >= 2 and seqs == sorted(set(seqs)), seqs
    read = fleet.get(f"/api/rounds/{rid}").json()["seq"]
    assert seqs[-1] <= read <= fleet.get("/api/rounds").json()["rounds"][0]["seq"]


def test_round_failed_event_and_hash_disagreement(fleet):
    a, b = fleet.announce("node-a"), fleet.announce("node-b")
    cmds = collect(fleet.link("spy"), topics.command(fleet.swarm))
    fleet.wait_for(lambda: len(fleet.get("/api/nodes").json()["nodes"]) == 2, what="2 nodes")
    rid = _round(fleet)
    fleet.event(a, rid, "node-a", EventKind.STEP, step=0, loss=1.0)
    fleet.event(b, rid, "node-b", EventKind.FAILED, reason="allreduce deadline passed (node-a)")
    got = fleet.wait_for(lambda: (g := fleet.get(f"/api/rounds/{rid}").json())["state"] == "failed" and g,
                         what="round failed")
    assert "node-b: allreduce deadline passed" in got["reason"]
    # The fleet tells the remaining members to stop waiting.
    msgs = [parse_command(cmds.get(timeout=5)[1]) for _ in range(2)]
    assert isinstance(msgs[1], RoundAbort) and msgs[1].round_id == rid and "node-b" in msgs[1].reason

    rid2 = _round(fleet)
    fleet.event(a, rid2, "node-a", EventKind.DONE, params_sha256="11" * 32, model_version=3)
    fleet.event(b, rid2, "node-b", EventKind.DONE, params_sha256="22" * 32, model_version=3)
    got = fleet.wait_for(lambda: (g := fleet.get(f"/api/rounds/{rid2}").json())["state"] == "failed" and g,
                         what="round failed on hash mismatch")
    assert got["params_agree"] is False and "different parameters" in got["reason"]


def test_round_with_silent_participants_fails_at_deadline(make_fleet):
    # 3 s, not 1 s: the second POST below must find the round still running (a stalled test
    # thread on a loaded runner could otherwise send it after the deadline already failed it).
    fleet = make_fleet(round_start_timeout_s=3.0)
    fleet.announce("node-a"), fleet.announce("node-b")
    cmds = collect(fleet.link("spy"), topics.command(fleet.swarm))
    fleet.wait_for(lambda: len(fleet.get("/api/nodes").json()["nodes"]) == 2, what="2 nodes")
    rid = _round(fleet)
    # 409 while it runs: one round at a time.
    second = fleet.post("/api/rounds", json={"steps": 1})
    assert second.status_code == 409 and rid in second.json()["error"]
    got = fleet.wait_for(lambda: (g := fleet.get(f"/api/rounds/{rid}").json())["state"] == "failed" and g,
                         timeout=10, what="deadline failure")
    assert "deadline passed" in got["reason"] and "node-a" in got["reason"] and "node-b" in got["reason"]
    msgs = [parse_command(cmds.get(timeout=5)[1]) for _ in range(2)]
    assert isinstance(msgs[1], RoundAbort) and msgs[1].round_id == rid


@pytest.mark.parametrize("grace", [2.0, 0.0])
def test_participant_offline_fails_the_round_after_the_grace(make_fleet, grace):
    fleet = make_fleet(round_offline_grace_s=grace)
    fleet.announce("node-a")
    b = fleet.announce("node-b")
    fleet.wait_for(lambda: len(fleet.get("/api/nodes").json()["nodes"]) == 2, what="2 nodes")
    rid = _round(fleet)
    b.publish(topics.status(fleet.swarm, "node-b"), NodeStatus(node_id="node-b", state=NodeState.OFFLINE),
              retain=True).wait_for_publish(5)
    t0 = time.monotonic()
    fleet.wait_for(lambda: not fleet.node("node-b")["online"], what="node-b offline")
    if grace:
        assert fleet.get(f"/api/rounds/{rid}").json()["state"] == "running"  # within the grace
    got = fleet.wait_for(lambda: (g := fleet.get(f"/api/rounds/{rid}").json())["state"] == "failed" and g,
                         what="round failed")
    if grace:
        assert time.monotonic() - t0 > grace / 2
        assert "node-b (went offline and did not come back within 2s)" in got["reason"]
    else:  # no grace: at once, as before it existed
        assert "node-b went offline during the round" in got["reason"]


def test_a_participant_whose_connection_drops_and_comes_back_finishes_the_round(make_fleet):
    """A Last Will fires when a connection merely drops (SIGKILL of the connection's owner is the
    same on the wire); the node reconnects and reports again within the grace: the round goes on.
    The grace is ample (10 s): between the Will and node-b's new status lie paho's reconnect
    (backoff up to 2 s) and this test's polls, which a loaded runner can stretch past a few seconds."""
    fleet = make_fleet(round_offline_grace_s=10.0)
    a = fleet.announce("node-a")
    b = fleet.announce("node-b")
    fleet.wait_for(lambda: len(fleet.get("/api/nodes").json()["nodes"]) == 2, what="2 nodes")
    rid = _round(fleet)
    # node-b's connection dies without DISCONNECT: the broker publishes its Last Will, paho
    # reconnects (0.2 s later) and the node's status goes out again, as StatusPublisher does
    back = threading.Event()
    b.on_connect(lambda reconnected: reconnected and back.set())
    b._client.socket().shutdown(socket.SHUT_RDWR)
    fleet.wait_for(lambda: not fleet.node("node-b")["online"], what="node-b's Last Will")
    assert fleet.get(f"/api/rounds/{rid}").json()["state"] == "running"
    assert back.wait(10), "node-b's client did not reconnect"
    back_status = NodeStatus(node_id="node-b", state=NodeState.TRAINING, round_id=rid, arch="x86_64",
                             board="x86_64", model="digits-mlp", model_version=1, params_sha256="ab" * 32,
                             samples=100)
    b.publish(topics.status(fleet.swarm, "node-b"), back_status, retain=True).wait_for_publish(5)
    fleet.wait_for(lambda: fleet.node("node-b")["online"], what="node-b back")
    fleet.event(a, rid, "node-a", EventKind.DONE, params_sha256="11" * 32, model_version=2)
    fleet.event(b, rid, "node-b", EventKind.DONE, params_sha256="11" * 32, model_version=2)
    got = fleet.wait_for(lambda: (g := fleet.get(f"/api/rounds/{rid}").json())["state"] != "running" and g,
                         what="round settled")
    assert got["state"] == "done", got.get("reason")


def test_409_with_fewer_than_two_online_nodes(fleet):
    r = fleet.post("/api/rounds", json={"steps": 5})
    assert r.status_code == 409 and "fewer than 2 nodes online" in r.json()["error"]
    fleet.announce("node-a")
    fleet.announce("node-b", state=NodeState.OFFLINE)
    fleet.wait_for(lambda: len(fleet.get("/api/nodes").json()["nodes"]) == 2, what="2 nodes")
    r = fleet.post("/api/rounds", json={"steps": 5, "nodes": ["node-a", "node-b"]})
    assert r.status_code == 409 and "fewer than 2 nodes online" in r.json()["error"], r.text
    r = fleet.post("/api/rounds", json={"steps": 5, "nodes": ["node-a", "ghost"]})
    assert r.status_code == 404 and "ghost" in r.json()["error"]


def test_nodes_still_training_are_not_picked(fleet):
    """A node still inside an earlier (e.g. aborted) round would fail a new one at once as busy."""
    fleet.announce("node-a")
    fleet.announce("node-b", state=NodeState.TRAINING)
    fleet.wait_for(lambda: len(fleet.get("/api/nodes").json()["nodes"]) == 2, what="2 nodes")
    r = fleet.post("/api/rounds", json={"steps": 5})
    assert r.status_code == 409 and "idle: node-a" in r.json()["error"], r.text
    fleet.announce("node-b")  # back to idle
    fleet.wait_for(lambda: fleet.node("node-b")["state"] == "online", what="node-b idle")
    r = fleet.post("/api/rounds", json={"steps": 5})
    assert r.status_code == 201 and r.json()["participants"] == ["node-a", "node-b"]


@pytest.mark.parametrize("body", [
    {"steps": 0}, {"steps": "many"}, {"steps": 5, "lr": -1}, {"steps": 5, "sync": "bogus"},
    {"steps": 5, "nodes": "node-a"}, {"steps": 5, "colour": "red"}, {}, [1, 2], None,
])
def test_422_for_bad_bodies(fleet, body):
    r = fleet.post("/api/rounds", json=body) if body is not None else \
        fleet.post("/api/rounds", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text


def test_steps_above_the_fleet_limit_are_422(make_fleet):
    fleet = make_fleet(max_steps=50)
    r = fleet.post("/api/rounds", json={"steps": 51})
    assert r.status_code == 422 and "50" in r.json()["error"]


def test_401_without_token_and_login_cookie(fleet):
    anon = httpx.Client(base_url=fleet.url, timeout=5)
    assert anon.get("/api/health").status_code == 200
    for method, path in [("GET", "/api/nodes"), ("GET", "/api/rounds"), ("POST", "/api/rounds"),
                         ("GET", "/api/rounds/x"), ("GET", "/api/events")]:
        r = anon.request(method, path, json={"steps": 1} if method == "POST" else None)
        assert r.status_code == 401, (path, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
    assert anon.get("/api/nodes", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert anon.get("/api/nodes", params={"token": "wrong"}).status_code == 401
    # The page without a token is the login form, not the dashboard.
    assert "Operator token" in anon.get("/").text
    assert anon.post("/api/login", json={"token": "wrong"}).status_code == 401
    r = anon.post("/api/login", json={"token": TOKEN})
    assert r.status_code == 200 and "httponly" in r.headers["set-cookie"].lower()
    assert anon.get("/api/nodes").status_code == 200  # the cookie now authenticates
    assert 'id="loss-plot"' in anon.get("/").text
    anon.post("/api/logout")
    anon.cookies.clear()
    assert anon.get("/api/nodes").status_code == 401
    # ?token= on the page logs in (SameSite=Strict, as documented) and hops to a clean URL.
    r = anon.get("/", params={"token": TOKEN}, follow_redirects=False)
    assert r.status_code == 200 and 'content="0;url=/"' in r.text
    assert "samesite=strict" in r.headers["set-cookie"].lower()
    assert anon.get("/api/nodes").status_code == 200
    # No public API schema or docs (with or without the token).
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert anon.get(path).status_code in (401, 404), path
    anon.close()


def test_malformed_messages_are_rejected_and_counted(fleet):
    ln = fleet.link("vandal")
    ln.publish(topics.status(fleet.swarm, "junk"), b"{not json", retain=True).wait_for_publish(5)
    liar = b'{"v":1,"node_id":"other","state":"online"}'
    ln.publish(topics.status(fleet.swarm, "liar"), liar).wait_for_publish(5)
    ln.publish(topics.round_events(fleet.swarm, "r1", "x"), b'{"v":99}').wait_for_publish(5)
    fleet.wait_for(lambda: fleet.service.rejected_messages >= 3, what="3 rejected messages")
    assert fleet.get("/api/nodes").json()["nodes"] == []
    ln.publish(topics.status(fleet.swarm, "junk"), b"", retain=True).wait_for_publish(5)


def test_settings_read_token_from_environment(monkeypatch):
    monkeypatch.setenv("FRACTAL_FLEET_TOKEN", "from-env")
    assert FleetSettings().token == "from-env"
