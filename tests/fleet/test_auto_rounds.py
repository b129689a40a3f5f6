"""Automatic rounds (issue 31 item 3): the policy's pure decisions, a node lying about its new
samples, the HTTP API and its persistence, the schedule driven by an injected clock over a real
Mosquitto, and two real edge nodes whose new samples start a round that commits by itself."""

from __future__ import annotations

import contextlib
import datetime as dt
import json

import httpx
import pytest
from pydantic import ValidationError

from api.fleet.autorounds import (
    AutoRoundPolicy,
    AutoState,
    Trigger,
    Window,
    accept_samples,
    decide,
    next_schedule_due,
    samples_progress,
)
from api.fleet.history import FleetHistory
from federation.bounds import SAMPLES_MAX
from federation.messages import NodeStatus, parse_status

pytestmark = pytest.mark.mosquitto

AB = {"a": 1, "b": 1}  # the candidate participants and the version each holds
T0 = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC).timestamp()


def _policy(**kw) -> AutoRoundPolicy:
    return AutoRoundPolicy.model_validate({"enabled": True, **kw})


# -- the decision, pure ------------------------------------------------------------------------
def test_samples_trigger_needs_two_nodes_and_caps_each():
    p = _policy(samples={"enabled": True, "threshold": 100})
    st = AutoState()
    accept_samples(st, "a", 1, SAMPLES_MAX)  # a liar (or the only node with data): half the threshold
    assert decide(p, st, AB, T0).trigger is None
    assert samples_progress(p, st, AB)["nodes"] == {"a": 50, "b": 0}
    accept_samples(st, "b", 1, 49)
    assert decide(p, st, AB, T0).trigger is None
    accept_samples(st, "b", 1, 50)
    assert decide(p, st, AB, T0) == decide(p, st, AB, T0 + 1)
    assert decide(p, st, AB, T0).trigger is Trigger.SAMPLES
    assert decide(p, st, {"a": 1}, T0).trigger is None  # only participants' samples count
    # a node whose round just committed (the fleet sees v2) still has a v1 figure: it counts 0
    assert samples_progress(p, st, {"a": 2, "b": 1})["nodes"] == {"a": 0, "b": 50}
    assert decide(p.model_copy(update={"enabled": False}), st, AB, T0).trigger is None


def test_a_count_going_backwards_is_ignored_until_a_new_version():
    st = AutoState()
    assert accept_samples(st, "a", 3, 500)
    assert not accept_samples(st, "a", 3, 10)  # same version, fewer new samples: a replay or a lie
    assert st.counts["a"] == (3, 500)
    assert accept_samples(st, "a", 4, 0)  # a commit resets it
    assert st.counts["a"] == (4, 0)


def test_automatic_rounds_keep_their_spacing_whatever_the_nodes_say():
    """A node reporting a huge count after every commit cannot start rounds back to back."""
    p = _policy(samples={"enabled": True, "threshold": 10}, min_spacing_min=5)
    st = AutoState(last_auto_start=T0)
    accept_samples(st, "a", 1, SAMPLES_MAX)
    accept_samples(st, "b", 1, SAMPLES_MAX)
    d = decide(p, st, AB, T0 + 299)
    assert d.trigger is Trigger.SAMPLES and d.wait and "5 min" in d.wait
    assert decide(p, st, AB, T0 + 300).wait is None


def test_schedule_every_n_minutes_within_a_window():
    p = _policy(schedule={"enabled": True, "every_min": 30})
    st = AutoState(schedule_anchor=T0)
    assert next_schedule_due(p, st, T0) == T0 + 1800
    assert decide(p, st, {}, T0 + 1799).trigger is None
    assert decide(p, st, {}, T0 + 1800).trigger is Trigger.SCHEDULE
    night = _policy(schedule={"enabled": True, "every_min": 30, "window": {"start": "22:00", "end": "06:00"}})
    # due at 12:30, outside 22:00-06:00: waits for 22:00 the same day
    assert next_schedule_due(night, st, T0) == T0 + 10 * 3600
    st2 = AutoState(schedule_anchor=T0 + 11 * 3600)  # 23:00: 23:30 is inside (the window wraps midnight)
    assert next_schedule_due(night, st2, T0) == T0 + 11.5 * 3600
    st3 = AutoState(schedule_anchor=T0 + 17.75 * 3600)  # 05:45 next day: 06:15 is out -> 22:00
    assert next_schedule_due(night, st3, T0) == T0 + 34 * 3600
    assert Window(start="08:00", end="17:00").contains(T0)
    assert not Window(start="13:00", end="17:00").contains(T0)


