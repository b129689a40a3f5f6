"""Ingestion of a sensor stream: SenML readings from Mosquitto into stored windows by one node.

    python -m bench.ingest ARTIFACT_DIR [--packs 2000] [--per-pack 50]
    python -m bench.ingest ARTIFACT_DIR --latency [--rate 2000] [--duration 12] [--clients 1]

A real Mosquitto, a real EdgeNode with one ``[[streams]]`` (2 channels at 1 kHz, windows of 32
readings: the digits model's 64 inputs), and a publisher sending ``--packs`` SenML packs of
``--per-pack`` readings back to back (QoS 1). Reports readings/s from the first publish until
every window is stored, and the readings lost (not accepted) on the way. One JSON object on stdout.

``--latency``: what a stream costs inference. One node process (``bench.node_proc``, HTTP API)
subscribed to the stream; closed-loop ``/v2/models/{name}/infer`` clients while the stream is
silent and while a publisher sends ``--rate`` readings/s, in alternating segments pooled per mode
(as ``fractal bench serve`` pairs idle and training), so load from other jobs hits both alike.
Reports both latency summaries and ``p99_ratio`` (streaming / silent).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from bench.host import machine

__all__ = ["run", "latency"]

AB_SEGMENTS = 6  # silent/streaming segments in --latency (each duration / 2 / AB_SEGMENTS)


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


class _Publisher(threading.Thread):
    """Publishes packs of ``per`` readings on ``topic`` at ``rate`` readings/s while switched on."""

    def __init__(self, link: Any, topic: str, rate: float, per: int = 50) -> None:
        super().__init__(name="bench-publisher", daemon=True)
        self.link, self.topic, self.rate, self.per = link, topic, rate, per
        self.on, self.halt = threading.Event(), threading.Event()
        self.sent = 0

    def run(self) -> None:
        period, p = self.per / self.rate, 0
        while not self.halt.is_set():
            if not self.on.wait(0.05):
                continue
            t0, q = time.perf_counter(), 0  # paced from the start of this segment
            while self.on.is_set() and not self.halt.is_set():
                self.link.publish(self.topic, _pack(p, self.per, 1000.0), qos=1)
                p, q = p + 1, q + 1
                self.sent += self.per
                lag = t0 + q * period - time.perf_counter()
                if lag > 0:
                    time.sleep(lag)
                elif lag < -1.0:  # fell behind by a second: no catch-up burst
                    t0, q = time.perf_counter(), 0


def latency(artifact: str, rate: float = 2000.0, duration: float = 12.0, clients: int = 1) -> dict[str, Any]:
    import numpy as np

    from bench.loadgen import http_caller, run_closed_loop, summarize
    from bench.serve import _node_process
    from federation.broker import start_mosquitto
    from federation.mqtt import MqttLink
    from fractal.oip import json_tensor

    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    name = str(manifest["name"])
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    body = json.dumps({"inputs": [json_tensor(str(manifest["inputs"][0]["name"]), x)]}).encode()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ingest-latency-"))
    broker = start_mosquitto(workdir=tmp / "mq")
    pooled: dict[str, list[float]] = {"silent": [], "streaming": []}
    seg = duration / 2 / AB_SEGMENTS
    try:
        with _node_process(Path(artifact), tmp / "data", False, None,
                           extra=("--broker", broker.url, "--stream-topic", "sensors/m1")) as (port, _):
            pub_link = MqttLink(broker.url, client_id="bench-pub")
            pub = _Publisher(pub_link, "sensors/m1", rate)
            pub.start()
            call = http_caller("127.0.0.1", port, f"/v2/models/{name}/infer", body)
            t_stream = 0.0
            try:
                for _ in range(AB_SEGMENTS):
                    run_closed_loop(call, clients=clients, duration_s=seg, keep=pooled["silent"])
                    t0 = time.perf_counter()
                    pub.on.set()
                    run_closed_loop(call, clients=clients, duration_s=seg, keep=pooled["streaming"])
                    pub.on.clear()
                    t_stream += time.perf_counter() - t0
            finally:
                pub.halt.set()
                pub.join(5)
                pub_link.close()
        silent, streaming = (summarize(pooled[k], duration / 2) for k in ("silent", "streaming"))
        return {"bench": "ingest-latency", "machine": machine(), "model": name, "clients": clients,
                "rate_asked": rate, "readings_sent_per_s": round(pub.sent / t_stream) if t_stream else 0,
                "silent": silent, "streaming": streaming,
                "p99_ratio": round(streaming["p99_ms"] / silent["p99_ms"], 3)}
    finally:
        broker.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--packs", type=int, default=2000)
    ap.add_argument("--per-pack", type=int, default=50)
    ap.add_argument("--latency", action="store_true",
                    help="inference latency with the stream silent vs flowing (p99 ratio)")
    ap.add_argument("--rate", type=float, default=2000.0, help="--latency: readings/s while streaming")
    ap.add_argument("--duration", type=float, default=12.0, help="--latency: seconds of requests in all")
    ap.add_argument("--clients", type=int, default=1, help="--latency: concurrent HTTP clients")
    a = ap.parse_args()
    if a.latency:
        print(json.dumps(latency(a.artifact, a.rate, a.duration, a.clients)))
    else:
        print(json.dumps(run(a.artifact, a.packs, a.per_pack)))


if __name__ == "__main__":
    main()
