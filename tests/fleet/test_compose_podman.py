"""docker-compose.yml for real, under Podman: the broker, PostgreSQL, three nodes and the fleet from
the compose file (with deploy/compose/podman.yml: the image deploy/podman_image.py builds from Debian
packages), a training round through the fleet API to ``done``, the round in the fleet's PostgreSQL
database (read with psql in the postgres container), inference on every node over HTTP; then the
standby fleet (``--profile standby``) takes the lead when the fleet restarts, the restarted fleet
lists the round from the database and takes the lead back when the standby is SIGKILLed; then
``down -v`` and nothing of the project left (containers, volumes, pod).

The services share one network namespace the test creates (``FRACTAL_PODMAN_NETWORK``), so the
compose file's fixed ports (1883, 8080-8083) never meet the host's; this process reaches them
from a thread inside it (harness.netns.enter_netns). The image is rebuilt only when its inputs
change (about 90 s cold on a 2-core machine; a label lookup otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest

from deploy.podman_image import build_image, podman_env
from deploy.sensors import digits_shards
from harness.netns import enter_netns

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
PODMAN_COMPOSE = str(Path(sys.executable).parent / "podman-compose")  # the venv's (pyproject dev)
TOKEN = "compose-test-token"
PG_PASSWORD = "compose-test-pg"
NODES = {"node-1": 8081, "node-2": 8082, "node-3": 8083}
_PREFIX = "fxcompose"

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, env=env or podman_env(), timeout=timeout,
                       cwd=ROOT, check=False)
    assert r.returncode == 0, f"{' '.join(argv[:4])}...: {r.stderr[-2000:]}"
    return r.stdout


def _project_objects(project: str) -> dict[str, list[str]]:
    only = ["--filter", f"label=io.podman.compose.project={project}"]
    return {
        "containers": _run(["podman", "ps", "-a", *only, "--format", "{{.Names}}"]).split(),
        "volumes": _run(["podman", "volume", "ls", *only, "--format", "{{.Name}}"]).split(),
        "pods": [p for p in _run(["podman", "pod", "ls", "--format", "{{.Name}}"]).split() if project in p],
    }


def _sweep_stale() -> None:
    """Remove what a killed earlier run (its pid gone) left: its containers, volumes and namespace."""
    fmt = ["--format", '{{index .Labels "io.podman.compose.project"}}']
    names = _run(["podman", "ps", "-a", *fmt]).split() + _run(["podman", "volume", "ls", *fmt]).split()
    names += re.findall(rf"^({_PREFIX}-\d+)", _run(["ip", "netns", "list"]), flags=re.M)
    for project in sorted(set(names)):
        m = re.fullmatch(rf"{_PREFIX}-(\d+)", project)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            objs = _project_objects(project)
            if objs["containers"]:
                _run(["podman", "rm", "-f", *objs["containers"]])
            if objs["volumes"]:
                _run(["podman", "volume", "rm", "-f", *objs["volumes"]])
            subprocess.run(["ip", "netns", "delete", project], capture_output=True, timeout=30, check=False)


class Netns:
    """One network namespace (loopback only) and a way to run code in it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> Netns:
        _run(["ip", "netns", "add", self.name])
        _run(["ip", "-n", self.name, "link", "set", "lo", "up"])
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True, timeout=30, check=False)

    def call(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        box: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                enter_netns(self.name)
                box.append((True, fn()))
            except BaseException as exc:  # re-raised in the caller
                box.append((False, exc))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        assert box, f"{fn!r} did not return within {timeout}s"
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]


def _wait(cond: Callable[[], Any], timeout: float, what: str, diag: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout:g} s\n{diag()}")
        time.sleep(0.25)  # polling the API's state between requests


def _files(project: str) -> list[str]:
    """podman-compose's arguments: the compose file, the override, the project; with the standby fleet."""
    return ["-f", "docker-compose.yml", "-f", "deploy/compose/podman.yml", "-p", project,
            "--profile", "standby"]


@pytest.fixture(scope="module")
def compose_image() -> tuple[bool, float]:
    return build_image()


@pytest.fixture
def compose_up(compose_image: tuple[bool, float]) -> Iterator[tuple[Netns, str, float, dict[str, str]]]:
    _sweep_stale()
    project = f"{_PREFIX}-{os.getpid()}"
    files = _files(project)
    with Netns(project) as ns:
        env = {**podman_env(), "FRACTAL_FLEET_TOKEN": TOKEN, "FRACTAL_POSTGRES_PASSWORD": PG_PASSWORD,
               "FRACTAL_PODMAN_NETWORK": f"ns:/run/netns/{ns.name}"}
        t0 = time.monotonic()
        try:
            _run([PODMAN_COMPOSE, *files, "up", "-d", "--no-build"], env)
            yield ns, project, t0, env
        finally:
            _run([PODMAN_COMPOSE, *files, "down", "-v"], env)
        left = _project_objects(project)
        assert left == {"containers": [], "volumes": [], "pods": []}, f"left after down -v: {left}"


