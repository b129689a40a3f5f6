"""Ingestion of a sensor stream: SenML readings from Mosquitto into stored windows by one node.

    python -m bench.ingest ARTIFACT_DIR [--packs 2000] [--per-pack 50]

A real Mosquitto, a real EdgeNode with one ``[[streams]]`` (2 channels at 1 kHz, windows of 32
readings: the digits model's 64 inputs), and a publisher sending ``--packs`` SenML packs of
``--per-pack`` readings back to back (QoS 1). Reports readings/s from the first publish until
every window is stored, and the readings lost (not accepted) on the way. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from bench.host import machine

__all__ = ["run"]


def _pack(p: int, per: int, rate: float) -> bytes:
    recs: list[dict[str, Any]] = [{"bn": "", "bt": 1.7e9 + p * per / rate}]
    for i in range(per):
        recs += [{"n": "ax", "v": float(i), "t": i / rate}, {"n": "ay", "v": -float(i), "t": i / rate}]
    return json.dumps(recs).encode()


def run(artifact: str, packs: int = 2000, per: int = 50) -> dict[str, Any]:
    from edgenode.config import NodeConfig
    from edgenode.node import EdgeNode
    from federation.broker import start_mosquitto
    from federation.mqtt import MqttLink

    rate, window = 1000.0, 32
    tmp = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    broker = start_mosquitto(workdir=tmp / "mq")
    node = pub = None
    try:
        cfg = NodeConfig.from_dict({
            "node_id": "ingest", "artifact": artifact, "data_dir": str(tmp / "data"), "broker": broker.url,
            "training": {"isolation": "thread"}, "store": {"max_samples": 1_000_000},
            "streams": [{"name": "s", "topic": "sensors/m1", "fields": ["ax", "ay"], "sample_rate_hz": rate,
                         "window": window, "queue": 1_000_000}]})
        node = EdgeNode(cfg)
        node.start()
        pub = MqttLink(broker.url, client_id="bench-pub")
        payloads = [_pack(p, per, rate) for p in range(packs)]
        want = packs * per // window
        t0 = time.perf_counter()
        for m in payloads:
            pub.publish("sensors/m1", m, qos=1)
        deadline = time.monotonic() + 600
        while node.store.count < want and time.monotonic() < deadline:
            time.sleep(0.02)
        dt = time.perf_counter() - t0
        text = generate_latest(node.registry).decode()
        accepted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("fractal_node_stream_readings_total{outcome=\"accepted\""))
        readings = packs * per
        return {"bench": "ingest", "machine": machine(), "readings": readings, "seconds": round(dt, 3),
                "readings_per_s": round(readings / dt), "windows": node.store.count, "windows_expected": want,
                "readings_lost": int(readings - accepted)}
    finally:
        if pub is not None:
            pub.close()
        if node is not None:
            node.stop()
        broker.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--packs", type=int, default=2000)
    ap.add_argument("--per-pack", type=int, default=50)
    a = ap.parse_args()
    print(json.dumps(run(a.artifact, a.packs, a.per_pack)))


if __name__ == "__main__":
    main()
