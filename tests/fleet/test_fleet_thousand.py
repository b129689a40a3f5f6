"""A thousand node statuses through the fleet (issue 28 item 3): the registry, GET /api/nodes, the
event stream's snapshot and a node event, and the dashboard's paged node table in a real headless
Chromium. The statuses are real retained MQTT messages on a real Mosquitto (one connection
publishes them all, as a bridge from many sites would deliver them). Times are printed (the
figures in BENCHMARKS.md "scale"), never asserted."""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest

from federation import topics
from federation.messages import NodeState, NodeStatus
from tests.fixtures_browser import CHROMIUM_ARGS
from tests.fleet.conftest import TOKEN

pytestmark = [pytest.mark.mosquitto]

N = 1000


def _status(i: int, version: int = 1) -> NodeStatus:
    return NodeStatus(node_id=f"n{i:04d}", state=NodeState.ONLINE, arch="x86_64", board="x86_64",
                      model="digits-mlp", model_version=version, params_sha256=f"{version:064x}", samples=100,
                      site=f"site-{i // 16}", keepalive_s=600.0)  # no heartbeats follow


@pytest.fixture
def fleet1000(make_fleet):
    fleet = make_fleet()
    link = fleet.link("bridge")
    t0 = time.monotonic()
    pubs = [link.publish(topics.status(fleet.swarm, f"n{i:04d}"), _status(i), retain=True) for i in range(N)]
    for p in pubs:
        p.wait_for_publish(30)
    fleet.wait_for(lambda: len(fleet.get("/api/nodes").json()["nodes"]) == N, timeout=60,
                   what=f"{N} nodes in the registry")
    print(f"\n{N} statuses published and registered in {time.monotonic() - t0:.2f} s")
    return fleet, link


def test_a_thousand_statuses_through_the_registry_api_and_event_stream(fleet1000) -> None:
    fleet, link = fleet1000
    times, size = [], 0
    for _ in range(7):
        t0 = time.perf_counter()
        r = fleet.get("/api/nodes")
        times.append(time.perf_counter() - t0)
        size = len(r.content)
    nodes = r.json()["nodes"]
    assert [n["node_id"] for n in nodes] == [f"n{i:04d}" for i in range(N)]
    assert all(n["online"] and n["site"] == f"site-{i // 16}" for i, n in enumerate(nodes))
    print(f"GET /api/nodes with {N} nodes: median {1000 * statistics.median(times):.1f} ms "
          f"(min {1000 * min(times):.1f}, max {1000 * max(times):.1f}), {size / 1024:.0f} KiB")

    # The event stream: a snapshot of every node, then one node's change as one small event.
    with httpx.Client(base_url=fleet.url, timeout=30) as c, \
            c.stream("GET", "/api/events", params={"token": TOKEN}) as s:
        t0 = time.perf_counter()
        lines = s.iter_lines()
        kind, data = _next_event(lines)
        snap_s = time.perf_counter() - t0
        assert kind == "snapshot"
        snap_bytes, snap = data, json.loads(data)
        assert len(snap["nodes"]) == N
        link.publish(topics.status(fleet.swarm, "n0500"), _status(500, version=2),
                     retain=True).wait_for_publish(5)
        while True:
            kind, data = _next_event(lines)
            if kind == "node" and json.loads(data)["node_id"] == "n0500":
                break
        assert json.loads(data)["model_version"] == 2
        print(f"event stream: snapshot of {N} nodes in {1000 * snap_s:.0f} ms "
              f"({len(snap_bytes) / 1024:.0f} KiB), then one node event of {len(data)} bytes")


def _next_event(lines) -> tuple[str, str]:
    kind, data = "", ""
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and kind:
            return kind, data
    raise AssertionError("the event stream ended")


def _rows(page, n: int) -> None:
    page.wait_for_function(f"document.querySelectorAll('#nodes tbody tr').length === {n}", timeout=5_000)


@pytest.mark.browser
def test_the_dashboard_pages_a_thousand_nodes(fleet1000) -> None:
    from playwright.sync_api import sync_playwright

    fleet, link = fleet1000
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            t0 = time.perf_counter()
            page.goto(f"{fleet.url}/?token={TOKEN}")
            page.wait_for_selector("#live.on", timeout=20_000)
            rows = page.locator("#nodes tbody tr")
            page.wait_for_function("document.querySelectorAll('#nodes tbody tr').length > 0", timeout=20_000)
            shown_ms = 1000 * (time.perf_counter() - t0)
            print(f"\ndashboard: first page of {N} nodes shown {shown_ms:.0f} ms after navigation")
            assert rows.count() == 50
            render_ms = page.evaluate("() => { const t = performance.now(); for (let i = 0; i < 10; i++) "
                                      "renderNodes(); return (performance.now() - t) / 10; }")
            print(f"dashboard: one re-render after a heartbeat (a page of the table; the checkbox lists are "
                  f"unchanged) with {N} nodes: {render_ms:.1f} ms")
            assert page.inner_text("#node-count") == f"{N} online / {N}"
            assert page.inner_text("#node-range") == f"1–50 of {N}"
            assert rows.first.get_attribute("data-node-id") == "n0000"
            page.click("#nodes-next")
            page.wait_for_selector("#nodes tbody tr[data-node-id=n0050]", timeout=5_000)
            assert page.inner_text("#node-range") == f"51–100 of {N}"
            # A node event re-renders the page shown, and the operator stays on it.
            link.publish(topics.status(fleet.swarm, "n0060"), _status(60, version=7),
                         retain=True).wait_for_publish(5)
            page.wait_for_selector("#nodes tbody tr[data-node-id=n0060][data-version='7']", timeout=10_000)
            assert page.inner_text("#node-range") == f"51–100 of {N}"
            # The filter finds one node of the thousand (by id, state or site).
            page.fill("#node-filter", "n0999")
            page.wait_for_selector("#nodes tbody tr[data-node-id=n0999]", timeout=5_000)
            assert rows.count() == 1 and page.inner_text("#node-range") == f"1–1 of 1 (of {N})"
            page.fill("#node-filter", "site-61")
            _rows(page, 16)
            assert page.inner_text("#node-range") == f"1–16 of 16 (of {N})"
            page.fill("#node-filter", "")
            _rows(page, 50)
            assert not errors, errors
        finally:
            browser.close()
