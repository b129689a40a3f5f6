"""`fractal swarm --nodes 2` as a subprocess: URL printed, dashboard reachable, nodes online,
SIGINT stops everything (nodes, broker) with no orphan process left."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from federation.broker import free_port
from tests.fleet.swarm_proc import FRACTAL, assert_no_orphans, start_swarm

ROOT = Path(__file__).resolve().parents[2]
STEPS_3ARCH = 8  # enough for the mean loss to fall, few enough for three boards under qemu

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]


def test_swarm_two_nodes_up_and_clean_shutdown(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "swarm-cache"
    sp = start_swarm(2, cache, "e2e-token")
    try:
        assert sp.url == f"{sp.base}/?token=e2e-token"
        assert "token:     e2e-token" in sp.output()
        with httpx.Client(timeout=10, follow_redirects=True) as c:
            hop = c.get(sp.url)  # ?token= logs in (SameSite=Strict cookie) and refreshes to /
            assert hop.status_code == 200 and 'content="0;url=/"' in hop.text
            page = c.get(sp.base + "/")  # what the browser's refresh loads: the dashboard
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
        # The printed curl line works as printed (the nodes take the operator token).
        curl = next(ln.split("try:", 1)[1].strip() for ln in sp.lines if ln.strip().startswith("try:"))
        out = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=20, check=True)
        assert json.loads(out.stdout)["node_id"] == "node-1", out
        assert "fleet db:" in sp.output() and "logs/node-N.log" in sp.output()
        assert len({n["params_sha256"] for n in nodes}) == 1  # same initial parameters everywhere
        children = sp.descendants()
        names = sorted(p.name() for p in children)
        assert sum("mosquitto" in n for n in names) == 1 and len(children) >= 3, names
        # A real edge node killed -9: its Last Will marks it offline, the launcher reports it.
        victim = next(p for p in children if "node-2.toml" in " ".join(p.cmdline()))
        victim.kill()
        with httpx.Client(timeout=10, headers={"Authorization": "Bearer e2e-token"}) as c:
            deadline = time.monotonic() + 15  # socket closed by the kernel: the Will fires at once
            while (n2 := c.get(sp.base + "/api/nodes").json()["nodes"][1])["online"]:
                assert time.monotonic() < deadline, n2
                time.sleep(0.2)
            assert n2["node_id"] == "node-2" and n2["state"] == "offline"
            r = c.post(sp.base + "/api/rounds", json={"steps": 3})
            assert r.status_code == 409 and "fewer than 2 nodes online" in r.json()["error"]
        deadline = time.monotonic() + 30  # the launcher looks once a second, on a loaded machine
        while "node-2 exited unexpectedly" not in sp.output():
            assert time.monotonic() < deadline, sp.output()
            time.sleep(0.2)
    finally:
        code = sp.interrupt()
    assert code in (0, 130), sp.output()
    assert "[swarm] stopped" in sp.output()
    assert_no_orphans(children)


def test_emulate_arm_without_sysroot_is_one_clear_error(tmp_path):
    proc = subprocess.run([FRACTAL, "swarm", "--nodes", "2", "--emulate-arm", "--port", str(free_port()),
                           "--cache-dir", str(tmp_path), "--sysroot", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the aarch64 sysroot is missing") and "make sysroot" in last, proc.stderr


def test_emulate_riscv_without_sysroot_is_one_clear_error(tmp_path):
    proc = subprocess.run([FRACTAL, "swarm", "--nodes", "3", "--emulate-riscv", "--port", str(free_port()),
                           "--cache-dir", str(tmp_path), "--riscv-sysroot", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the riscv64 sysroot is missing") and "make sysroot-riscv64" in last, \
        proc.stderr
    assert not list(tmp_path.glob("swarm/*")), "refused before compiling anything"


def _screenshot_mixed_swarm(sp) -> None:
    """The dashboard shows the mixed-architecture swarm (saved for people to look at)."""
    from playwright.sync_api import sync_playwright

    from tests.fixtures_browser import CHROMIUM_ARGS, OUT

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(sp.url)
            page.wait_for_selector("#rounds tbody tr[data-state=done]", timeout=15_000)
            table = page.inner_text("#nodes")
            assert "aarch64" in table and "riscv64" in table and "x86_64" in table, table
            OUT.mkdir(exist_ok=True)
            page.screenshot(path=str(OUT / "dashboard-mixed-arch.png"), full_page=True)
        finally:
            browser.close()


def _node_urls(sp) -> dict[str, str]:
    """{node id: URL} from the banner's ``nodes:`` line."""
    line = next(ln for ln in sp.lines if ln.strip().startswith("nodes:"))
    pairs = [p.split() for p in line.split(":", 1)[1].split(",")]
    return {node_id: url for node_id, url in pairs}


