"""`fractal swarm --scenario vibration`, scaled down: 2 real node processes on Mosquitto ingest the
simulated machines' SenML, the scenario starts a round, the injected faults score above normal
windows, faults reported as late labels show on the dashboard's anomaly chart, and Ctrl-C leaves
no process behind. The simulator itself (schedule, packs) is tested without a broker."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from deploy.vibration import FaultKind, field_names, machines, make_schedule, readings, senml_pack, windows
from edgenode.anomaly import auc
from edgenode.streams.formats import parse_senml
from federation.broker import free_port
from tests.fleet.swarm_proc import FRACTAL, assert_no_orphans, start_swarm

# Bound on the scaled-down run (40 steps, ~100 windows a node): the full scenario's goal is 0.95
# (bench.vibration, BENCHMARKS.md); offline the model reaches 1.0 on these faults in 50 steps.
AUC_BOUND = 0.9


def test_schedule_and_packs_round_trip() -> None:
    ms = machines(3)
    assert len({round(m.shaft_hz) for m in ms}) == 3  # distinct operating points
    s = make_schedule(ms, 1000.0, warmup_s=60, every_s=40, length_s=8, horizon_s=300)
    assert s.faults and all(f.start >= 1060 and f.end - f.start == 8 for f in s.faults)
    assert {f.kind for f in s.faults} == set(FaultKind)
    assert {f.machine for f in s.faults} == {m.name for m in ms}
    assert s.fault_at(s.faults[0].machine, s.faults[0].start + 1) is s.faults[0].kind
    assert s.fault_at(s.faults[0].machine, 1000.0) is None
    assert json.loads(json.dumps(s.to_json()))["faults"][0]["kind"] in {k.value for k in FaultKind}
    m = ms[0]
    t = 1.7e9 + np.arange(50) / 500.0
    vals = readings(m, t)
    np.testing.assert_array_equal(vals, readings(m, t))  # a pure function of machine and time
    got = parse_senml(senml_pack(m.name, float(t[0]), vals, 500.0),
                      {f: i for i, f in enumerate(field_names(m.name))}, now=0.0)
    assert got.malformed == 0 and got.unmapped == 0 and len(got.readings) == 50
    assert got.readings[3][0] == pytest.approx(t[3], abs=1e-5)
    assert got.readings[3][1] == pytest.approx({0: vals[3, 0], 1: vals[3, 1]}, abs=1e-4)
    rng = np.random.default_rng(0)
    normal, bearing = windows(m, 4, None, rng=rng), windows(m, 4, FaultKind.BEARING, rng=rng)
    assert normal.shape == (4, 640) and normal.dtype == np.float32
    assert np.abs(bearing - normal.mean(0)).sum() > np.abs(normal - normal.mean(0)).sum()


def test_cli_refuses_what_the_scenario_cannot_do(tmp_path) -> None:
    for extra, want in ((["--sites", "2"], "error: --scenario vibration runs on one broker"),
                        (["--speed", "0"], "Invalid value for '--speed'")):
        proc = subprocess.run([FRACTAL, "swarm", "--scenario", "vibration", "--nodes", "2", "--port",
                               str(free_port()), "--cache-dir", str(tmp_path), *extra],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and want in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("swarm/*")), "refused before compiling anything"


@pytest.fixture
def vibration_cache(tmp_path_factory, autoencoder_artifact) -> Path:
    """A swarm cache holding the session's fc-autoencoder (compiled as the scenario would, same
    training settings) with its stamp: the scenario reuses it instead of compiling it again."""
    from compiler import host_preset_name
    from deploy.swarm import STAMP, VIBRATION_MODEL, VIBRATION_TRAIN, demo_stamp

    cache = tmp_path_factory.getbasetemp() / "swarm-cache"
    out = cache / "swarm" / f"{VIBRATION_MODEL}-{host_preset_name()}"
    if not out.is_dir():
        shutil.copytree(autoencoder_artifact, out)
        (out / STAMP).write_text(json.dumps(demo_stamp(host_preset_name(), VIBRATION_MODEL, VIBRATION_TRAIN)))
    return cache


@pytest.mark.slow  # the fc-autoencoder's compile (shared, ~1-3 min on a loaded machine) and a round
@pytest.mark.mosquitto
def test_vibration_scenario_detects_injected_faults(tmp_path_factory, vibration_cache: Path) -> None:
    work = tmp_path_factory.mktemp("vibration")
    sp = start_swarm(2, vibration_cache, "vib-token", timeout=600,
                     extra=("--scenario", "vibration", "--speed", "10", "--round-every", "60",
                            "--round-steps", "40", "--min-samples", "80", "--workdir", str(work)))
    try:
        urls = dict(p.split() for p in next(ln for ln in sp.lines if ln.strip().startswith("nodes:"))
                    .split(":", 1)[1].split(","))
        assert "faults:" in sp.output()
        with httpx.Client(base_url=sp.base, headers={"Authorization": "Bearer vib-token"}, timeout=30) as c:
            deadline = time.monotonic() + 300
            while not (rounds := c.get("/api/rounds").json()["rounds"]) or rounds[-1]["state"] == "running":
                assert time.monotonic() < deadline, rounds
                time.sleep(1.0)
            first = rounds[-1]
            assert first["state"] == "done", first["reason"]
            assert first["participants"] == ["node-1", "node-2"] and first["version_after"] == 1
            # every node scores held-out windows of its own machine with the committed model
            rng = np.random.default_rng(7)
            for i, m in enumerate(machines(2)):
                x = np.concatenate([windows(m, 30, None, rng=rng)] +
                                   [windows(m, 10, k, rng=rng) for k in FaultKind])
                y = np.r_[np.zeros(30), np.ones(30)]
                body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                    "data": x.ravel().tolist()}]}
                r = c.post(f"{urls[f'node-{i + 1}']}/v2/models/fc-autoencoder/infer", json=body)
                assert r.status_code == 200, r.text
                outs = {o["name"]: o["data"] for o in r.json()["outputs"]}
                a = auc(np.asarray(outs["anomaly_score"]), y)
                assert a is not None and a >= AUC_BOUND, (m.name, a)
            # the fleet sees each node's live scores, its threshold and the faults reported as labels
            faults = json.loads((work / "faults.json").read_text())["faults"]
            deadline = time.monotonic() + 60
            while True:
                nodes = c.get("/api/nodes").json()["nodes"]
                an = {n["node_id"]: n["anomaly"] for n in nodes}
                if all(a and a["scores"] and a["threshold"] and a["labelled"] for a in an.values()):
                    break
                assert time.monotonic() < deadline, an
                time.sleep(1.0)
            starts = {(f["machine"].replace("machine", "node"), round(f["start"], 3)) for f in faults}
            for node_id, a in an.items():
                assert all((node_id, round(t0, 3)) in starts for t0, _ in a["labelled"]), \
                    (node_id, a["labelled"])
        _dashboard_shows_scores(sp.url)
        assert "reusing compiled fc-autoencoder" in sp.output()
        children = sp.descendants()
        assert len(children) >= 3
    finally:
        code = sp.interrupt()
    assert code in (0, 130), sp.output()
    assert "[swarm] stopped" in sp.output()
    assert_no_orphans(children)


def _dashboard_shows_scores(url: str) -> None:
    from playwright.sync_api import sync_playwright

    from tests.fixtures_browser import CHROMIUM_ARGS, OUT

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(url)
            page.wait_for_selector("#anomaly-card:not([hidden])", timeout=15_000)
            page.wait_for_function("document.getElementById('anomaly-plot').dataset.points > 0 && "
                                   "document.getElementById('anomaly-plot').dataset.bands > 0",
                                   timeout=15_000)
            legend = page.inner_text("#anomaly-legend")
            assert "node-1" in legend and "node-2" in legend and "labelled anomalous" in legend, legend
            OUT.mkdir(exist_ok=True)
            page.locator("#anomaly-card").screenshot(path=str(OUT / "dashboard-vibration.png"))
        finally:
            browser.close()
