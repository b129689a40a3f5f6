"""Cost of a signed swarm on a whole training round (issue 12's goal: under 5% of round time).

    python -m api.bench.signed_round [--nodes 3] [--steps 100] [--repeats 3] [--outlier-factor F]

N real ``EdgeNode``s (digits-mlp with its TVM training module, the demo's cached artifact) in
one process, each with its own MQTT connection to a Mosquitto the benchmark starts; the same
rounds run alternately on an unsigned swarm and on a signed one (keys from ``deploy.keys``:
ed25519 statuses/events/commands, AES-GMAC ring frames). Reports the median round time of each
(command published -> every node's DONE event), the median CPU seconds this process spent in it
(every node's MQTT, MAC and ring work; not the training steps, which run in worker processes) and the
overheads. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from api.bench.host import machine

__all__ = ["run"]


def _swarm(tmp: Path, art_dir: Path, art: Any, broker_url: str, swarm: str, n: int, signed: bool):
    from sklearn.datasets import load_digits

    from deploy.keys import provision
    from edgenode.config import NodeConfig
    from edgenode.node import EdgeNode
    from federation.mqtt import MqttLink
    from federation.signed import load_identity

    ids = [f"{swarm}-n{k}" for k in range(n)]
    keys = tmp / swarm / "keys"
    if signed:
        provision(keys, swarm, ids)
    d = load_digits()
    x, y = (d.data / 16.0).astype("float32"), d.target.astype("int64")
    nodes = []
    for k, i in enumerate(ids):
        extra: dict[str, Any] = {}
        if signed:
            extra = {"key_file": keys / f"keys/{i}.key", "keyring_file": keys / "keyring.json"}
        cfg = NodeConfig.from_dict({"node_id": i, "artifact": str(art_dir), "data_dir": str(tmp / swarm / i),
                                    "broker": broker_url, "swarm": swarm, "heartbeat_s": 5.0, **extra})
        node = EdgeNode(cfg, artifact=art)
        node.start()
        node.add_samples({"x": x[k::n]}, y[k::n])
        nodes.append(node)
    link = MqttLink(broker_url, swarm=swarm, client_id=f"{swarm}-fleet")
    fleet: Any = link
    if signed:
        fleet = load_identity(keys / "keys/fleet.key", keys / "keyring.json").link(link)
    return ids, nodes, fleet, link


def _round(ids, nodes, fleet, swarm: str, rid: str, steps: int,
           outlier_factor: float | None = None) -> tuple[float, float]:
    from federation import topics
    from federation.messages import EventKind, RoundCommand

    done = threading.Event()
    seen: set[str] = set()

    def listen(ev) -> None:
        if ev.round_id == rid and ev.kind in (EventKind.DONE, EventKind.FAILED):
            if ev.kind == EventKind.FAILED:
                raise SystemExit(f"round {rid} failed: {ev.reason}")
            seen.add(ev.node_id)
            if len(seen) == len(ids):
                done.set()

    for nd in nodes:
        nd.add_event_listener(listen)
    c0, t0 = time.process_time(), time.perf_counter()
    fleet.publish(topics.command(swarm), RoundCommand(round_id=rid, steps=steps, lr=0.05, participants=ids,
                                                      step_timeout_s=30, outlier_factor=outlier_factor))
    if not done.wait(300):
        raise SystemExit(f"round {rid} did not finish")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    for nd in nodes:  # DONE is emitted just before the worker thread ends: let it end
        nd.wait_idle(30)
    return elapsed, cpu


def run(nodes: int = 3, steps: int = 100, repeats: int = 3,
        outlier_factor: float | None = None) -> dict[str, Any]:
    """``outlier_factor``: the rounds' screening (federation/robust.py); None = the nodes' default."""
    from compiler import host_preset_name, load_artifact
    from deploy.swarm import demo_artifact
    from federation.broker import start_mosquitto

    with contextlib.redirect_stdout(sys.stderr):  # its progress lines: stdout carries only the JSON
        art_dir = demo_artifact(Path(".cache"), host_preset_name()).resolve()
    art = load_artifact(art_dir)
    broker = start_mosquitto()
    out: dict[str, list[float]] = {"plain": [], "signed": []}
    cpu: dict[str, list[float]] = {"plain": [], "signed": []}
    try:
        with tempfile.TemporaryDirectory(prefix="fractal-signed-bench-") as tmp:
            swarms = {kind: _swarm(Path(tmp), art_dir, art, broker.url, f"b{kind}", nodes, kind == "signed")
                      for kind in ("plain", "signed")}
            for kind in ("plain", "signed"):  # warm-up round each (TVM, connections)
                ids, nds, fleet, _ = swarms[kind]
                _round(ids, nds, fleet, f"b{kind}", f"{kind}-warm", 5)
            for rep in range(repeats):
                for kind in (("plain", "signed") if rep % 2 == 0 else ("signed", "plain")):
                    ids, nds, fleet, _ = swarms[kind]
                    wall, c = _round(ids, nds, fleet, f"b{kind}", f"{kind}-{rep}", steps, outlier_factor)
                    out[kind].append(wall)
                    cpu[kind].append(c)
            for _ids, nds, _, link in swarms.values():
                for nd in nds:
                    nd.stop()
                link.close()
    finally:
        broker.close()
    plain, signed = statistics.median(out["plain"]), statistics.median(out["signed"])
    pcpu, scpu = statistics.median(cpu["plain"]), statistics.median(cpu["signed"])
    return {"nodes": nodes, "steps": steps, "repeats": repeats, "outlier_factor": outlier_factor,
            "plain_round_s": round(plain, 3),
            "signed_round_s": round(signed, 3), "overhead": round(signed / plain - 1, 4),
            "plain_runs_s": [round(v, 3) for v in out["plain"]],
            "signed_runs_s": [round(v, 3) for v in out["signed"]],
            "plain_cpu_s": round(pcpu, 3), "signed_cpu_s": round(scpu, 3),
            "cpu_overhead": round(scpu / pcpu - 1, 4) if pcpu else None,
            "load_average": [round(v, 2) for v in os.getloadavg()], "machine": machine()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--outlier-factor", type=float, default=None, help="0 = no screening; default: the nodes'")
    a = p.parse_args()
    print(json.dumps(run(a.nodes, a.steps, a.repeats, a.outlier_factor)))


if __name__ == "__main__":
    main()
