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
