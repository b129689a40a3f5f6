"""The node's handle on its device (firmware.ota.DeviceUpdates) on real device directories, without
a broker: what the status reports before and after the restart, and refusals that change nothing."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import pytest

from firmware.boot import _pick, _settle
from firmware.device import Device, flash
from firmware.errors import FirmwareError
from firmware.ota import DeviceUpdates
from tests.firmware.conftest import tree


@pytest.fixture
def served(tmp_path):
    """``serve(path) -> url`` of a file on a local HTTP server."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def serve(path: Path) -> str:
        (root / path.name).write_bytes(path.read_bytes())
        return f"http://127.0.0.1:{httpd.server_address[1]}/{path.name}"

    yield serve
    httpd.shutdown()
    httpd.server_close()


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _boot(dev: Device, ok: str | None = None) -> str:
    """What `fractal boot` does around the node: pick (spend a trial), then settle the check."""
    slot, _, _ = _pick(dev, log=lambda m: None)
    _settle(dev, slot, ok, log=lambda m: None)
    return slot


def test_update_report_done_then_rollback(tmp_path, fw_image, fw_keys, served):
    device = tmp_path / "dev"
    flash(fw_image("1.0.0"), device, [f"{fw_keys['k1']}.pub"])
    dev = Device(device)
    upd = DeviceUpdates(device)
    slot, _, _ = _pick(dev, log=lambda m: None)
    assert upd.report()["health"] == "pending"  # the node is up, its check not done yet
    _settle(dev, slot, None, log=lambda m: None)
    rep = upd.report()
    assert (rep["version"], rep["slot"], rep["state"], rep["health"], rep["update"]) == (
        "1.0.0", "a", "good", "passed", None)

    img = fw_image("2.0.0")
    upd.begin("u1", "update", "2.0.0")
    assert upd.report()["update"]["phase"] == "downloading" and upd.last_update_id() == "u1"
    stats = upd.update("u1", served(img), _sha(img)[:32])
    assert stats.bytes_received == img.stat().st_size
    assert upd.report()["update"]["phase"] == "rebooting"
    assert list((device / "data" / "downloads").iterdir()) == []
    slot, _, _ = _pick(dev, log=lambda m: None)  # the supervisor boots the new slot ...
    assert slot == "b" and upd.report()["update"]["phase"] == "trial"
    _settle(dev, slot, None, log=lambda m: None)  # ... and its health check passes
    rep = upd.report()
    assert (rep["version"], rep["slot"], rep["previous"]) == ("2.0.0", "b", "1.0.0")
    assert rep["update"]["phase"] == "done"

    upd.rollback("r1")
    assert upd.report()["update"] == {"update_id": "r1", "kind": "rollback", "phase": "rebooting",
                                      "version": "1.0.0", "error": None}
    assert _boot(dev) == "a"
    rep = upd.report()
    assert (rep["version"], rep["slot"], rep["update"]["phase"]) == ("1.0.0", "a", "done")


def test_a_failing_new_slot_reports_rolled_back(tmp_path, fw_image, fw_keys, served):
    device = tmp_path / "dev"
    flash(fw_image("1.0.0"), device, [f"{fw_keys['k1']}.pub"])
    dev = Device(device)
    _boot(dev)
    upd = DeviceUpdates(device)
    img = fw_image("2.0.0", broken=True)
    upd.update("u2", served(img), _sha(img)[:32])
    slot, _, _ = _pick(dev, log=lambda m: None)
    assert _settle(dev, slot, "output 'y' differs from the image's expected output", log=lambda m: None)
    assert _boot(dev) == "a"  # the fallback
    rep = upd.report()
    assert (rep["version"], rep["slot"], rep["update"]["phase"]) == ("1.0.0", "a", "rolled_back")
    assert "expected output" in rep["update"]["error"]


