"""The dashboard's asynchronous-rounds card in a real headless Chromium (issue 28 item 4): a fleet
aggregating asynchronous rounds over a real Mosquitto, and two signed members (the real
:class:`~federation.asyncagg.AsyncMember` on the fleet's broker, no model compiled) sending
updates. The card shows the buffer filling, the version advancing with its contributors, and a
refused update; a fleet that runs no asynchronous rounds shows no card."""

from __future__ import annotations

import time

import numpy as np
import pytest

from deploy.keys import provision
from federation.asyncagg import AsyncMember
from federation.signed import load_identity
from tests.fixtures_browser import OUT
from tests.fleet.conftest import TOKEN

pytestmark = [pytest.mark.browser, pytest.mark.mosquitto]

SIZE = 64


def test_async_card_shows_versions_buffer_and_refusals(make_fleet, browser, tmp_path):
    swarm = f"ad{int(time.time() * 1000) % 10**8}"
    members = [f"{swarm}-a", f"{swarm}-b"]
    keys = tmp_path / "keys"
    provision(keys, swarm, members)
    art = tmp_path / "artifact"
    art.mkdir()
    np.savez(art / "params.npz", p0000=np.zeros(SIZE, np.float32))
    fleet = make_fleet(swarm=swarm, key_file=str(keys / "keys/fleet.key"),
                       keyring_file=str(keys / "keyring.json"), async_params=str(art),
                       async_buffer=2, async_max_staleness=1,
                       db=str(tmp_path / "fleet.sqlite"))
    signed = {m: AsyncMember(load_identity(keys / f"keys/{m}.key", keys / "keyring.json").link(fleet.link(m)),
                             m, SIZE).start() for m in members}
    a, b = (signed[m] for m in members)
    page = browser.new_page(viewport={"width": 1400, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{fleet.url}/?token={TOKEN}")
        page.wait_for_selector("#live.on", timeout=10_000)
        page.wait_for_selector("#async-card[data-version='0']", timeout=10_000)
        assert page.inner_text("#async-fill").startswith("0 of 2 updates")
        assert "at most 1 version behind" in page.inner_text("#async-bounds")
        assert page.get_attribute("#async-versions tbody tr", "data-version") == "0"

        # a's update from version 0 waits in the buffer: 1 of 2
        v0 = a.wait_version(0, timeout=10)
        a.publish_update(v0, v0.params + 0.5, samples=10)
        page.wait_for_selector("#async-fill[data-pending='1']", timeout=10_000)
        assert members[0] in page.inner_text("#async-fill")

        # b's fills it: version 1, made of both, empties the buffer
        b.publish_update(b.wait_version(0, timeout=10), v0.params + 1.5, samples=30)
        page.wait_for_selector("#async-card[data-version='1']", timeout=10_000)
        v1 = fleet.get("/api/async").json()
        assert page.inner_text("#async-version") == "1"
        assert v1["sha256"].startswith(page.inner_text("#async-sha"))
        row = page.locator("#async-versions tbody tr").first
        assert row.get_attribute("data-version") == "1" and row.get_attribute("data-contributors") == "2"
        assert all(m in row.inner_text() for m in members)
        assert page.get_attribute("#async-fill", "data-pending") == "0"

        # a sends from version 0 again: refused (it already sent one from there), counted on the card
        a.publish_update(v0, v0.params + 0.25, samples=10)
        page.wait_for_selector("#async-refused[data-total='1']", timeout=10_000)
        assert "1 replayed" in page.inner_text("#async-refused")

        # two fresh updates from version 1: version 2 shows on top, the card's history follows the API
        v1a = a.wait_version(1, timeout=10)
        a.publish_update(v1a, v1a.params - 0.5, samples=10)
        b.publish_update(b.wait_version(1, timeout=10), v1a.params + 0.5, samples=10)
        page.wait_for_selector("#async-card[data-version='2']", timeout=10_000)
        shown = [int(v) for v in page.locator("#async-versions tbody tr").evaluate_all(
            "trs => trs.map(tr => tr.dataset.version)")]
        assert shown == [2, 1, 0]
        assert [v["version"] for v in fleet.get("/api/async").json()["versions"]] == [0, 1, 2]
        OUT.mkdir(exist_ok=True)
        page.screenshot(path=str(OUT / "dashboard-async.png"), full_page=True)
        assert errors == []
    finally:
        page.close()
        for m in signed.values():
            m.close()


def test_async_card_hidden_on_a_synchronous_fleet(make_fleet, browser):
    fleet = make_fleet()
    page = browser.new_page()
    try:
        page.goto(f"{fleet.url}/?token={TOKEN}")
        page.wait_for_selector("#live.on", timeout=10_000)
        assert page.locator("#async-card").is_hidden()
        assert fleet.get("/api/async").status_code == 404
    finally:
        page.close()
