"""Validation results, the loss series the plot draws, and rollbacks (automatic and by hand) as the
fleet folds and drives them: unit tests without a broker, then the service over a real Mosquitto."""

from __future__ import annotations

import math
import sys

import pytest

from api.fleet.history import FleetHistory
from api.fleet.rollback import RollbackManager, RollbackRequest, RollbackState
from api.fleet.rounds import RoundManager, RoundRejected, RoundRequest, regression, swarm_validation
from federation import topics
from federation.messages import (
    EventKind,
    NodeState,
    RollbackCommand,
    RoundEvent,
    Validation,
    parse_command,
)
from tests.fleet.conftest import collect


def _ev(rid, node, kind, **kw):
    return RoundEvent(kind=kind, round_id=rid, node_id=node, **kw)


def _manager(sent, **kw):
    return RoundManager(swarm="s", publish=lambda t, m: sent.append((t, m)), start_timeout_s=5,
                        idle_timeout_s=5, **kw)


# -- the loss series -------------------------------------------------------------------------------
def test_batched_step_events_give_every_step_and_wall_time():
    """A short round reports few events, each carrying the losses since the last: every step is
    plotted, and each point has a wall time interpolated between the events' arrival times."""
    m = _manager([])
    rid = m.start(RoundRequest(steps=200), online={"a", "b"}, known={"a", "b"}, now=100.0).round_id
    for node in ("a", "b"):
        head = [2.0 - i / 100 for i in range(120)]
        m.on_event(_ev(rid, node, EventKind.STEP, step=119, losses=head), 100.6)
        tail = [0.8 - i / 1000 for i in range(80)]
        m.on_event(_ev(rid, node, EventKind.STEP, step=199, losses=tail), 101.0)
    series = m.get(rid)["loss"]
    assert [s["step"] for s in series] == list(range(200))
    assert all(s["complete"] for s in series)
    assert series[0]["mean"] == pytest.approx(2.0) and series[199]["mean"] == pytest.approx(0.8 - 0.079)
    times = [s["t"] for s in series]
    assert times == sorted(times) and times[119] == pytest.approx(0.6) and times[199] == pytest.approx(1.0)
    assert times[59] == pytest.approx(0.6 * 60 / 120)  # step 59 ends 60/120 of the way to the first event
    assert len(m.get(rid, max_points=50)["loss"]) == 50  # still thinned for the event stream


def test_hostile_step_values_are_dropped_not_stored():
    """NaN/inf losses and steps outside the round never reach the (strict JSON) history."""
    m = _manager([], store=None)
    rid = m.start(RoundRequest(steps=10), online={"a", "b"}, known={"a", "b"}, now=0.0).round_id
    # federation/bounds.py refuses these at parse time already; the manager is a second wall, so
    # the events are built without validation here (as a bug upstream might hand them over).
    def raw(**kw):
        return RoundEvent.model_construct(kind=EventKind.STEP, round_id=rid, node_id="a", **kw)

    m.on_event(raw(step=3, loss=None, losses=[1.0, math.nan, math.inf, None]), 1.0)
    m.on_event(raw(step=10**12, loss=1.0, losses=None), 1.0)
    m.on_event(raw(step=-5, loss=1.0, losses=None), 1.0)
    m.on_event(raw(step=3, loss=math.nan, losses=None), 1.0)
    assert [s["step"] for s in m.get(rid)["loss"]] == [0]
    assert m.dropped_values == 5


def test_hostile_steps_do_not_break_the_store(tmp_path):
    store = FleetHistory(tmp_path / "f.sqlite")
    m = _manager([], store=store)
    rid = m.start(RoundRequest(steps=3), online={"a", "b"}, known={"a", "b"}, now=0.0).round_id
    for node in ("a", "b"):
        m.on_event(_ev(rid, node, EventKind.STEP, step=1, losses=[math.nan, 1.0]), 1.0)
        m.on_event(_ev(rid, node, EventKind.DONE, step=3, loss=math.nan, params_sha256="ab" * 32,
                       model_version=1), 2.0)
    assert store.get_round(rid)["state"] == "done"


