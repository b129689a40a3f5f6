"""Two fleet processes on one PostgreSQL and one Mosquitto (real servers): one leads, the other
serves reads and refuses writes with the leader's address; SIGKILL of the leader mid-round hands
the lead to the other, which fails the orphaned round with a reason (never left running) and
runs the next round; a leader whose lock session ends stops (fail-stop)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time

import httpx
import psycopg
import pytest

from api.fleet.service import TAKEN_OVER
from federation import topics
from federation.broker import free_port
from federation.messages import NodeState, RoundAbort, parse_command
from tests.fixtures_enrolment import wait_for as _wait_for
from tests.fleet.conftest import TOKEN, collect
from tests.fleet.sim_nodes import SimSwarm
from tests.fleet.swarm_proc import FRACTAL

pytestmark = pytest.mark.mosquitto

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def wait_for(pred, timeout: float, what: str):
    """tests.fixtures_enrolment.wait_for at 50 ms (the failover figures are polled with it)."""
    return _wait_for(pred, timeout, what, poll_s=0.05)


def test_follower_serves_reads_and_refuses_writes(make_fleet, pg_url):
    leader = make_fleet(database=pg_url)
    leader.wait_for(lambda: leader.service.leading, what="the first fleet leads")
    follower = make_fleet(swarm=leader.swarm, database=pg_url)
    assert follower.get("/api/health").json()["role"] == "follower"
    assert leader.get("/api/health").json()["role"] == "leader"
    links = {n: leader.announce(n, NodeState.ONLINE) for n in ("node-a", "node-b")}
    for f in (leader, follower):  # both follow the statuses on the broker
        f.wait_for(lambda f=f: all(f.node(n) and f.node(n)["online"] for n in links), what="nodes online")

    r = follower.post("/api/rounds", json={"steps": 2})
    assert r.status_code == 503, r.text
    assert r.json()["leader"] == leader.service.my_url() == r.headers["x-fractal-leader"]
    assert "follows" in r.json()["error"]
    assert follower.client.put("/api/auto-rounds", json={}).status_code == 503
    policy = {"enabled": True, "samples": {"enabled": True, "threshold": 400}}  # set at the leader: shown
    assert leader.client.put("/api/auto-rounds", json=policy).status_code == 200
    assert follower.get("/api/auto-rounds").json()["policy"]["samples"]["threshold"] == 400
    assert follower.post("/api/nodes/node-a/readmit").status_code == 503
    assert follower.post("/api/login", json={"token": TOKEN}).status_code == 200  # not a change

    assert follower.get("/").status_code == 200  # the dashboard, which says whom it follows
    snap = follower.service.snapshot()
    assert snap["role"] == "follower" and snap["leader"] == leader.service.my_url()
    assert leader.service.snapshot()["role"] == "leader"
    # A round the leader runs shows on the follower, from the shared database, on its API and its
    # event stream (the dashboard's source).
    from api.fleet.events import EventType
    from federation.messages import EventKind

    bus, seen = follower.service.bus, []
    publish = bus.publish
    bus.publish = lambda kind, data: (seen.append((kind, data)), publish(kind, data))[1]
    rid = leader.post("/api/rounds", json={"steps": 2, "lr": 0.05}).json()["round_id"]
    follower.wait_for(lambda: follower.get(f"/api/rounds/{rid}").status_code == 200, what="round on follower")
    assert follower.get(f"/api/rounds/{rid}").json()["state"] == "running"
    for n, ln in links.items():
        leader.event(ln, rid, n, EventKind.DONE, step=2, params_sha256="ef" * 32, model_version=2)
    follower.wait_for(lambda: follower.get(f"/api/rounds/{rid}").json()["state"] == "done", what="done")
    follower.wait_for(lambda: any(k is EventType.ROUND and d["round_id"] == rid and d["state"] == "done"
                                  for k, d in seen), what="the done round on the follower's event stream")
    acts = follower.get("/api/actions").json()["actions"]
    assert any(a["action"] == "start_round" and a["detail"]["round_id"] == rid for a in acts)


class FleetProc:
    """``fractal fleet --database URL`` as a real process."""

    def __init__(self, broker_url: str, swarm: str, database: str, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "FRACTAL_FLEET_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [FRACTAL, "fleet", "--broker", broker_url, "--port", str(self.port), "--swarm", swarm,
             "--database", database, *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            self.lines.put(line)

    def ready(self) -> None:
        """Wait for the dashboard line (log lines about the leadership may come first)."""
        deadline = time.monotonic() + 60
        while self.lines.get(timeout=max(0.1, deadline - time.monotonic())).strip() \
                != f"fleet dashboard: {self.base}/":
            assert self.proc.poll() is None and time.monotonic() < deadline, "\n".join(self.output)

    def role(self) -> str | None:
        try:
            return httpx.get(self.base + "/api/health", timeout=5).json()["role"]
        except httpx.HTTPError:
            return None

    def round(self, rid: str) -> dict:
        return httpx.get(f"{self.base}/api/rounds/{rid}", headers=AUTH, timeout=5).json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_leader_killed_mid_round_hands_over(broker, postgres, pg_url, swarm_id, mqtt_link_factory):
    watcher = mqtt_link_factory(broker, "watcher")
    commands = collect(watcher, topics.command(swarm_id))
    a = FleetProc(broker.url, swarm_id, pg_url)
    procs = [a]
    sim = None
    try:
        a.ready()
        wait_for(lambda: a.role() == "leader", 30, "the first fleet process leads")
        b = FleetProc(broker.url, swarm_id, pg_url)
        procs.append(b)
        b.ready()
        assert b.role() == "follower"
        # Nodes whose round lasts long enough for the leader to die in the middle of it.
        sim = SimSwarm(broker.url, swarm_id, ["sim-1", "sim-2"], round_s=4.0)
        nodes = lambda: httpx.get(a.base + "/api/nodes", headers=AUTH, timeout=5).json()["nodes"]  # noqa: E731
        wait_for(lambda: sum(n["online"] for n in nodes()) == 2, 30, "nodes online at the leader")
        r = httpx.post(a.base + "/api/rounds", json={"steps": 6}, headers=AUTH, timeout=10)
        assert r.status_code == 201, r.text
        rid = r.json()["round_id"]
        wait_for(lambda: b.round(rid).get("state") == "running", 30, "the running round at the follower")

        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        wait_for(lambda: b.role() == "leader", 30, "the follower takes the lead")
        got = wait_for(lambda: (d := b.round(rid))["state"] != "running" and d, 30, "the round closed")
        failover_s = time.monotonic() - t0
        print(f"\nfleet failover: leader SIGKILLed -> round {got['state']} at the new leader "
              f"in {failover_s:.2f} s")
        assert got["state"] == "failed", got
        assert got["reason"].startswith(TAKEN_OVER.split("{")[0]), got["reason"]
        assert failover_s < 10, failover_s  # the lock check every 0.5 s, plus the takeover
        # the nodes were told to stop the round
        wait_for(lambda: any(isinstance(c := parse_command(p), RoundAbort) and c.round_id == rid
                             for _, p in _drain(commands)), 10, "the abort of the round")
        # the history is intact: the round's start and the takeover are in the operator's log
        acts = httpx.get(b.base + "/api/actions", headers=AUTH, timeout=5).json()["actions"]
        kinds = [x["action"] for x in acts]
        assert kinds.index("fleet.lead") < kinds.index("start_round"), kinds  # newest first
        lead = next(x for x in acts if x["action"] == "fleet.lead")
        assert rid in lead["detail"]["failed_rounds"]

        # The new leader runs the next round once the nodes are idle again.
        sim.round_s = 0.3
        nodes_b = lambda: httpx.get(b.base + "/api/nodes", headers=AUTH, timeout=5).json()["nodes"]  # noqa: E731
        wait_for(lambda: all(n["state"] == "online" for n in nodes_b()) and len(nodes_b()) == 2, 30, "idle")
        r = httpx.post(b.base + "/api/rounds", json={"steps": 3}, headers=AUTH, timeout=10)
        assert r.status_code == 201, r.text
        rid2 = r.json()["round_id"]
        wait_for(lambda: b.round(rid2)["state"] == "done", 30, "the next round done")

        # Fail-stop: a leader whose lock session ends stops acting and exits with one error line.
        with psycopg.connect(postgres.url(), autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE application_name = 'fractal-fleet-leadership'")
        assert b.proc.wait(30) == 1
        assert any("this fleet process stopped leading" in line for line in b.output), b.output
    finally:
        if sim is not None:
            sim.close()
        for p in procs:
            p.close()


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


@pytest.mark.parametrize("args, expected", [
    (["--database", "mysql://x/y"],
     "error: invalid setting database: Value error, must be a postgresql:// URL"),
    (["--db", "f.sqlite", "--database", "postgresql://u@h/d"],
     "error: --db (a SQLite file) and --database (PostgreSQL) exclude each other (help: pass one of them)"),
    (["--database", "postgresql://fractal:secret@127.0.0.1:{port}/nothing"],  # the password is not shown
     "error: cannot open the fleet database postgresql://fractal:***@127.0.0.1:{port}/nothing: "),
])
def test_fleet_cli_bad_database_is_one_line(tmp_path, args, expected):
    port = free_port()  # nothing listens there
    args = [a.format(port=port) for a in args]
    proc = subprocess.run([FRACTAL, "fleet", "--broker", "mqtt://127.0.0.1:1", "--token", "t",
                           "--port", str(free_port()), *args], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(port=port)), lines


def test_database_outage_is_503_and_the_leader_stops_leading(make_fleet):
    """PostgreSQL going away: reads answer 503 (not a 500); the leader's lock session ends, so it
    stops leading (its process would exit: fail-stop)."""
    from tests.fixtures_postgres import start_postgres

    server = start_postgres()  # its own server: this test stops it
    try:
        url = server.create_database()
        leader = make_fleet(database=url)
        leader.wait_for(lambda: leader.service.leading, what="the fleet leads")
        lost: list[str] = []
        leader.service.on_lost_lead = lost.append
        follower = make_fleet(swarm=leader.swarm, database=url)
        assert follower.get("/api/rounds").status_code == 200
        server.close()
        leader.wait_for(lambda: lost, what="the leader losing its lock session")
        assert not leader.service.leading and "leadership session" in lost[0]
        r = follower.get("/api/rounds")
        assert r.status_code == 503 and "fleet database" in r.json()["error"], r.text
        assert leader.post("/api/rounds", json={"steps": 2}).status_code == 503  # it no longer leads
    finally:
        server.close()
