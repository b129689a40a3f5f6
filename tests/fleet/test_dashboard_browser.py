"""The dashboard in a real headless Chromium against a real swarm (`fractal swarm --nodes 3`:
Mosquitto, 3 edge nodes with TVM artifacts and simulated sensors, the fleet service)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.fixtures_browser import OUT
from tests.fleet.swarm_proc import start_swarm

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.mosquitto]

TOKEN = "browser-token"


@pytest.fixture(scope="module")
def swarm3(tmp_path_factory):
    sp = start_swarm(3, tmp_path_factory.getbasetemp() / "swarm-cache", TOKEN)
    try:
        # Wait until every node holds at least a few training batches of its shard.
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
            deadline = time.monotonic() + 60
            while True:
                nodes = c.get(sp.base + "/api/nodes").json()["nodes"]
                if len(nodes) == 3 and all(n["online"] and n["samples"] >= 96 for n in nodes):
                    break
                assert time.monotonic() < deadline, nodes
                time.sleep(0.5)
        yield sp
    finally:
        sp.interrupt()


def test_dashboard_shows_swarm_runs_round_and_plots_loss(swarm3, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(swarm3.url)  # the printed link: ?token= -> SameSite=Strict cookie -> refresh to /
    page.wait_for_url(swarm3.base + "/", timeout=10_000)
    page.wait_for_selector("#live.on", timeout=10_000)
    rows = page.locator("#nodes tbody tr[data-state=online]")
    rows.nth(2).wait_for(timeout=10_000)
    assert rows.count() == 3
    assert page.locator("#nodes tbody tr").all_inner_texts()[0].startswith("node-1")
    assert "digits-mlp" in page.locator("#nodes").inner_text()

    # Refused round: only one participant -> the operator sees the 409 reason.
    boxes = page.locator("#participants input")
    assert boxes.count() == 3
    boxes.nth(1).uncheck()
    boxes.nth(2).uncheck()
    page.click("#start")
    page.wait_for_selector("#error:not([hidden])", timeout=5_000)
    assert "fewer than 2 nodes online" in page.inner_text("#error")
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "dashboard-409.png"))

    # A real round over all three nodes: the plot fills in and the round ends as done.
    boxes.nth(1).check()
    boxes.nth(2).check()
    page.fill("#steps", "200")
    page.fill("#lr", "0.1")
    page.click("#start")
    try:
        page.wait_for_function("document.getElementById('error').hidden", timeout=5_000)
        page.wait_for_function("+document.getElementById('loss-plot').dataset.points >= 2", timeout=60_000)
        # The plot follows the round just started (an earlier test's round may be done already).
        page.wait_for_selector("#loss-plot[data-state=done]", timeout=90_000)
    except Exception:
        OUT.mkdir(exist_ok=True)
        page.screenshot(path=str(OUT / "dashboard-failed.png"), full_page=True)
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            print(c.get(swarm3.base + "/api/rounds").text)
        raise
    rid = page.locator("#loss-plot").get_attribute("data-round")
    row = page.locator(f"#rounds tbody tr[data-round-id='{rid}']").inner_text()
    assert "done" in row and "agree" in row and "200/200" in row

    # The plotted numbers are the fleet's numbers, and training lowered the loss.
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        rnd = c.get(swarm3.base + f"/api/rounds/{rid}").json()
    assert rnd["state"] == "done" and rnd["params_agree"]
    means = [s["mean"] for s in rnd["loss"] if s["complete"]]
    assert len(means) >= 2 and means[-1] < means[0], means
    # Every step reaches the plot (nodes batch the losses between their throttled events).
    assert len(rnd["loss"]) == 200 and page.locator("#loss-plot").get_attribute("data-points") == "200"
    # Validation on each node's held-back share: measured before and after, better after.
    val = rnd["validation"]
    assert val["before"]["samples"] > 0 and val["after"]["accuracy"] > val["before"]["accuracy"], val
    assert rnd["regressed"] is None and rnd["rollback"] is None
    # Nodes report the new model version and its validation accuracy (from their statuses).
    page.wait_for_function(
        "[...document.querySelectorAll('#nodes tbody tr')].every(tr => tr.dataset.version === '1'"
        " && tr.querySelector('td.val-acc').innerText.endsWith('%'))", timeout=15_000)
    cells = page.locator("#nodes tbody tr").first.locator("td").all_inner_texts()
    assert " / " in cells[9] and "TVM" in cells[3] and cells[8].endswith("GB"), cells  # train / val samples
    assert "→" in page.locator(f"#rounds tbody tr[data-round-id='{rid}'] td.validation").inner_text()
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "dashboard.png"), full_page=True)

    # A round with a learning rate that wrecks the trained model: the fleet rolls it back on
    # its own, to the version the round started from (v1).
    page.fill("#steps", "3")
    page.fill("#lr", "10")  # the bound (federation/bounds.py LR_MAX): wrecks the trained model
    page.click("#start")
    page.wait_for_function("rid => { const p = document.getElementById('loss-plot');"
                           " return p.dataset.round !== rid && p.dataset.state === 'done'; }", arg=rid,
                           timeout=60_000)
    bad = page.locator("#loss-plot").get_attribute("data-round")
    try:
        page.wait_for_selector(f"#rounds tbody tr[data-round-id='{bad}'][data-rolled-back='1']",
                               timeout=30_000)
    except Exception:
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            r = c.get(swarm3.base + f"/api/rounds/{bad}").json()
            print({k: r[k] for k in ("state", "validation", "regressed", "rollback", "nodes")})
            print(c.get(swarm3.base + "/api/actions").json())
        raise
    assert "rolled back (auto)" in page.locator(f"#rounds tbody tr[data-round-id='{bad}']").inner_text()
    page.wait_for_function(
        "[...document.querySelectorAll('#nodes tbody tr')].every(tr => tr.dataset.version === '1')",
        timeout=15_000)
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        nodes = c.get(swarm3.base + "/api/nodes").json()["nodes"]
        undone = c.get(swarm3.base + f"/api/rounds/{bad}").json()
    assert {n["params_sha256"] for n in nodes} == {rnd["params_sha256"]}  # the first round's parameters
    assert "fell" in undone["regressed"] and undone["rollback"]["to_version"] == 1
    page.screenshot(path=str(OUT / "dashboard-auto-rollback.png"), full_page=True)

    # Roll the round back from its row: every node returns to v0 together.
    page.click(f"#rounds tbody tr[data-round-id='{rid}'] button[data-undo]")
    page.wait_for_selector(f"#rounds tbody tr[data-round-id='{rid}'][data-rolled-back='1']", timeout=30_000)
    page.wait_for_function(
        "[...document.querySelectorAll('#nodes tbody tr')].every(tr => tr.dataset.version === '0')",
        timeout=15_000)
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        nodes = c.get(swarm3.base + "/api/nodes").json()["nodes"]
    assert len({n["params_sha256"] for n in nodes}) == 1 and all(n["model_version"] == 0 for n in nodes)
    assert not errors, errors
    page.close()


def test_dashboard_without_token_shows_login(swarm3, browser):
    page = browser.new_page()
    page.goto(swarm3.base + "/")
    page.wait_for_selector("#login-form")
    page.fill("#token", "wrong")
    page.click("button[type=submit]")
    page.wait_for_selector("#error:not([hidden])")
    assert "Wrong operator token" in page.inner_text("#error")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("#nodes tbody tr", timeout=10_000)
    page.close()