@pytest.mark.parametrize("body", [
    {"enabled": "yes please"},
    {"schedule": {"enabled": True, "every_min": 0.5}},  # below 1 minute
    {"schedule": {"every_min": 10**6}},
    {"schedule": {"window": {"start": "25:00", "end": "01:00"}}},
    {"schedule": {"window": {"start": "01:00", "end": "01:00"}}},
    {"samples": {"threshold": -5}},
    {"samples": {"threshold": 1}},
    {"samples": {"threshold": 10**12}},
    {"min_spacing_min": 0},
    {"round": {"steps": 0}},
    {"round": {"steps": 5, "lr": "NaN"}},
    {"surprise": 1},
])
def test_policy_bounds(body):
    with pytest.raises(ValidationError):
        AutoRoundPolicy.model_validate(body)


@pytest.mark.parametrize("value", ["-1", "1e400", "NaN", "Infinity", "1.5", str(SAMPLES_MAX + 1), '"many"'])
def test_status_with_an_impossible_sample_count_is_refused(value):
    good = json.loads(NodeStatus(node_id="n", state="online", samples_new=3).model_dump_json())
    assert parse_status(json.dumps(good).encode()).samples_new == 3
    raw = json.dumps(good).replace('"samples_new":3', f'"samples_new":{value}').replace(
        '"samples_new": 3', f'"samples_new": {value}')
    assert value in raw
    with pytest.raises(ValidationError):
        parse_status(raw.encode())