# -- validation and the regression rule ------------------------------------------------------------
def test_swarm_validation_is_weighted_by_samples():
    v = swarm_validation([Validation(loss=1.0, accuracy=0.5, samples=10),
                          Validation(loss=2.0, accuracy=1.0, samples=30), None])
    assert v == {"loss": pytest.approx(1.75), "accuracy": pytest.approx(0.875), "samples": 40, "nodes": 2}
    assert swarm_validation([None, Validation(loss=1.0, samples=0)]) is None
    huge = swarm_validation([Validation(loss=sys.float_info.max, accuracy=0.1, samples=7)] * 3)
    assert math.isfinite(huge["loss"])  # diverged nodes report the largest finite loss
    assert swarm_validation([Validation(loss=1.0, accuracy=0.5, samples=1),
                             Validation(loss=3.0, samples=1)])["accuracy"] is None  # one is a regressor


@pytest.mark.parametrize(("before", "after", "margin", "worse"), [
    ({"accuracy": 0.9, "loss": 0.3, "samples": 1000}, {"accuracy": 0.89, "loss": 0.9}, 0.02, False),  # margin
    ({"accuracy": 0.9, "loss": 0.3, "samples": 1000}, {"accuracy": 0.87, "loss": 0.2}, 0.02, True),
    # issue 26: one flipped sample of 44 (9/44 -> 8/44, a 2.3-point drop) is noise, not a regression
    ({"accuracy": 9 / 44, "loss": 0.3, "samples": 44}, {"accuracy": 8 / 44, "loss": 0.3}, 0.02, False),
    # five net samples of 44 turned wrong, and a real drop
    ({"accuracy": 9 / 44, "loss": 0.3, "samples": 44}, {"accuracy": 4 / 44, "loss": 0.3}, 0.02, True),
    ({"accuracy": 0.96, "loss": 0.3, "samples": 44}, {"accuracy": 0.5, "loss": 0.3}, 0.02, True),
    ({"accuracy": None, "loss": 1.0}, {"accuracy": None, "loss": 1.019}, 0.02, False),  # loss: relative
    ({"accuracy": None, "loss": 1.0}, {"accuracy": None, "loss": 1.03}, 0.02, True),
])
def test_regression_rule(before, after, margin, worse):
    why = regression({"before": before, "after": after}, margin)
    assert bool(why) is worse
    if why and before["accuracy"] is not None:
        assert f"on {before['samples']} samples" in why  # the reason names what it weighed
    assert regression({"before": None, "after": after}, margin) is None


def _done_round(m, val_before, val_after, version=3, nodes=("a", "b")):
    rid = m.start(RoundRequest(steps=2), online=set(nodes), known=set(nodes), now=10.0).round_id
    for n in nodes:
        m.on_event(_ev(rid, n, EventKind.DONE, step=2, params_sha256="ef" * 32, model_version=version,
                       val_before=Validation(loss=0.5, accuracy=val_before, samples=30),
                       val_after=Validation(loss=0.4, accuracy=val_after, samples=30)), 11.0)
    return rid


def test_round_reports_validation_versions_and_is_judged_once():
    m = _manager([], margin=0.02)
    rid = _done_round(m, 0.80, 0.70)
    d = m.get(rid)
    assert d["state"] == "done" and (d["version_before"], d["version_after"]) == (2, 3)
    assert d["validation"]["before"]["accuracy"] == pytest.approx(0.8)
    assert d["validation"]["after"]["accuracy"] == pytest.approx(0.7)
    assert d["nodes"]["a"]["val_after"] == {"loss": 0.4, "accuracy": 0.7, "samples": 30}
    assert "fell from 0.8000 to 0.7000" in d["regressed"]
    rnd, why = m.judge(rid)
    assert rnd.round_id == rid and why == d["regressed"]
    assert m.judge(rid) is None  # once
    good = _done_round(m, 0.80, 0.85, version=4)
    assert m.get(good)["regressed"] is None and m.judge(good) is None


# -- rollbacks --------------------------------------------------------------------------------------
def _views(**versions):
    return [{"node_id": n, "online": v is not None, "model_version": v or 0, "versions": list(range(v or 0))
             + [v or 0]} for n, v in versions.items()]