def test_compose_round_and_inference_under_podman(compose_up: tuple[Netns, str, float, dict[str, str]],
                                                  compose_image: tuple[bool, float]) -> None:
    ns, project, t0, env = compose_up
    fleet = httpx.Client(base_url="http://127.0.0.1:8080", headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=10)
    nodes = {n: httpx.Client(base_url=f"http://127.0.0.1:{p}", timeout=10) for n, p in NODES.items()}

    def logs() -> str:
        out = []
        for svc in ("mosquitto", "postgres", "fleet", "fleet-standby", *NODES):
            r = subprocess.run(["podman", "logs", "--tail", "15", f"{project}_{svc}_1"], capture_output=True,
                               text=True, env=podman_env(), timeout=30, check=False)
            out.append(f"== {svc}\n{r.stdout}{r.stderr}")
        return "\n".join(out)

    def get(client: httpx.Client, path: str) -> Any:
        def go() -> Any:
            try:
                r = client.get(path)
            except httpx.HTTPError:
                return None
            return r.json() if r.status_code == 200 else None
        return ns.call(go)

    def node_table() -> dict[str, dict]:
        body = get(fleet, "/api/nodes") or {"nodes": []}
        return {n["node_id"]: n for n in body["nodes"]}

    _wait(lambda: all(node_table().get(n, {}).get("state") == "online" for n in NODES), 180,
          "the three nodes online in the fleet API", logs)
    online_s = time.monotonic() - t0

    # what the feeder does on Docker: each node gets its own non-IID digits shard
    shards = digits_shards(3)
    for (name, client), shard in zip(nodes.items(), shards, strict=True):
        body = {"inputs": {"x": shard.x[:96].tolist()}, "labels": shard.y[:96].tolist()}
        status = ns.call(lambda c=client, b=body: c.post("/v1/samples", json=b).status_code)
        assert status in (200, 201, 202), (name, status)
    _wait(lambda: all(node_table()[n]["samples"] >= 96 for n in NODES), 60, "samples in the node table", logs)
    before = {n: s["params_sha256"] for n, s in node_table().items()}

    r = ns.call(lambda: fleet.post("/api/rounds", json={"steps": 2}))
    assert r.status_code == 201, r.text
    round_id = r.json()["round_id"]
    assert sorted(r.json()["participants"]) == sorted(NODES)
    def decided() -> dict | None:
        view = get(fleet, f"/api/rounds/{round_id}")
        return view if view and view["state"] != "running" else None

    rnd = _wait(decided, 180, f"round {round_id} decided", logs)
    round_s = time.monotonic() - t0
    assert rnd["state"] == "done", rnd

    # the fleet keeps its history in the postgres service's database, and leads there
    assert get(fleet, "/api/health")["role"] == "leader"

    def stored_state() -> str:
        sql = f"SELECT state FROM rounds WHERE round_id = '{round_id}'"  # an id the fleet made
        return _run(["podman", "exec", f"{project}_postgres_1", "psql", "-U", "fractal", "-d", "fractal",
                     "-tAc", sql]).strip()

    _wait(lambda: stored_state() == "done", 30, "the round done in PostgreSQL", logs)
    # the compose file's healthcheck (pg_isready: what Docker waits on before starting the fleet)
    _run(["podman", "healthcheck", "run", f"{project}_postgres_1"])

    # every node committed the same new parameters
    def committed() -> dict[str, dict] | None:
        t = node_table()
        return t if all(t[n]["model_version"] >= 1 for n in NODES) else None

    table = _wait(committed, 60, "model version 1 on every node", logs)
    shas = {table[n]["params_sha256"] for n in NODES}
    assert len(shas) == 1 and shas.isdisjoint(before.values()), (before, shas)

    # inference over HTTP (Open Inference Protocol v2): same parameters, same logits on every node
    x = shards[0].x[:4].astype(np.float32)
    req = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    outs = {}
    for name, client in nodes.items():
        resp = ns.call(lambda c=client: c.post("/v2/models/digits-mlp/infer", json=req))
        assert resp.status_code == 200, resp.text
        out = resp.json()["outputs"][0]
        assert out["shape"] == [4, 10]
        outs[name] = np.asarray(out["data"], dtype=np.float32)
    assert all(np.array_equal(outs["node-1"], o) for o in outs.values())

    # Two fleet processes on the one database: the standby follows and reads the same history.
    standby = httpx.Client(base_url="http://127.0.0.1:8090", headers=fleet.headers, timeout=10)

    def role(client: httpx.Client) -> str | None:
        health = get(client, "/api/health")
        return health["role"] if health else None

    def listed(client: httpx.Client) -> dict | None:
        body = get(client, "/api/rounds")
        return body and next((r for r in body["rounds"] if r["round_id"] == round_id), None)

    _wait(lambda: role(standby) == "follower", 60, "the standby fleet following", logs)
    assert (listed(standby) or {}).get("state") == "done"
    # A restarted fleet hands the lead over (its session closes): the standby leads, and the
    # restarted process follows and reads the round back from PostgreSQL, done.
    t_restart = time.monotonic()
    _run([PODMAN_COMPOSE, *_files(project), "restart", "fleet"], env)
    _wait(lambda: role(standby) == "leader", 60, "the standby leading after the fleet's restart", logs)
    handover_s = time.monotonic() - t_restart
    again = _wait(lambda: role(fleet) == "follower" and listed(fleet), 90,
                  f"round {round_id} listed by the restarted fleet", logs)
    assert again["state"] == "done", again
    # SIGKILL the leader: PostgreSQL ends its session, and the other fleet process takes the lead.
    t_kill = time.monotonic()
    _run(["podman", "kill", "--signal", "KILL", f"{project}_fleet-standby_1"])
    _wait(lambda: role(fleet) == "leader", 60, "the fleet leading after the standby was killed", logs)
    takeover_s = time.monotonic() - t_kill
    assert (listed(fleet) or {}).get("state") == "done"
    built, build_s = compose_image
    print(f"\ncompose under podman: image {'built' if built else 'cached'} in {build_s:.1f} s, "
          f"nodes online {online_s:.1f} s, round done {round_s:.1f} s after `up`, "
          f"lead handed over on the fleet's restart in {handover_s:.1f} s, "
          f"taken over after SIGKILL in {takeover_s:.1f} s")