def _infer(c: httpx.Client, url: str, x: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = c.post(f"{url}/v2/models/digits-mlp/infer", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(len(x), 10)


@pytest.mark.emulate
@pytest.mark.browser
def test_three_arch_swarm_round_commits_bit_identical_params(tmp_path_factory):
    """x86_64 (Relax VM) + riscv64 (the model's C library via ctypes, qemu-riscv64, trixie Python)
    + aarch64 (Relax VM, qemu-aarch64): a gradient round commits on all three with one
    params_sha256, and without the commit step's fallback broadcast: the averaged gradient is the
    same bytes everywhere and the SGD update rounds identically on every ISA (the raw per-node
    gradients do differ; see federation/PROTOCOL.md section 7). The loss falls, every node then
    serves the committed parameters (the emulated boards answer as the x86 node does), and the
    dashboard shows all three architectures.

    One emulated swarm carries what once took three (an x86 + aarch64 swarm, and an aarch64
    `fractal node` next to in-process x86 nodes): each emulated node costs a minute of start-up."""
    arm_root = ROOT / ".cache" / "sysroot-aarch64"
    rv_root = ROOT / ".cache" / "sysroot-riscv64"
    for root in (arm_root, rv_root):
        assert (root / ".done").is_file(), f"run `make sysroot` (make test depends on it): {root}"
    work = tmp_path_factory.mktemp("swarm-3arch")
    sp = start_swarm(3, tmp_path_factory.getbasetemp() / "swarm-cache", "rv-token", timeout=420,
                     extra=("--emulate-arm", "--sysroot", str(arm_root), "--emulate-riscv",
                            "--riscv-sysroot", str(rv_root), "--workdir", str(work)))
    try:
        with httpx.Client(headers={"Authorization": "Bearer rv-token"}, timeout=10) as c:
            deadline = time.monotonic() + 60
            while True:
                nodes = c.get(sp.base + "/api/nodes").json()["nodes"]
                if len(nodes) == 3 and all(n["online"] and n["samples"] >= 32 for n in nodes):
                    break
                assert time.monotonic() < deadline, nodes
                time.sleep(0.5)
            by_arch = {n["arch"]: n for n in nodes}
            assert sorted(by_arch) == ["aarch64", "riscv64", "x86_64"], nodes
            assert by_arch["riscv64"]["artifact"]["target"] == "riscv64"  # the C-backend artifact
            rid = c.post(sp.base + "/api/rounds", json={"steps": STEPS_3ARCH, "lr": 0.1}).json()["round_id"]
            deadline = time.monotonic() + 120
            while (rnd := c.get(f"{sp.base}/api/rounds/{rid}").json())["state"] == "running":
                assert time.monotonic() < deadline, rnd
                time.sleep(0.5)
            assert rnd["state"] == "done", rnd["reason"]
            assert rnd["params_agree"] is True and rnd["version_after"] == 1
            assert len({s["params_sha256"] for s in rnd["nodes"].values()}) == 1, rnd["nodes"]
            means = [s["mean"] for s in rnd["loss"] if s["complete"]]
            assert len(means) == STEPS_3ARCH and means[-1] < means[0], means
            deadline = time.monotonic() + 30  # each node's status follows its round.done event
            while {n["params_sha256"] for n in c.get(sp.base + "/api/nodes").json()["nodes"]} != \
                    {rnd["params_sha256"]}:
                assert time.monotonic() < deadline, c.get(sp.base + "/api/nodes").json()
                time.sleep(0.5)
            # every board serves the committed parameters: the same predictions on every ISA
            urls = _node_urls(sp)
            x = np.random.default_rng(0).random((4, 64), dtype=np.float32)
            out = {n["arch"]: _infer(c, urls[n["node_id"]], x) for n in nodes}
            for arch in ("aarch64", "riscv64"):
                np.testing.assert_allclose(out[arch], out["x86_64"], rtol=1e-4, atol=1e-5, err_msg=arch)
        _screenshot_mixed_swarm(sp)
        logs = {p.name: p.read_text(errors="replace") for p in (work / "logs").glob("node-*.log")}
        assert len(logs) == 3
        # No member ended with other bits than its peers (the _agree fallback logs this line).
        assert not [k for k, v in logs.items() if "ended with differing parameters" in v], logs
    finally:
        assert sp.interrupt() in (0, 130), sp.output()