# -- the API over a real broker ------------------------------------------------------------------
def test_auto_rounds_api_validates_authenticates_and_survives_a_restart(make_fleet, tmp_path):
    db = str(tmp_path / "fleet.sqlite")
    fleet = make_fleet(db=db)
    got = fleet.get("/api/auto-rounds").json()
    assert got["policy"]["enabled"] is False and got["status"]["next_due"] is None
    body = {"enabled": True, "schedule": {"enabled": True, "every_min": 15, "window": None},
            "samples": {"enabled": True, "threshold": 400}, "min_spacing_min": 3,
            "round": {"steps": 7, "nodes": None}}
    assert fleet.client.put("/api/auto-rounds", json=body, headers={"Authorization": "Bearer nope"}
                            ).status_code == 401
    for bad in ({"samples": {"threshold": 0}}, {"schedule": {"every_min": float("inf")}}, {"x": 1}):
        r = fleet.client.put("/api/auto-rounds", content=json.dumps(bad).replace("Infinity", "1e999"),
                             headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (bad, r.text)
    assert fleet.client.put("/api/auto-rounds", content=b"{", headers={"Content-Type": "application/json"}
                            ).status_code == 422
    r = fleet.client.put("/api/auto-rounds", json={"round": {"steps": 20_000}})  # the fleet's max_steps
    assert r.status_code == 422 and "limit of 10000" in r.json()["error"]
    r = fleet.client.put("/api/auto-rounds", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["policy"]["samples"]["threshold"] == 400
    due = r.json()["status"]["next_due"]
    assert due == pytest.approx(fleet.service.auto.clock() + 900, abs=5)
    assert fleet.get("/api/actions").json()["actions"][0]["action"] == "auto_rounds.policy"
    fleet.stop()
    again = make_fleet(swarm=fleet.swarm, db=db)
    after = again.get("/api/auto-rounds").json()
    assert after["policy"] == r.json()["policy"] and after["status"]["next_due"] == pytest.approx(due)
    again.stop()
    # a stored policy that no longer validates (edited, or a bound tightened): the fleet starts, off
    store = FleetHistory(db)
    store.set_value("auto_rounds.policy", '{"enabled": true, "min_spacing_min": 0}')
    store.close()
    third = make_fleet(swarm=fleet.swarm, db=db)
    assert third.get("/api/auto-rounds").json()["policy"]["enabled"] is False


def test_schedule_starts_rounds_by_injected_clock_and_waits_when_busy(make_fleet):
    """A schedule of every minute, its clock advanced by the test: a round starts with trigger
    "schedule" through the operator's path; the next due time finds it running and waits, recorded."""
    fleet = make_fleet(auto_check_s=0.05, round_start_timeout_s=600)
    now = [T0]
    fleet.service.auto.clock = lambda: now[0]
    fleet.announce("sa", keepalive_s=600)  # no heartbeats: a slow machine must not see them stale
    fleet.announce("sb", keepalive_s=600)
    fleet.wait_for(lambda: len([n for n in fleet.get("/api/nodes").json()["nodes"] if n["online"]]) == 2,
                   what="2 online nodes")
    r = fleet.client.put("/api/auto-rounds", json={"enabled": True, "min_spacing_min": 1,
                                                   "schedule": {"enabled": True, "every_min": 1},
                                                   "round": {"steps": 3}})
    assert r.json()["status"]["next_due"] == T0 + 60
    now[0] = T0 + 59
    # nothing is due yet: a check at 59 s starts nothing (the next check sees the same clock)
    assert fleet.service.check_auto_rounds() is None
    now[0] = T0 + 60
    rnd = fleet.wait_for(lambda: next(iter(fleet.get("/api/rounds").json()["rounds"]), None),
                         what="the scheduled round")
    assert rnd["trigger"] == "schedule" and rnd["participants"] == ["sa", "sb"] and rnd["steps"] == 3
    # The ticker thread makes the round visible first, then records its start_round action, then
    # (once start_round returned) moves the schedule's anchor: an HTTP read in between sees the
    # round without either. Wait for each; what they say is checked exactly.
    start = fleet.wait_for(lambda: next((a for a in fleet.get("/api/actions").json()["actions"]
                                         if a["action"] == "start_round"), None), what="start_round recorded")
    assert start["detail"]["trigger"] == "schedule" and start["detail"]["round_id"] == rnd["round_id"]
    due = fleet.wait_for(lambda: (d := fleet.get("/api/auto-rounds").json()["status"]["next_due"]) != T0 + 60
                         and d, what="the schedule's next due time moved on")
    assert due == T0 + 120
    now[0] = T0 + 120  # due again while the round runs (the sim nodes never answer): it waits
    waited = fleet.wait_for(lambda: next((a for a in fleet.get("/api/actions").json()["actions"]
                                          if a["action"] == "auto_round.deferred"), None), what="deferral")
    assert waited["detail"]["trigger"] == "schedule" and rnd["round_id"] in waited["detail"]["reason"]
    assert len(fleet.get("/api/rounds").json()["rounds"]) == 1
    # recorded once, however many checks it waits through
    fleet.wait_for(lambda: fleet.get("/api/auto-rounds").json()["status"]["waiting"].get("schedule"),
                   what="the wait shown")
    for _ in range(5):
        fleet.service.check_auto_rounds()
    assert sum(a["action"] == "auto_round.deferred" for a in fleet.get("/api/actions").json()["actions"]) == 1
    # the operator's round meets the same coordinator
    assert fleet.post("/api/rounds", json={"steps": 2}).status_code == 409


def test_a_node_lying_about_its_samples_starts_nothing(make_fleet):
    fleet = make_fleet(auto_check_s=0.05)
    fleet.announce("liar", samples_new=SAMPLES_MAX, keepalive_s=600)
    fleet.announce("honest", samples_new=0, keepalive_s=600)
    fleet.wait_for(lambda: len([n for n in fleet.get("/api/nodes").json()["nodes"] if n["online"]]) == 2,
                   what="2 online nodes")
    r = fleet.client.put("/api/auto-rounds", json={"enabled": True, "samples": {"enabled": True,
                                                                                 "threshold": 1000}})
    assert r.json()["status"]["samples"]["nodes"] == {"honest": 0, "liar": 500}
    fleet.announce("liar", samples_new=3, keepalive_s=600)  # backwards without a new version: ignored
    fleet.wait_for(lambda: fleet.service.auto.ignored_backwards == 1, what="the ignored status")
    for _ in range(3):
        assert fleet.service.check_auto_rounds() is None
    assert fleet.get("/api/rounds").json()["rounds"] == []
    assert fleet.service.auto.state.recorded == set()  # nothing was due: nothing waited
    assert fleet.get("/api/auto-rounds").json()["status"]["samples"]["total"] == 500
    # the operator's round, meanwhile, is recorded as the operator's
    r = fleet.post("/api/rounds", json={"steps": 2})
    assert r.status_code == 201, r.text
    assert fleet.get(f"/api/rounds/{r.json()['round_id']}").json()["trigger"] == "operator"
    start = fleet.get("/api/actions").json()["actions"][0]
    assert start["action"] == "start_round" and start["detail"]["trigger"] == "operator"


def test_an_automatic_round_that_makes_validation_worse_is_rolled_back(make_fleet):
    """Simulated nodes report new samples; the round they start costs 20 points of validation
    accuracy and the fleet rolls it back, as it would an operator's; nothing new: no second round."""
    from tests.fleet.sim_nodes import SimSwarm

    fleet = make_fleet(auto_check_s=0.05)
    sim = SimSwarm(fleet.broker_url, fleet.swarm, ["w-1", "w-2"], round_s=0.2)
    try:
        sim.gain = -0.2
        fleet.wait_for(lambda: sum(v["online"] for v in fleet.get("/api/nodes").json()["nodes"]) == 2,
                       what="2 online nodes")
        r = fleet.client.put("/api/auto-rounds", json={"enabled": True, "round": {"steps": 6},
                                                       "samples": {"enabled": True, "threshold": 100}})
        assert r.status_code == 200
        for node in sim.nodes.values():
            node.samples_new = 60
            node.announce()
        rnd = fleet.wait_for(lambda: next(iter(fleet.get("/api/rounds").json()["rounds"]), None), 10,
                             "the automatic round")
        assert rnd["trigger"] == "samples"
        done = fleet.wait_for(lambda: (d := fleet.get(f"/api/rounds/{rnd['round_id']}").json())["rollback"]
                              and d, 20, "the automatic rollback")
        assert done["state"] == "done" and done["regressed"] and done["rollback"]["by"] == "auto"
        assert done["rollback"]["to_version"] == 0
        got = fleet.get("/api/actions").json()["actions"]
        acts = [a["action"] for a in got]
        assert acts == ["rollback.done", "rollback", "start_round", "auto_rounds.policy"], got
        assert fleet.get("/api/auto-rounds").json()["status"]["samples"]["total"] == 0
        assert len(fleet.get("/api/rounds").json()["rounds"]) == 1
    finally:
        sim.close()


# -- two real edge nodes: new samples start a round by themselves ------------------------------
def test_new_samples_on_two_nodes_start_a_round_that_commits(make_fleet, node_factory, digits_artifact,
                                                             digits_data):
    with contextlib.ExitStack() as stack:
        _new_samples_start_a_round(stack, make_fleet, node_factory, digits_artifact, digits_data)


def _new_samples_start_a_round(stack, make_fleet, node_factory, digits_artifact, digits_data):
    from api.node_app import create_node_app
    from api.serving import ServerThread
    from compiler import load_artifact

    fleet = make_fleet(auto_check_s=0.1)
    x, y = digits_data
    art = load_artifact(digits_artifact)
    ids = ["auto-n0", "auto-n1"]

    def new_of(node: str) -> int | None:
        return fleet.get("/api/auto-rounds").json()["status"]["samples"]["nodes"].get(node)

    nodes = [node_factory(n, digits_artifact, artifact=art, broker=fleet.broker_url, swarm=fleet.swarm)
             for n in ids]
    fleet.wait_for(lambda: sum(v["online"] for v in fleet.get("/api/nodes").json()["nodes"]) == 2, 20,
                   "2 online nodes")
    policy = {"enabled": True, "samples": {"enabled": True, "threshold": 200},
              "round": {"steps": 3, "lr": 0.05}}
    r = fleet.client.put("/api/auto-rounds", json=policy)
    assert r.status_code == 200, r.text
    # the samples arrive as a client posts them: over each node's HTTP API
    servers = [stack.enter_context(ServerThread(create_node_app(n))) for n in nodes]

    def post(k: int, lo: int, hi: int) -> None:
        body = {"inputs": {"x": x[lo:hi].tolist()}, "labels": y[lo:hi].tolist()}
        r = httpx.post(f"{servers[k].url}/v1/samples", json=body, timeout=30)
        assert r.status_code < 300, r.text

    post(0, 0, 150)  # one node alone: at most half the threshold
    fleet.wait_for(lambda: new_of("auto-n0") == 100, 20, "n0's new samples")
    assert fleet.get("/api/rounds").json()["rounds"] == []
    post(1, 150, 250)
    rnd = fleet.wait_for(lambda: next(iter(fleet.get("/api/rounds").json()["rounds"]), None), 20,
                         "the automatic round")
    assert rnd["trigger"] == "samples" and rnd["participants"] == ids
    rid = rnd["round_id"]
    done = fleet.wait_for(lambda: (d := fleet.get(f"/api/rounds/{rid}").json())["state"] != "running" and d,
                          120, "the round's end")
    assert done["state"] == "done", done["reason"]
    assert done["params_agree"] is True and done["version_after"] == 1
    start = next(a for a in fleet.get("/api/actions").json()["actions"] if a["action"] == "start_round")
    assert start["detail"] == {"round_id": rnd["round_id"], "trigger": "samples",
                               "request": start["detail"]["request"]}
    acts = fleet.get("/api/actions").json()["actions"]
    assert not [a for a in acts if a["action"] == "auto_round.deferred"]  # nothing fired while it ran
    # the nodes now report nothing new: no second round follows
    fleet.wait_for(lambda: all(v["samples_new"] == 0 and v["model_version"] == 1
                               for v in fleet.get("/api/nodes").json()["nodes"]), 20, "statuses after commit")
    assert fleet.get("/api/auto-rounds").json()["status"]["samples"]["total"] == 0
    assert [n.store.count_new() for n in nodes] == [0, 0]
    post(0, 300, 310)
    fleet.wait_for(lambda: new_of("auto-n0") == 10, 20, "samples after the commit")
    assert len(fleet.get("/api/rounds").json()["rounds"]) == 1


def test_a_flapping_count_records_each_wait_once(tmp_path):
    """A count crossing the threshold again and again during the spacing (a node dropping off and
    coming back) records its wait once, however often it flaps; the panel shows it while it waits."""
    from api.fleet.autorounds import AutoRounds
    from api.fleet.history import FleetHistory

    store = FleetHistory(tmp_path / "f.sqlite")
    now = [T0]
    auto = AutoRounds(store, lambda: now[0])
    auto.set_policy(_policy(samples={"enabled": True, "threshold": 100}))
    started: list[str] = []
    auto.state.last_auto_start = T0 - 60  # a minute ago: 9 to wait
    for _ in range(50):
        auto.on_status("a", 1, 60)
        auto.on_status("b", 1, 60)
        assert auto.check(AB, lambda req, t: started.append(t) or {}) is None
        assert auto.view(AB)["status"]["waiting"]["samples"].startswith("the last automatic round")
        auto.on_status("b", 1, None)  # its Last Will: no figure
        assert auto.check(AB, lambda req, t: started.append(t) or {}) is None
        assert auto.view(AB)["status"]["waiting"] == {}
    waits = [a for a in store.actions(500) if a["action"] == "auto_round.deferred"]
    assert len(waits) == 1 and started == []
    now[0] = T0 + 9 * 60
    auto.on_status("b", 1, 60)
    assert auto.check(AB, lambda req, t: started.append(t) or {"round_id": "r"}) == {"round_id": "r"}
    assert started == [Trigger.SAMPLES] and auto.state.last_auto_start == now[0]
    store.close()
