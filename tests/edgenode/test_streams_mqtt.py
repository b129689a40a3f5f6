"""Streams end to end: a real `fractal node` process subscribed to SenML readings on Mosquitto
stores windows (edgenode/streams/); gaps, duplicates, out-of-order and malformed readings are
counted in /metrics."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request

import numpy as np
import pytest

from edgenode.store import SampleSpec, SampleStore
from tests.edgenode.test_cli_node import free_port, get, start_cli_node

RATE = 100.0
T0 = 1.7e9  # absolute SenML base time (s)


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(fractal_node_stream_\w+)\{([^}]*)\} ([0-9.e+]+)$', line)
        if m:
            out[m.group(1) + "{" + m.group(2) + "}"] = float(m.group(3))
    return out


def pack(slots: list[int]) -> bytes:
    """A SenML pack: ax = slot, ay = -slot at each slot's time."""
    recs: list[dict] = [{"bn": "m1:", "bt": T0}]
    for s in slots:
        recs += [{"n": "ax", "v": float(s), "t": s / RATE}, {"n": "ay", "v": -float(s), "t": s / RATE}]
    return json.dumps(recs).encode()


@pytest.mark.slow  # a node process's start (TVM import) under a loaded machine: 20-40 s
def test_node_process_stores_windows_from_senml(tmp_path, digits_artifact, mosquitto, swarm_id,
                                                mqtt_link_factory):
    port = free_port()
    topic = f"sensors/{swarm_id}/m1"
    cfg = tmp_path / "NODE.toml"
    cfg.write_text(f"""node_id = "s1"
artifact = "{digits_artifact}"
port = {port}
data_dir = "data"
broker = "{mosquitto.url}"
swarm = "{swarm_id}"

[[streams]]
name = "vib"
topic = "{topic}"
format = "senml"
fields = ["m1:ax", "m1:ay"]
sample_rate_hz = {RATE}
window = 32
gap_tolerance_s = 0.02
max_delay_s = 0.05
""")
    proc = start_cli_node(cfg, port)
    try:
        sensor = mqtt_link_factory(mosquitto, "sensor")
        a = list(range(0, 80))  # windows 0-31, 32-63; 64-79 is cut by the gap
        b = list(range(200, 270))  # windows 200-231, 232-263 (264.. not final: no window)
        chunks = [a[i:i + 8] for i in range(0, len(a), 8)] + [b[i:i + 8] for i in range(0, len(b), 8)]
        c3 = chunks[3]  # out of order inside a pack, within max_delay_s: 25, 24, 27, 26, ...
        chunks[3] = [c3[i ^ 1] for i in range(len(c3))]
        msgs = [pack(c) for c in chunks]
        msgs.insert(5, msgs[4])  # a duplicated pack
        msgs.insert(2, b'[{"n": "m1:ax", "v": "loud"}]')  # malformed
        msgs.insert(3, b"\xff not json")
        for m in msgs:
            sensor.publish(topic, m, qos=1)
        deadline = time.monotonic() + 30
        want = {'fractal_node_stream_windows_total{stream="vib"}': 4.0}
        while metrics(port).get('fractal_node_stream_windows_total{stream="vib"}') != 4.0:
            assert time.monotonic() < deadline, (metrics(port), want)
            time.sleep(0.1)
        m = metrics(port)
        assert m['fractal_node_stream_gaps_total{stream="vib"}'] == 1
        # the repeated pack (slots 32..39) came when 32..34 were final already: late, the rest duplicate
        assert m['fractal_node_stream_readings_total{outcome="duplicate",stream="vib"}'] == 5
        assert m['fractal_node_stream_readings_total{outcome="late",stream="vib"}'] == 3
        assert m['fractal_node_stream_readings_total{outcome="malformed",stream="vib"}'] == 2
        assert m['fractal_node_stream_readings_total{outcome="out_of_order",stream="vib"}'] == 4
        assert m['fractal_node_stream_readings_total{outcome="accepted",stream="vib"}'] + \
            m['fractal_node_stream_readings_total{outcome="out_of_order",stream="vib"}'] == len(a) + len(b)
        assert get(f"http://127.0.0.1:{port}/v1/node")["samples"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    store = SampleStore(tmp_path / "data" / "samples.db", SampleSpec((("x", (64,), "float32"),), (), "int64"))
    got = store.snapshot()
    store.close()
    assert got.known is not None and not got.known.any()  # stream samples come without labels
    for row, start in zip(got.inputs["x"], (0, 32, 200, 232), strict=True):
        slots = np.arange(start, start + 32, dtype=np.float32)
        np.testing.assert_array_equal(row, np.stack([slots, -slots], axis=1).ravel())
