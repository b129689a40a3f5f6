"""The dashboard's device images in a real headless Chromium: a real fleet with a catalogue, a real
Mosquitto, and two boards run by real `fractal boot` processes. Upload an image from the page,
roll it out to both nodes (canary first), watch their image versions change, roll them back."""

from __future__ import annotations

import pytest

from tests.firmware.boards import make_board
from tests.fixtures_browser import CHROMIUM_ARGS, OUT
from tests.fleet.conftest import TOKEN, broker, make_fleet  # noqa: F401 - fixtures

pytestmark = [pytest.mark.browser, pytest.mark.mosquitto, pytest.mark.slow]

DONE = "#rollout-progress[data-state='done'][data-kind='{}']"


def _wait_images(page, version: str, timeout_ms: int = 240_000) -> None:
    page.wait_for_function(
        "v => { const rows = [...document.querySelectorAll('#nodes tbody tr')];"
        " return rows.length === 2 && rows.every(tr => tr.dataset.imageVersion === v"
        " && tr.dataset.imageHealth === 'passed'); }",
        arg=version, timeout=timeout_ms)


def test_upload_roll_out_and_roll_back_from_the_dashboard(make_fleet, fw_image, fw_keys, tmp_path):  # noqa: F811
    from playwright.sync_api import sync_playwright

    fleet = make_fleet(images_dir=str(tmp_path / "catalogue"), image_keys=[f"{fw_keys['k1']}.pub"],
                       rollout_stage_timeout_s=180)
    pub = f"{fw_keys['k1']}.pub"
    boards = [make_board(tmp_path, n, fw_image("1.0.0"), pub, fleet.broker_url, fleet.swarm)
              for n in ("node-1", "node-2")]
    new = fw_image("2.0.0")
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{fleet.url}/?token={TOKEN}")
            page.wait_for_selector("#live.on", timeout=10_000)
            _wait_images(page, "1.0.0")
            assert "slot a" in page.inner_text("#nodes tbody tr:first-child td.image")
            assert page.locator("#no-images").is_visible()

            # upload from the page: verified by the fleet, listed in the catalogue
            page.set_input_files("#image-file", str(new))
            page.click("#upload")
            page.wait_for_selector("#images tbody tr[data-version='2.0.0']", timeout=30_000)
            assert page.input_value("#rollout-image") == page.get_attribute(
                "#images tbody tr[data-version='2.0.0']", "data-image-id")
            # a file that is not an image: refused with the reason in the banner
            junk = tmp_path / "junk.img"
            junk.write_bytes(b"not an image at all")
            page.set_input_files("#image-file", str(junk))
            page.click("#upload")
            page.wait_for_selector("#error:not([hidden])", timeout=10_000)
            assert "not a fractal device image" in page.inner_text("#error")
            page.click("#error-close")

            # roll it out to both nodes: node-1 is the canary
            assert [i.get_attribute("value") for i in page.locator("#rollout-nodes input:checked").all()] == [
                "node-1", "node-2"]
            page.click("#rollout")
            page.wait_for_selector("#rollout-progress[data-state='running']", timeout=10_000)
            assert "canary: node-1" in page.inner_text("#rollout-progress")
            _wait_images(page, "2.0.0")
            page.wait_for_selector(DONE.format("rollout"), timeout=30_000)
            assert page.locator("#rollout-progress .node-phase[data-phase='passed']").count() == 2
            assert "slot b" in page.inner_text("#nodes tbody tr:first-child td.image")
            OUT.mkdir(exist_ok=True)
            page.screenshot(path=str(OUT / "dashboard-ota-rollout.png"), full_page=True)

            # roll both back to their previous image
            page.click("#image-rollback")
            page.wait_for_selector("#rollout-progress[data-kind='rollback'], #error:not([hidden])",
                                   timeout=10_000)
            assert page.locator("#error").is_hidden(), page.inner_text("#error")
            _wait_images(page, "1.0.0")
            page.wait_for_selector(DONE.format("rollback"), timeout=30_000)
            assert "slot a" in page.inner_text("#nodes tbody tr:first-child td.image")
            page.wait_for_selector("#actions tbody tr[data-action='image.rollback.done']", timeout=10_000)
            page.screenshot(path=str(OUT / "dashboard-ota-rollback.png"), full_page=True)
            assert errors == []
            browser.close()
    finally:
        for b in boards:
            b.stop()
