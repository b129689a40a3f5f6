"""`fractal swarm --nodes 2` as a subprocess: URL printed, dashboard reachable, nodes online,
SIGINT stops everything (nodes, broker) with no orphan process left."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from tests.fleet.swarm_proc import start_swarm

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]


def test_swarm_two_nodes_up_and_clean_shutdown(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "swarm-cache"
    sp = start_swarm(2, cache, "e2e-token")
    try:
        assert sp.url == f"{sp.base}/?token=e2e-token"
        assert "token:     e2e-token" in sp.output()
        with httpx.Client(timeout=10, follow_redirects=True) as c:
            page = c.get(sp.url)  # ?token= logs in (cookie) and lands on the dashboard
            assert page.status_code == 200 and 'id="loss-plot"' in page.text
            assert c.get(sp.base + "/api/nodes", headers={"Authorization": "Bearer nope"}).status_code == 401
            deadline = time.monotonic() + 30
            while True:
                nodes = c.get(sp.base + "/api/nodes").json()["nodes"]
                if len(nodes) == 2 and all(n["online"] and n["samples"] > 0 for n in nodes):
                    break
                assert time.monotonic() < deadline, nodes
                time.sleep(0.5)
        assert [n["model"] for n in nodes] == ["digits-mlp"] * 2
        assert len({n["params_sha256"] for n in nodes}) == 1  # same initial parameters everywhere
        children = sp.descendants()
        names = sorted(p.name() for p in children)
        assert sum("mosquitto" in n for n in names) == 1 and len(children) >= 3, names
    finally:
        code = sp.interrupt()
    assert code in (0, 130), sp.output()
    assert "[swarm] stopped" in sp.output()
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"orphans left behind: {[(p.pid, p.name()) for p in alive]}"