def test_rollback_checks_before_it_publishes(tmp_path):
    sent = []
    store = FleetHistory(tmp_path / "f.sqlite")
    rm = RollbackManager(swarm="s", publish=lambda t, m: sent.append((t, m)), timeout_s=5, store=store)

    def reject(req, status, text, **views):
        with pytest.raises(RoundRejected) as ei:
            rm.start(req, nodes=_views(**views), now=1.0)
        assert ei.value.status_code == status and text in ei.value.reason, ei.value.reason

    reject(RollbackRequest(nodes=["zz"]), 404, "unknown node(s): zz", a=3)
    reject(RollbackRequest(nodes=["a", "b"]), 409, "offline: b", a=3, b=None)
    reject(RollbackRequest(), 409, "every target is at v0", a=0, b=0)
    reject(RollbackRequest(to_version=2), 409, "cannot roll forward: b (v1)", a=3, b=1)
    reject(RollbackRequest(to_version=2), 409, "every target is at v2 already", a=2, b=2)
    views = _views(a=5, b=5)
    views[1]["versions"] = [4, 5]  # b keeps only its last two
    with pytest.raises(RoundRejected, match=r"v2 is no longer kept by b \(keeps v4..v5\)"):
        rm.start(RollbackRequest(to_version=2), nodes=views, now=1.0)
    assert sent == []

    # Every online node, to the version before the newest among them.
    rb = rm.start(RollbackRequest(), nodes=_views(a=5, b=4, c=None), now=2.0)
    (topic, cmd), = sent
    assert topic == topics.command("s") and isinstance(cmd, RollbackCommand)
    assert (cmd.nodes, cmd.to_version) == (["a", "b"], 4)
    assert parse_command(cmd.model_dump_json()) == cmd  # a command kind nodes parse
    assert rb.reached == {"b": 4}  # already there
    with pytest.raises(RoundRejected, match="still pending"):
        rm.start(RollbackRequest(), nodes=_views(a=5, b=5), now=2.5)
    assert rm.on_status("c", 4, 3.0) is None and rm.on_status("a", 5, 3.0) is None
    done = rm.on_status("a", 4, 3.5)
    assert done is rb and rb.state is RollbackState.DONE
    acts = store.actions(10)
    assert [a["action"] for a in acts] == ["rollback.done", "rollback"]
    assert acts[1]["detail"]["nodes"] == ["a", "b"] and acts[1]["detail"]["to_version"] == 4

    rb2 = rm.start(RollbackRequest(nodes=["a"], to_version=1), nodes=_views(a=4), now=10.0)
    assert rm.tick(14.0) is None
    failed = rm.tick(15.5)
    assert failed is rb2 and failed.state is RollbackState.FAILED and "a" in failed.reason
    assert store.actions(1)[0]["action"] == "rollback.failed"


# -- the service over a real broker -------------------------------------------------------------------
def _next_rollback(cmds, timeout=5.0) -> RollbackCommand:
    """The next RollbackCommand the fleet published (round commands before it are skipped)."""
    while True:
        cmd = parse_command(cmds.get(timeout=timeout)[1])
        if isinstance(cmd, RollbackCommand):
            return cmd


def _status_kw(version, **extra):
    return {"model_version": version, "params_sha256": f"{version:02x}" * 32,
            "versions": list(range(version + 1)), **extra}


