"""StreamRunner without a broker: bounded queue under a flood, formats into the sink, size checks."""

from __future__ import annotations

import collections
import json
import struct

import numpy as np
import pytest

from edgenode.errors import ConfigError
from edgenode.streams.config import StreamConfig
from edgenode.streams.runner import StreamRunner


class Counts:
    def __init__(self) -> None:
        self.c: collections.Counter[str] = collections.Counter()

    def stream_readings(self, stream: str, outcome: str, n: int = 1) -> None:
        self.c[outcome] += n

    def stream_windows(self, stream: str, n: int) -> None:
        self.c["windows"] += n

    def stream_gaps(self, stream: str, n: int) -> None:
        self.c["gaps"] += n


def cfg(**kw) -> StreamConfig:
    base = {"name": "s", "topic": "sensors/a", "fields": ["a", "b"], "sample_rate_hz": 10.0, "window": 4}
    return StreamConfig.model_validate({**base, **kw})


def test_a_flood_is_dropped_and_counted_not_queued() -> None:
    counts, stored = Counts(), []
    r = StreamRunner(cfg(queue=8), "x", (8,), lambda n, v, t: stored.append(v), counts)
    for _ in range(10_000):  # the worker is not started: nothing drains the queue
        r.on_message("sensors/a", b"[]")
    assert r._queue.qsize() == 8 and counts.c["overflow"] == 10_000 - 8
    r.start()
    assert r.idle.wait(10)
    r.stop()
    assert counts.c["malformed"] == 8


def test_f32_and_json_windows_reach_the_sink_shaped_like_the_input() -> None:
    counts, stored = Counts(), []
    r = StreamRunner(cfg(format="f32", layout="channel-major"), "x", (2, 4),
                     lambda n, v, t: stored.append((n, v, t)), counts)
    frame = struct.pack("<8f", 0, 10, 1, 11, 2, 12, 3, 13)  # rows (a, b) x 4
    r.start()
    r.on_message("sensors/a", frame)
    r.on_message("sensors/a", frame[:5])  # not whole float32 rows
    assert r.idle.wait(10)
    r.stop()
    (name, v, t), = stored
    assert name == "x" and v.shape == (1, 2, 4)
    np.testing.assert_array_equal(v[0], [[0, 1, 2, 3], [10, 11, 12, 13]])
    assert counts.c["windows"] == 1 and counts.c["malformed"] == 1 and counts.c["accepted"] == 4
    counts2, stored2 = Counts(), []
    r2 = StreamRunner(cfg(format="json", mean=[1.0, 0.0], std=[1.0, 2.0]), "x", (8,),
                      lambda n, v, t: stored2.append(v), counts2)
    msgs = [json.dumps({"t": 100 + i / 10, "a": i, "b": 2 * i, "c": 0}).encode() for i in range(4)]
    for m in msgs:
        r2.process(m, 0.0)
    assert counts2.c["unmapped"] == 4
    w = r2.process(json.dumps({"t": 100.4, "a": 4, "b": 8}).encode(), 0.0)
    assert len(w) == 0  # the window 0..3 was emitted at slot 3 already
    r2 = StreamRunner(cfg(format="json", mean=[1.0, 0.0], std=[1.0, 2.0]), "x", (8,),
                      lambda n, v, t: stored2.append(v), counts2)
    got = [r2.process(m, 0.0) for m in msgs][-1]
    np.testing.assert_array_equal(got[0].values, [[-1, 0], [0, 1], [1, 2], [2, 3]])


def test_window_must_fill_the_input_and_topics_are_checked() -> None:
    with pytest.raises(ConfigError, match="window holds 4 x 2 = 8 values but input 'x' holds 64"):
        StreamRunner(cfg(), "x", (64,), lambda *a: None, Counts())
    for topic in ("fractal/v1/x/cmd", "#", "+/a", "sensors/#/a", "sensors/a+"):
        with pytest.raises(ValueError, match="topic"):
            cfg(topic=topic)
    with pytest.raises(ValueError, match="std"):
        cfg(std=[1.0, 0.0])


def test_spectrum_windows_match_numpy_and_are_sized_in_bins() -> None:
    from edgenode.streams.window import spectrum

    n, rate = 64, 64.0
    t = np.arange(n) / rate
    rows = np.stack([2.0 * np.sin(2 * np.pi * 8 * t), 0.5 * np.cos(2 * np.pi * 20 * t)], axis=1)
    s = spectrum(rows)
    assert s.shape == (32, 2) and s.dtype == np.float32
    assert s[:, 0].argmax() == 7 and s[:, 1].argmax() == 19  # row i is (i + 1) x rate / n Hz
    assert s[7, 0] == pytest.approx(2.0, rel=1e-3) and s[19, 1] == pytest.approx(0.5, rel=1e-3)
    hann = np.hanning(n)[:, None]
    ref = np.abs(np.fft.rfft(rows * hann, axis=0))[1:33] * 2 / hann.sum()
    np.testing.assert_allclose(s, ref, rtol=1e-5, atol=1e-6)

    with pytest.raises(ConfigError, match="32 spectrum bins x 2"):
        StreamRunner(cfg(window=64, transform="spectrum", sample_rate_hz=rate), "x", (128,), lambda *a: None,
                     Counts())
    counts, stored = Counts(), []
    r = StreamRunner(cfg(window=64, transform="spectrum", sample_rate_hz=rate, format="f32"), "x", (64,),
                     lambda n_, v, t_: stored.append(v), counts)
    r.start()
    r.on_message("sensors/a", rows.astype("<f4").tobytes())
    assert r.idle.wait(10)
    r.stop()
    (v,), = stored
    np.testing.assert_allclose(v.reshape(32, 2), s, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="at least 4"):
        cfg(window=3, transform="spectrum")
