"""The dashboard's automatic-rounds panel in a real headless Chromium: a fleet, a real Mosquitto and
simulated nodes (tests/fleet/sim_nodes.py). The operator saves a policy and flips the switch; the
schedule (its clock advanced by the test) starts a round that the history and the actions show
with its trigger; the switch turns it off again, and a reload shows the stored policy."""

from __future__ import annotations

import time

import pytest

from tests.fixtures_browser import OUT
from tests.fleet.conftest import TOKEN
from tests.fleet.sim_nodes import SimSwarm

pytestmark = [pytest.mark.browser, pytest.mark.mosquitto]


def test_auto_rounds_switch_schedule_and_trigger_shown(make_fleet, browser):
    from playwright.sync_api import expect  # auto-waiting assertions (imported as the browser is)

    fleet = make_fleet(auto_check_s=0.05)
    now = [1_800_000_000.0]
    fleet.service.auto.clock = lambda: now[0]
    sim = SimSwarm(fleet.broker_url, fleet.swarm, ["node-1", "node-2"])
    page = browser.new_page(viewport={"width": 1400, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{fleet.url}/?token={TOKEN}")
        page.wait_for_selector("#live.on", timeout=10_000)
        page.locator("#nodes tbody tr[data-state=online]").nth(1).wait_for(timeout=10_000)
        assert not page.is_checked("#auto-enabled")
        assert "Off" in page.inner_text("#auto-summary")

        # the policy: every 2 minutes, or 500 new samples; saved while still off
        page.check("#auto-schedule")
        page.fill("#auto-every", "2")
        page.check("#auto-on-samples")
        page.fill("#auto-threshold", "500")
        page.fill("#auto-spacing", "1")
        page.fill("#auto-steps", "4")
        page.click("#auto-save")
        page.wait_for_selector("#actions tr[data-action='auto_rounds.policy']", timeout=10_000)
        policy = fleet.get("/api/auto-rounds").json()["policy"]
        assert policy["enabled"] is False and policy["schedule"] == {"enabled": True, "every_min": 2.0,
                                                                     "window": None}
        assert policy["samples"] == {"enabled": True, "threshold": 500} and policy["round"]["steps"] == 4

        # the switch turns it on: the next due time and the sample progress appear
        page.check("#auto-enabled")
        page.wait_for_selector("#auto-card[data-enabled='1']", timeout=10_000)
        assert fleet.get("/api/auto-rounds").json()["policy"]["enabled"] is True
        assert "every 2 min" in page.inner_text("#auto-summary")
        assert "in 2 min" in page.inner_text("#auto-next")
        assert page.get_attribute("#auto-next", "data-due") == str(now[0] + 120).removesuffix(".0")
        assert "0 / 500 new samples" in page.inner_text("#auto-samples")

        # the schedule's time comes: a round starts by itself, runs and commits; shown with its trigger
        for node in sim.nodes.values():  # simulated nodes send no heartbeats: fresh statuses first
            node.announce()
        fleet.wait_for(lambda: all(v["age_s"] < 5 for v in fleet.get("/api/nodes").json()["nodes"]),
                       what="fresh statuses")
        now[0] += 120
        row = page.locator("#rounds tbody tr[data-trigger=schedule]")
        row.wait_for(timeout=10_000)
        page.wait_for_selector("#rounds tbody tr[data-trigger=schedule][data-state=done]", timeout=20_000)
        assert "schedule" in row.locator("td").first.inner_text()
        page.wait_for_function(
            "() => [...document.querySelectorAll('#actions tr[data-action=start_round]')]"
            ".some(tr => tr.innerText.includes('schedule'))", timeout=10_000)
        OUT.mkdir(exist_ok=True)
        page.screenshot(path=str(OUT / "dashboard-auto-rounds.png"), full_page=True)

        # the switch turns it off; a reload shows the stored policy, off
        page.uncheck("#auto-enabled")
        page.wait_for_selector("#auto-card:not([data-enabled='1'])", timeout=10_000)
        assert fleet.get("/api/auto-rounds").json()["policy"]["enabled"] is False
        assert page.inner_text("#auto-next") == ""
        page.reload()
        page.wait_for_selector("#live.on", timeout=10_000)
        # #live turns on at the stream's open, before its snapshot is rendered (the threshold field
        # is empty until then): wait for the stored policy to show, then check the switch is off.
        expect(page.locator("#auto-threshold")).to_have_value("500", timeout=10_000)
        assert not page.is_checked("#auto-enabled")
        assert len(fleet.get("/api/rounds").json()["rounds"]) == 1
        assert errors == []
    finally:
        page.close()
        sim.close()


def test_an_older_action_list_answer_never_overwrites_a_newer_one(make_fleet, browser):
    """Two refreshes of the action list in flight (a round event and a policy change ask at once):
    the answers arrive out of order, and the table keeps the newer request's list."""
    from playwright.sync_api import expect

    fleet = make_fleet()
    page = browser.new_page()
    try:
        page.goto(f"{fleet.url}/?token={TOKEN}")
        page.wait_for_selector("#live.on", timeout=10_000)
        expect(page.locator("#swarm")).to_have_text(f"swarm {fleet.swarm}")  # the snapshot is drawn
        held = []
        # answered by the test, in the order it picks
        page.route("**/api/actions?*", lambda route: held.append(route))
        page.evaluate("() => { window.first = refreshActions(); window.second = refreshActions(); }")
        deadline = time.monotonic() + 30
        while len(held) < 2 and time.monotonic() < deadline:
            page.evaluate("() => new Promise((r) => setTimeout(r, 20))")  # lets the page send them
        assert len(held) == 2, "the two refreshes never reached the network"

        def answer(route, name):
            route.fulfill(status=200, content_type="application/json",
                          json={"actions": [{"ts": 1_800_000_000, "action": name, "detail": {}}]})

        answer(held[1], "newer")
        page.evaluate("() => window.second")
        expect(page.locator("#actions tbody tr")).to_have_attribute("data-action", "newer")
        answer(held[0], "older")
        page.evaluate("() => window.first")  # the older answer has been read and handled
        assert page.locator("#actions tbody tr").get_attribute("data-action") == "newer"
    finally:
        page.close()
