"""Roll-out bookkeeping without a broker: the canary rule, stop at the first failure, stage
deadlines, what the fleet refuses before it sends anything, and the commands' bounds."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from api.fleet.rollouts import ImageRollbackRequest, RolloutManager, RolloutRequest
from api.fleet.rounds import RoundRejected
from federation.messages import ImageRollbackCommand, ImageUpdateCommand, parse_command

IMG = {"id": "ab" * 16, "version": "2.0.0", "board": "x86_64", "size": 1000}


def view(node_id: str, *, version: str = "1.0.0", online: bool = True, board: str = "x86_64",
         health: str = "passed", previous: str | None = None, image: bool = True,
         state: str = "online") -> dict:
    im = {"version": version, "slot": "a", "state": "good", "health": health, "previous": previous,
          "update": None} if image else None
    return {"node_id": node_id, "online": online, "board": board, "state": state if online else "offline",
            "image": im}


def status(update_id: str, phase: str, version: str = "2.0.0", error: str | None = None) -> dict:
    return {"version": version, "slot": "b", "state": "good", "health": "passed", "previous": "1.0.0",
            "update": {"update_id": update_id, "kind": "update", "phase": phase, "version": version,
                       "error": error}}


@pytest.fixture
def mgr():
    sent: list = []
    m = RolloutManager(swarm="s", publish=lambda topic, msg: sent.append((topic, msg)), stage_timeout_s=60)
    m.sent = sent  # type: ignore[attr-defined]
    return m


NODES = [view("n1"), view("n2"), view("n3")]


def test_canary_first_then_the_rest(mgr):
    r = mgr.start(RolloutRequest(image=IMG["id"], nodes=["n2", "n1", "n3"]), image=IMG, url="http://f/x",
                  nodes=NODES, now=100.0)
    assert r.stages == [["n2"], ["n1", "n3"]]
    (topic, cmd), = mgr.sent
    assert topic == "fractal/v1/s/cmd" and isinstance(cmd, ImageUpdateCommand) and cmd.nodes == ["n2"]
    assert parse_command(cmd.model_dump_json()) == cmd  # what the nodes parse
    # statuses of other nodes, of other updates, and progress phases do not advance the stage
    assert mgr.on_status("n1", status(r.rollout_id, "done"), 101.0) is None
    assert mgr.on_status("n2", status("u-other", "done"), 101.0) is None
    mgr.on_status("n2", status(r.rollout_id, "downloading"), 101.0)
    mgr.on_status("n2", status(r.rollout_id, "trial"), 102.0)
    assert len(mgr.sent) == 1 and r.nodes["n2"].phase == "trial"
    mgr.on_status("n2", status(r.rollout_id, "done"), 103.0)
    assert len(mgr.sent) == 2 and mgr.sent[1][1].nodes == ["n1", "n3"]
    assert r.nodes["n1"].sent_at == 103.0 >= r.nodes["n2"].finished_at
    mgr.on_status("n1", status(r.rollout_id, "done"), 104.0)
    assert r.state.value == "running"
    mgr.on_status("n3", status(r.rollout_id, "done"), 105.0)
    assert r.state.value == "done" and r.finished_at == 105.0


def test_a_canary_that_rolls_back_stops_the_rollout(mgr):
    r = mgr.start(RolloutRequest(image=IMG["id"], nodes=["n1", "n2"]), image=IMG, url="http://f/x",
                  nodes=NODES, now=0.0)
    mgr.on_status("n1", status(r.rollout_id, "rolled_back", "1.0.0", "output differs"), 5.0)
    assert r.state.value == "failed" and r.reason == "canary n1 rolled back by itself: output differs"
    assert len(mgr.sent) == 1 and r.nodes["n2"].sent_at is None
    assert mgr.running() is None  # the next roll-out may start


def test_a_failure_in_the_second_stage_and_a_stage_deadline(mgr):
    r = mgr.start(RolloutRequest(image=IMG["id"], nodes=["n1", "n2", "n3"]), image=IMG, url="http://f/x",
                  nodes=NODES, now=0.0)
    mgr.on_status("n1", status(r.rollout_id, "done"), 1.0)
    mgr.on_status("n2", status(r.rollout_id, "failed", "1.0.0", "download failed"), 2.0)
    assert r.state.value == "failed" and r.reason == "n2 refused: download failed"
    r2 = mgr.start(RolloutRequest(image=IMG["id"], nodes=["n3"]), image=IMG, url="http://f/x",
                   nodes=NODES, now=10.0)
    assert mgr.tick(69.0) is None
    assert mgr.tick(71.0) is r2 and r2.reason == "not done within 60 s: n3"


@pytest.mark.parametrize(("nodes", "views", "code", "word"), [
    (["n1", "ghost"], NODES, 404, "unknown node"),
    (["n1"], [view("n1", online=False)], 409, "offline"),
    (["n1"], [view("n1", image=False)], 409, "do not run from a device image"),
    (["n1"], [view("n1", health="pending")], 409, "health check not passed"),
    (["n1"], [view("n1", state="training")], 409, "busy"),
    (["n1"], [view("n1", board="rpi4")], 409, "for board x86_64"),
    (["n1"], [view("n1", version="2.0.0")], 409, "already"),
])
def test_refusals_send_nothing(mgr, nodes, views, code, word):
    with pytest.raises(RoundRejected) as exc:
        mgr.start(RolloutRequest(image=IMG["id"], nodes=nodes), image=IMG, url="http://f/x", nodes=views,
                  now=0)
    assert exc.value.status_code == code and word in exc.value.reason
    assert mgr.sent == []


def test_image_rollback_needs_a_previous_slot_and_one_operation_at_a_time(mgr):
    with pytest.raises(RoundRejected, match="no previous good slot"):
        mgr.start_rollback(ImageRollbackRequest(nodes=["n1"]), nodes=NODES, now=0)
    views = [view("n1", previous="0.9.0"), view("n2", previous="0.9.0")]
    r = mgr.start_rollback(ImageRollbackRequest(nodes=["n1", "n2"]), nodes=views, now=0)
    assert isinstance(mgr.sent[0][1], ImageRollbackCommand) and r.stages == [["n1", "n2"]]
    with pytest.raises(RoundRejected, match="still running"):
        mgr.start(RolloutRequest(image=IMG["id"], nodes=["n1"]), image=IMG, url="http://f/x", nodes=views,
                  now=1)
    for n in ("n1", "n2"):
        mgr.on_status(n, {**status(r.rollout_id, "done", "0.9.0"), "update": {
            "update_id": r.rollout_id, "kind": "rollback", "phase": "done", "version": "0.9.0"}}, 2.0)
    assert r.state.value == "done"


@pytest.mark.parametrize("bad", [
    {"url": "file:///etc/passwd"},
    {"url": "http://" + "x" * 600},
    {"size": 5 << 30},
    {"size": 0},
    {"image_id": "../../etc"},
    {"version": "1.0.0; rm -rf"},
    {"nodes": []},
    {"nodes": ["a/b"]},
    {"update_id": "#"},
])
def test_update_commands_are_bounded(bad):
    good = {"v": 1, "kind": "image.update", "update_id": "u1", "nodes": ["n1"], "image_id": "ab" * 16,
            "version": "2.0.0", "size": 10, "url": "http://fleet/api/images/x"}
    parse_command(json.dumps(good))
    with pytest.raises(ValidationError):
        parse_command(json.dumps({**good, **bad}))


def test_request_bodies_are_strict():
    for body in ({"image": "x", "nodes": ["n1"]}, {"image": "ab" * 16, "nodes": []},
                 {"image": "ab" * 16, "nodes": ["n1"], "extra": 1}, {"image": "ab" * 16, "nodes": ["../x"]}):
        with pytest.raises(ValidationError):
            RolloutRequest.model_validate(body)


@pytest.mark.parametrize(("lie", "word"), [
    ({"version": "1.0.0", "slot": "a"}, "version '1.0.0', not '2.0.0'"),  # issue 26 finding 5
    ({"state": "trial"}, "not good and passed"),
    ({"health": "pending"}, "not good and passed"),
])
def test_a_canary_that_says_done_without_showing_it_does_not_pass(mgr, lie, word):
    """Issue 26, finding 5: a canary with a valid key said phase ``done`` while its status still
    reported the old version; the fleet sent the image on and marked the roll-out done."""
    r = mgr.start(RolloutRequest(image=IMG["id"], nodes=["n1", "n2"]), image=IMG, url="http://f/x",
                  nodes=NODES, now=0.0)
    mgr.on_status("n1", {**status(r.rollout_id, "done"), **lie}, 5.0)
    assert r.state.value == "failed", r.to_dict()
    assert r.reason.startswith("canary n1 reported done, but") and word in r.reason, r.reason
    assert len(mgr.sent) == 1 and r.nodes["n2"].sent_at is None  # the image went no further
    # a later, truthful "done" cannot revive it
    mgr.on_status("n1", status(r.rollout_id, "done"), 6.0)
    assert r.state.value == "failed" and len(mgr.sent) == 1


def test_an_image_rollback_is_done_only_at_the_previous_version(mgr):
    views = [view("n1", previous="0.9.0")]
    r = mgr.start_rollback(ImageRollbackRequest(nodes=["n1"]), nodes=views, now=0)
    mgr.on_status("n1", {**status(r.rollout_id, "done", "1.0.0"), "update": {
        "update_id": r.rollout_id, "kind": "rollback", "phase": "done", "version": "0.9.0"}}, 2.0)
    assert r.state.value == "failed" and "version '1.0.0', not '0.9.0'" in r.reason


def test_each_stage_carries_a_fresh_short_grant():
    sent: list = []
    grants: list = []

    def grant(image_id: str, exp: int) -> str:
        grants.append((image_id, exp))
        return f"exp={exp}&grant=g{len(grants)}"

    m = RolloutManager(swarm="s", publish=lambda t, msg: sent.append(msg), stage_timeout_s=3600, grant=grant)
    r = m.start(RolloutRequest(image=IMG["id"], nodes=["n1", "n2"]), image=IMG, url="http://f/api/images/x",
                nodes=NODES, now=1000.0)
    assert sent[0].url == "http://f/api/images/x?exp=1900&grant=g1"  # GRANT_S (15 min), not the hour
    assert m.downloading(IMG["id"], "n1") and not m.downloading(IMG["id"], "n2")
    assert not m.downloading("cd" * 16, "n1")
    m.on_status("n1", status(r.rollout_id, "done"), 1500.0)
    assert sent[1].url == "http://f/api/images/x?exp=2400&grant=g2" and sent[1].nodes == ["n2"]
    assert not m.downloading(IMG["id"], "n1") and m.downloading(IMG["id"], "n2")


def test_a_halted_node_is_refused_and_fails_the_running_rollout_with_its_reason(mgr):
    """Issue 26 finding 7: a board with no bootable slot says so (state ``halted``, ``halt``); a
    roll-out refuses it naming the reason, and a running one fails at once instead of waiting out
    its deadline."""
    halted = view("n2", online=False) | {"state": "halted", "halt": "slot a: below the floor 5"}
    with pytest.raises(RoundRejected, match=r"halted, no bootable slot: n2 \(slot a: below the floor 5\)"):
        mgr.start(RolloutRequest(image=IMG["id"], nodes=["n1", "n2"]), image=IMG, url="http://f/x",
                  nodes=[view("n1"), halted], now=100.0)
    r = mgr.start(RolloutRequest(image=IMG["id"], nodes=["n1", "n2"]), image=IMG, url="http://f/x",
                  nodes=NODES, now=100.0)
    assert mgr.on_halt("n3", "not in it", 101.0) is None
    assert mgr.on_halt("n1", "slot b: its files do not verify", 101.0) is r
    assert r.state.value == "failed"
    assert r.reason == "canary n1 halted, no bootable slot: slot b: its files do not verify"


def test_the_registry_keeps_a_halted_node_halted_without_heartbeats():
    """A halted board publishes once and never heartbeats: it is never online, never idle, and is
    not turned into "offline, no heartbeat" however long it stays silent."""
    from api.fleet.registry import NodeRegistry
    from federation.messages import NodeState, NodeStatus

    reg = NodeRegistry()
    st = NodeStatus(node_id="n1", state=NodeState.HALTED, halt="slot a: below the floor 5",
                    keepalive_s=1, ts=0)
    assert reg.update(st, 0.0)["state"] == "halted"
    assert reg.expire(1e6) == [] and reg.online_ids(1e6) == set() and reg.idle_ids(1e6) == set()
    (v,) = reg.snapshot(1e6)
    assert (v["state"], v["online"], v["halt"]) == ("halted", False, "slot a: below the floor 5")
    assert v["offline_reason"] == "halted: no bootable slot (slot a: below the floor 5)"
    reg.update(st.model_copy(update={"state": NodeState.ONLINE, "ts": 2e6}), 2e6)  # it booted again
    assert reg.snapshot(2e6)[0]["halt"] is None and reg.online_ids(2e6) == {"n1"}
