"""Durable fleet state: rounds, their metrics and the operator's actions survive a fleet restart
(real SQLite file and real PostgreSQL server, real fleet service + Mosquitto); history is paged."""

from __future__ import annotations

import json

import pytest

from api.fleet.history import RESTARTED, FleetHistory
from api.fleet.rounds import RoundManager, RoundRequest
from federation.messages import EventKind, RoundEvent


def _event(rid, node, kind, **kw):
    return RoundEvent(kind=kind, round_id=rid, node_id=node, **kw)


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path) -> dict[str, str]:
    """The fleet's database as settings: a SQLite file, or a fresh database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return {"db": str(tmp_path / "fleet.sqlite")}
    return {"database": request.getfixturevalue("pg_url")}


def test_store_pages_and_closes_interrupted_rounds(store):
    db = next(iter(store.values()))
    store = FleetHistory(db)
    m = RoundManager(swarm="s", publish=lambda t, msg: None, start_timeout_s=5, idle_timeout_s=5, store=store)
    rids = []
    for i in range(5):
        rnd = m.start(RoundRequest(steps=3), online={"a", "b"}, known={"a", "b"}, now=100.0 + i)
        rids.append(rnd.round_id)
        if i < 4:  # the last one stays running
            for node in ("a", "b"):
                m.on_event(_event(rnd.round_id, node, EventKind.STEP, step=0, loss=2.0 - i / 10), 101.0 + i)
                m.on_event(_event(rnd.round_id, node, EventKind.DONE, step=3, params_sha256="cd" * 32,
                                  model_version=i + 2), 101.5 + i)
    store.close()

    again = FleetHistory(db)  # a new process
    assert again.close_interrupted(now=500.0) == [rids[4]]
    m2 = RoundManager(swarm="s", publish=lambda t, msg: None, start_timeout_s=5, idle_timeout_s=5,
                      store=again)
    page1 = m2.history(limit=2)
    assert [r["round_id"] for r in page1] == [rids[4], rids[3]]
    assert page1[0]["state"] == "failed" and page1[0]["reason"] == RESTARTED
    assert page1[1]["state"] == "done" and page1[1]["params_agree"] is True
    assert page1[1]["loss"][0]["mean"] == 2.0 - 3 / 10  # metrics survive, not only the state
    page2 = m2.history(limit=2, before=page1[-1]["started_at"])
    page3 = m2.history(limit=2, before=page2[-1]["started_at"])
    assert [r["round_id"] for r in page2 + page3] == [rids[2], rids[1], rids[0]]
    assert m2.get(rids[0])["state"] == "done"
    again.close()


def test_fleet_restart_keeps_history_and_actions(make_fleet, store):
    from federation.messages import NodeState

    fleet = make_fleet(**store)
    fleet.wait_for(lambda: fleet.service.leading, what="the fleet leads")  # PostgreSQL: it wins the lock
    links = {n: fleet.announce(n, NodeState.ONLINE) for n in ("node-a", "node-b")}
    fleet.wait_for(lambda: all(fleet.node(n) and fleet.node(n)["online"] for n in links), what="nodes online")
    rid = fleet.post("/api/rounds", json={"steps": 2, "lr": 0.05}).json()["round_id"]
    for n, ln in links.items():
        fleet.event(ln, rid, n, EventKind.STEP, step=1, loss=1.5)
        fleet.event(ln, rid, n, EventKind.DONE, step=2, params_sha256="ef" * 32, model_version=2)
    fleet.wait_for(lambda: fleet.get(f"/api/rounds/{rid}").json()["state"] == "done", what="round done")
    fleet.service.stop()  # the first fleet process goes away

    second = make_fleet(swarm=fleet.swarm, **store)
    body = second.get("/api/rounds", params={"limit": 10}).json()
    assert [r["round_id"] for r in body["rounds"]] == [rid] and body["next_before"] is None
    got = second.get(f"/api/rounds/{rid}").json()
    assert got["state"] == "done" and got["lr"] == 0.05 and got["loss"][0]["mean"] == 1.5
    actions = [a for a in second.get("/api/actions").json()["actions"] if a["action"] != "fleet.lead"]
    assert actions[0]["action"] == "start_round" and actions[0]["detail"]["round_id"] == rid
    assert second.get("/api/rounds", params={"limit": 0}).status_code == 422
    assert second.get("/api/rounds", params={"before": "nan"}).status_code == 422
    json.dumps(body, allow_nan=False)  # standard JSON only
