"""The dashboard's pending-devices card and the node table's width, in a real headless Chromium at
1400 px: a device (edgenode/enrol.py) announcing itself appears as pending, the operator accepts it
(and rejects another) with the card's buttons; the node table shows its last column without
scrolling, with realistic values in every cell (device image, health, api URL)."""

from __future__ import annotations

import threading
import time

import pytest

from deploy.keys import provision
from edgenode.enrol import enrol
from edgenode.errors import ConfigError
from federation import topics
from federation.messages import ImageInfo
from tests.fixtures_browser import OUT
from tests.fleet.conftest import TOKEN
from tests.fleet.sim_nodes import SimNode

pytestmark = [pytest.mark.browser, pytest.mark.mosquitto]



def _open(page, fleet) -> None:
    page.goto(f"{fleet.url}/?token={TOKEN}")
    page.wait_for_selector("#live.on", timeout=10_000)


def test_node_table_fits_1400px(make_fleet, browser):
    fleet = make_fleet()
    for i in range(3):
        node_id = f"gateway-{i}-warehouse"
        sim = SimNode(node_id, fleet.link(node_id), fleet.swarm, version=12345)
        sim.started -= 40 * 86400
        st = sim.status().model_copy(update={
            "board": "aarch64-virt", "arch": "aarch64",
            "image": ImageInfo(version="2026.11.27-rc1", slot="b", state="trial", health="pending",
                               previous="2026.11.20")})
        sim.link.publish(topics.status(fleet.swarm, node_id), st, retain=True).wait_for_publish(5)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    OUT.mkdir(exist_ok=True)
    _open(page, fleet)
    page.locator("#nodes tbody tr[data-state=online]").nth(2).wait_for(timeout=10_000)
    widths = page.evaluate("""() => { const t = document.querySelector('#nodes');
        const card = t.closest('.card');
        const last = t.querySelector('tbody tr td:last-child').getBoundingClientRect();
        return {table: t.scrollWidth, card: card.clientWidth, last: last.right,
                cardRight: card.getBoundingClientRect().right}; }""")
    assert widths["table"] <= widths["card"], widths
    assert widths["last"] <= widths["cardRight"], widths
    page.screenshot(path=str(OUT / "dashboard-nodes-1400.png"), full_page=True)


def test_pending_device_accepted_and_rejected_on_the_dashboard(make_fleet, browser, tmp_path):
    keys = tmp_path / "keys"
    swarm = f"enb{int(time.time() * 1000) % 10**8}"
    provision(keys, swarm, ["node-1"])
    fleet = make_fleet(swarm=swarm, key_file=str(keys / "keys/fleet.key"),
                       keyring_file=str(keys / "keyring.json"), db=str(tmp_path / "fleet.sqlite"))
    token = fleet.post("/api/enrollment-tokens", json={"uses": 2}).json()["token"]
    results: dict[str, object] = {}

    def device(name: str) -> None:
        d = tmp_path / name
        d.mkdir()
        (d / "enrollment.toml").write_text(f'fleet = "{fleet.url}"\nenroll_token = "{token}"\n')
        try:
            results[name] = enrol(d, device_id=name, arch="riscv64", board="riscv64-virt", poll_s=0.1,
                                  timeout_s=60)
        except ConfigError as exc:
            results[name] = str(exc)

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    _open(page, fleet)
    assert page.locator("#no-enrollments").is_visible()
    threads = [threading.Thread(target=device, args=(n,), daemon=True) for n in ("board-a", "board-b")]
    for t in threads:
        t.start()
    page.locator("#enrollments tr[data-state=pending]").nth(1).wait_for(timeout=10_000)
    assert "2 pending" in page.inner_text("#enrol-count")
    row = page.locator("#enrollments tr[data-device-id=board-a]")
    assert "riscv64" in row.inner_text() and "riscv64-virt" in row.inner_text()
    row.locator("button[data-enrol=accept]").click()
    page.locator("#enrollments tr[data-device-id=board-a][data-state=accepted]").wait_for(timeout=10_000)
    page.locator("#enrollments tr[data-device-id=board-b] button[data-enrol=reject]").click()
    page.locator("#enrollments tr[data-device-id=board-b][data-state=rejected]").wait_for(timeout=10_000)
    for t in threads:
        t.join(30)
    assert not isinstance(results["board-a"], str), results
    assert "rejected" in str(results["board-b"]), results
    states = {e["device_id"]: e["state"] for e in fleet.get("/api/enrollments").json()["enrollments"]}
    assert states == {"board-a": "accepted", "board-b": "rejected"}
    assert errors == []
