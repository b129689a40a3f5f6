"""Over-the-air time for the demo model: ``python -m bench.ota [--runs N] [--json]``.

Real parts on this machine: Mosquitto, the fleet service with an image catalogue, and one board
(a device directory run by ``fractal boot``) whose node joins the swarm. Each run uploads a new
signed image of ``digits-mlp`` and rolls it out to the board (a one-node roll-out: the board is
the canary), then rolls it back. Timed from the ``POST`` to what the fleet sees in the node's
retained status: ``staged`` (downloaded, verified, flashed into the inactive slot), ``trial``
(the new slot's node is up, health check running), ``done`` (passed, marked good).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["run", "main"]

_TOKEN = "bench-ota"


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def _node_image(client: httpx.Client) -> dict | None:
    nodes = client.get("/api/nodes").json()["nodes"]
    return nodes[0]["image"] if nodes and nodes[0]["online"] else None


def _follow(client: httpx.Client, rid: str, t0: float) -> dict[str, float]:
    """Seconds from ``t0`` to each update phase the fleet saw, until the roll-out ends."""
    seen: dict[str, float] = {}
    while True:
        r = client.get(f"/api/rollouts/{rid}").json()
        for p in r["nodes"].values():
            seen.setdefault(p["phase"], time.perf_counter() - t0)
        if r["state"] != "running":
            if r["state"] != "done":
                raise RuntimeError(f"roll-out {rid} {r['state']}: {r['reason']}")
            seen["end"] = time.perf_counter() - t0
            return seen
        time.sleep(0.02)


def run(runs: int = 3, work: Path | None = None) -> dict[str, Any]:
    from api.fleet.settings import FleetSettings
    from api.fleet_app import create_fleet_app
    from api.serving import ServerThread
    from bench.host import machine_line
    from compiler import compile_model, host_preset_name, zoo
    from federation.broker import start_mosquitto
    from firmware.device import flash
    from firmware.image import build_image
    from firmware.keys import keygen

    work = Path(work or tempfile.mkdtemp(prefix="bench-ota-"))
    work.mkdir(parents=True, exist_ok=True)
    board = host_preset_name()
    art = compile_model(zoo.save("digits-mlp", work / "d.onnx"), target=board, out_dir=work / "digits-mlp",
                        progress=False)
    key, pub = keygen(work / "release.key")
    images = [build_image(art, board=board, key=key, out=work / f"d-{v}.img", version=v)
              for v in ["1.0.0"] + [f"1.{i + 1}.0" for i in range(runs)]]
    broker = start_mosquitto(workdir=work / "mosquitto")
    settings = FleetSettings(broker=broker.url, swarm="bench-ota", token=_TOKEN, tick_s=0.05,
                             images_dir=str(work / "catalogue"), image_keys=[str(pub)],
                             db=str(work / "fleet.sqlite"))
    srv = ServerThread(create_fleet_app(settings), lifespan="on", timeout_graceful_shutdown=1).start()
    client = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {_TOKEN}"}, timeout=30)
    device = work / "board-1"
    flash(images[0], device, [pub])
    (device / "data" / "node.extra.toml").write_text(
        f'broker = "{broker.url}"\nswarm = "bench-ota"\nheartbeat_s = 1.0\nkeepalive_s = 5\n')
    logf = open(work / "boot.log", "wb")  # noqa: SIM115 - closed below
    boot = subprocess.Popen([sys.executable, "-c", "from api.cli import main; main()", "boot", "--device",
                             str(device), "--port", str(_free_port())],
                            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    rows = []
    try:
        _wait(lambda: (i := _node_image(client)) and i["health"] == "passed", 300, "the board's first boot")
        for img in images[1:]:
            entry = client.post("/api/images", content=img.read_bytes()).json()
            t0 = time.perf_counter()
            ro = client.post("/api/rollouts", json={"image": entry["id"], "nodes": ["board-1"]}).json()
            out = _follow(client, ro["rollout_id"], t0)
            _wait(lambda: (i := _node_image(client)) and i["health"] == "passed", 60, "the new slot")
            t1 = time.perf_counter()
            rb = client.post("/api/image-rollback", json={"nodes": ["board-1"]}).json()
            back = _follow(client, rb["rollout_id"], t1)
            _wait(lambda: (i := _node_image(client)) and i["health"] == "passed", 60, "the old slot")
            # the next image must be newer than what runs: roll forward again is the next run's job
            rows.append({"version": entry["version"], "size": entry["size"],
                         "staged_s": round(out.get("rebooting", float("nan")), 2),
                         "trial_s": round(out.get("trial", float("nan")), 2),
                         "rollout_s": round(out["end"], 2), "rollback_s": round(back["end"], 2)})
    finally:
        client.close()
        if boot.poll() is None:
            os.killpg(boot.pid, signal.SIGTERM)
            try:
                boot.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(boot.pid, signal.SIGKILL)
        logf.close()
        srv.stop()
        broker.close()
    return {"model": "digits-mlp", "board": board, "machine": machine_line(), "runs": rows}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a new temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run(args.runs, args.work)
    if args.json:
        print(json.dumps(res))
        return 0
    print(res["machine"])
    print("| image | bytes | staged s | new slot up s | roll-out done s | rollback done s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in res["runs"]:
        print(f"| {r['version']} | {r['size']} | {r['staged_s']} | {r['trial_s']} | {r['rollout_s']} "
              f"| {r['rollback_s']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
