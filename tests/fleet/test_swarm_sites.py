"""`fractal swarm --nodes 4 --sites 2` as a subprocess: two site Mosquittos bridged to a backbone
(deploy/sites.py), the fleet on the backbone sees every node with its site, and a round it starts
runs hierarchically (its command names the sites) and ends done with agreeing parameters."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from federation.broker import free_port
from tests.fleet.swarm_proc import FRACTAL, assert_no_orphans, start_swarm

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]


def test_swarm_on_two_bridged_sites_runs_a_hierarchical_round(tmp_path_factory):
    sp = start_swarm(4, tmp_path_factory.getbasetemp() / "swarm-cache", "sites-token", timeout=400,
                     extra=("--sites", "2"))
    try:
        children = sp.descendants()
        assert sum("mosquitto" in p.name() for p in children) == 3, [p.name() for p in children]
        with httpx.Client(headers={"Authorization": "Bearer sites-token"}, timeout=10) as c:
            deadline = time.monotonic() + 120
            while True:
                nodes = c.get(sp.base + "/api/nodes").json()["nodes"]
                if len(nodes) == 4 and all(n["online"] and n["samples"] >= 64 for n in nodes):
                    break
                assert time.monotonic() < deadline, nodes
                time.sleep(0.5)
            assert {n["node_id"]: n["site"] for n in nodes} == {
                "node-1": "site-1", "node-2": "site-1", "node-3": "site-2", "node-4": "site-2"}
            r = c.post(sp.base + "/api/rounds", json={"steps": 10, "lr": 0.1})
            assert r.status_code == 201, r.text
            rid = r.json()["round_id"]
            deadline = time.monotonic() + 180
            while (rnd := c.get(f"{sp.base}/api/rounds/{rid}").json())["state"] == "running":
                assert time.monotonic() < deadline, rnd
                time.sleep(0.5)
        assert rnd["sites"] == {"site-1": ["node-1", "node-2"], "site-2": ["node-3", "node-4"]}
        assert rnd["state"] == "done", rnd.get("reason")
        assert rnd["params_agree"] is True
    finally:
        assert sp.interrupt() in (0, 130), sp.output()
    assert_no_orphans(children)


def test_more_sites_than_nodes_is_one_line(tmp_path):
    proc = subprocess.run([FRACTAL, "swarm", "--nodes", "2", "--sites", "3", "--port", str(free_port()),
                           "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: --sites 3 is more than --nodes 2 (help: every site needs a node)"]