def test_refusals_change_nothing(tmp_path, fw_image, fw_keys, served):
    device = tmp_path / "dev"
    flash(fw_image("1.0.0"), device, [f"{fw_keys['k1']}.pub"])
    dev = Device(device)
    _boot(dev)
    upd = DeviceUpdates(device)
    before = {k: v for k, v in tree(device).items() if not k.startswith("data/downloads")}
    other = fw_image("2.0.0")
    cases = [
        (served(other), "0" * 32, "is not image"),  # another file than the command names
        (served(fw_image("2.0.0", key="k2")), _sha(fw_image("2.0.0", key="k2"))[:32], "trusted"),
        (served(fw_image("0.9.0")), _sha(fw_image("0.9.0"))[:32], "older"),  # downgrade
        (served(other) + ".missing", _sha(other)[:32], "HTTP 404"),
    ]
    for url, image_id, word in cases:
        with pytest.raises(FirmwareError, match=word):
            upd.update("u3", url, image_id)
        upd.fail("u3", "update", "2.0.0", FirmwareError("x", hint="y"))
        after = {k: v for k, v in tree(device).items() if not k.startswith("data/downloads")}
        assert {k: v for k, v in after.items() if k != "data/ota-update.json"} == {
            k: v for k, v in before.items() if k != "data/ota-update.json"}, word
    assert upd.report()["update"] == {"update_id": "u3", "kind": "update", "phase": "failed",
                                      "version": "2.0.0", "error": "x (help: y)"}
    with pytest.raises(FirmwareError, match="no previous good slot"):
        upd.rollback("r2")
    with pytest.raises(FirmwareError, match="more than"):  # a size cap from the command
        upd.update("u4", served(other), _sha(other)[:32], max_bytes=100)


def test_an_install_cut_by_a_restart_is_settled_at_the_next_start(tmp_path, fw_image, fw_keys, served):
    """A power cut (or crash) during an install leaves the record in `downloading`, which no
    process advances: before, the fleet's roll-out waited for its stage deadline (15 min by
    default) while the board ran its old slot. Now the next node start settles it: `failed`
    (interrupted) when the slots were not switched, `rebooting` to the new slot when the flash had
    switched (the report then derives trial / done / rolled_back as after any restart)."""
    device = tmp_path / "dev"
    flash(fw_image("1.0.0"), device, [f"{fw_keys['k1']}.pub"])
    dev = Device(device)
    _boot(dev)
    upd = DeviceUpdates(device)
    assert upd.recover() is None  # no record: nothing to settle
    # cut before the switch: downloading, slot b untouched
    upd.begin("u5", "update", "2.0.0")
    assert DeviceUpdates(device).recover() == "failed"
    rep = upd.report()
    assert (rep["version"], rep["slot"], rep["update"]["phase"]) == ("1.0.0", "a", "failed")
    assert "interrupted" in rep["update"]["error"]
    assert DeviceUpdates(device).recover() is None  # settled once
    # cut after the switch, before the record said so: the new slot boots on trial, then passes
    upd.begin("u6", "update", "2.0.0")
    flash(fw_image("2.0.0"), device, [])
    assert upd.report()["update"]["phase"] == "downloading"
    slot, _, _ = _pick(dev, log=lambda m: None)
    assert slot == "b"
    assert DeviceUpdates(device).recover() == "rebooting"
    assert upd.report()["update"]["phase"] == "trial"
    _settle(dev, slot, None, log=lambda m: None)
    rep = upd.report()
    assert (rep["version"], rep["slot"], rep["update"]["phase"]) == ("2.0.0", "b", "done")
    # cut after the switch to a slot that then fails: rolled back
    upd.begin("u7", "update", "3.0.0")
    flash(fw_image("3.0.0", broken=True), device, [])
    slot, _, _ = _pick(dev, log=lambda m: None)
    assert _settle(dev, slot, "output 'y' differs from the image's expected output", log=lambda m: None)
    assert _boot(dev) == "b"
    assert DeviceUpdates(device).recover() == "rebooting"
    rep = upd.report()
    assert (rep["version"], rep["slot"], rep["update"]["phase"]) == ("2.0.0", "b", "rolled_back")