@pytest.mark.mosquitto
def test_regressed_round_is_rolled_back_then_operator_rolls_back(make_fleet, tmp_path):
    db = tmp_path / "fleet.sqlite"
    fleet = make_fleet(db=str(db), rollback_margin=0.05, rollback_timeout_s=10)
    links = {n: fleet.announce(n, **_status_kw(1)) for n in ("a", "b")}
    cmds = collect(fleet.link("observer"), topics.command(fleet.swarm))
    fleet.wait_for(lambda: all((fleet.node(n) or {}).get("online") for n in "ab"), what="nodes online")

    # A round that costs 20 points of validation accuracy.
    rid = fleet.post("/api/rounds", json={"steps": 2}).json()["round_id"]
    for n, ln in links.items():
        fleet.event(ln, rid, n, EventKind.STEP, step=1, losses=[1.0, 0.9])
        fleet.event(ln, rid, n, EventKind.DONE, step=2, params_sha256="cd" * 32, model_version=2,
                    val_before=Validation(loss=0.4, accuracy=0.9, samples=50, model_version=1),
                    val_after=Validation(loss=0.9, accuracy=0.7, samples=50, model_version=2))
    rnd = fleet.wait_for(lambda: (r := fleet.get(f"/api/rounds/{rid}").json())["state"] == "done" and r,
                         what="round done")
    assert rnd["validation"]["after"]["accuracy"] == pytest.approx(0.7) and "fell" in rnd["regressed"]
    # The fleet sent the rollback on its own (after the round command).
    rb_cmd = _next_rollback(cmds)
    assert (rb_cmd.nodes, rb_cmd.to_version) == (["a", "b"], 1) and "fell" in rb_cmd.reason
    # A new round must wait for the rollback.
    r = fleet.post("/api/rounds", json={"steps": 2})
    assert r.status_code == 409 and "rollback" in r.json()["error"]
    # The nodes obey (their statuses say v1 again): the round is marked as rolled back.
    for n in links:
        fleet.announce(n, **_status_kw(1))
    rnd = fleet.wait_for(lambda: (r := fleet.get(f"/api/rounds/{rid}").json())["rollback"] and r,
                         what="round marked rolled back")
    assert rnd["rollback"]["by"] == "auto" and rnd["rollback"]["to_version"] == 1
    b = fleet.get(f"/api/rollback/{rb_cmd.rollback_id}").json()
    assert b["state"] == "done" and b["reached"] == {"a": 1, "b": 1}

    # The operator rolls node a back by hand; bad requests are 4xx with the reason.
    assert fleet.post("/api/rollback", json={"nodes": ["nope"]}).status_code == 404
    assert fleet.post("/api/rollback", json={"to_version": -1}).status_code == 422
    assert fleet.post("/api/rollback", json={"nodes": ["a"], "extra": 1}).status_code == 422
    r = fleet.post("/api/rollback", json={"nodes": ["a"], "to_version": 5})
    assert r.status_code == 409 and "cannot roll forward" in r.json()["error"]
    r = fleet.post("/api/rollback", json={"nodes": ["a"]})
    assert r.status_code == 202, r.text
    body = r.json()
    assert (body["nodes"], body["to_version"], body["by"], body["state"]) == (["a"], 0, "operator", "pending")
    fleet.announce("a", **_status_kw(0))
    fleet.wait_for(lambda: fleet.get(f"/api/rollback/{body['rollback_id']}").json()["state"] == "done",
                   what="operator rollback done")
    # The status thread marks the rollback done under the manager's lock, then records its
    # rollback.done action (a write after the lock): a read in between sees done without it.
    def actions_now() -> list[str]:
        return [a["action"] for a in fleet.get("/api/actions").json()["actions"]]

    actions = fleet.wait_for(lambda: (acts := actions_now()).count("rollback.done") == 2 and acts,
                             what="the operator rollback's rollback.done action")
    assert actions == ["rollback.done", "rollback", "rollback.done", "rollback", "start_round"]

    # A fleet restarted on the same database shows the same history.
    again = make_fleet(swarm=fleet.swarm, db=str(db))
    hist = again.get("/api/rounds").json()["rounds"]
    assert hist[0]["round_id"] == rid and hist[0]["rollback"]["by"] == "auto"
    assert [a["action"] for a in again.get("/api/actions").json()["actions"]] == actions


@pytest.mark.mosquitto
def test_good_round_is_not_rolled_back_and_node_facts_pass_through(fleet):
    from federation.messages import ArtifactInfo, NodeHealth

    art = ArtifactInfo(model="digits-mlp", target="x86_64-avx2", tuned=True, tvm_version="0.19.0")
    health = NodeHealth(uptime_s=12.5, cpu_percent=3.0, mem_rss_bytes=100 << 20, mem_percent=1.5,
                        disk_free_bytes=5 << 30)
    links = {n: fleet.announce(n, state=NodeState.ONLINE, artifact=art, health=health, samples_train=80,
                               samples_val=20, **_status_kw(1)) for n in ("a", "b")}
    node = fleet.wait_for(lambda: (n := fleet.node("a")) and n["online"] and n, what="node a")
    assert node["artifact"] == art.model_dump() and node["health"]["disk_free_bytes"] == 5 << 30
    assert (node["samples_train"], node["samples_val"], node["versions"]) == (80, 20, [0, 1])
    rid = fleet.post("/api/rounds", json={"steps": 1}).json()["round_id"]
    for n, ln in links.items():
        fleet.event(ln, rid, n, EventKind.DONE, step=1, params_sha256="cd" * 32, model_version=2,
                    val_before=Validation(loss=0.4, accuracy=0.8, samples=20),
                    val_after=Validation(loss=0.3, accuracy=0.85, samples=20))
    rnd = fleet.wait_for(lambda: (r := fleet.get(f"/api/rounds/{rid}").json())["state"] == "done" and r,
                         what="round done")
    assert rnd["regressed"] is None and rnd["rollback"] is None
    assert [a["action"] for a in fleet.get("/api/actions").json()["actions"]] == ["start_round"]
