"""One ``[[streams]]`` entry at work: MQTT messages -> readings -> windows -> the sample store.

The MQTT callback runs on paho's network thread and only appends to a bounded queue (a flood
drops and counts ``overflow`` instead of growing memory); one worker thread per stream parses,
windows (:mod:`edgenode.streams.window`) and stores every batch of windows in one transaction,
as unlabelled samples taken at the window's end (labels may come later: ``POST /v1/labels``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from edgenode.common import get_logger
from edgenode.errors import ConfigError
from edgenode.streams.config import Layout, StreamConfig, StreamFormat, Transform
from edgenode.streams.formats import FrameClock, parse_f32, parse_json, parse_senml
from edgenode.streams.window import Window, Windower, spectrum

__all__ = ["StreamRunner", "StreamCounters", "WindowSink"]

log = get_logger("streams")

# A sink stores windows: (input name, samples (n, *input shape), end times (n,)) -> None.
WindowSink = Callable[[str, np.ndarray, np.ndarray], object]


class StreamCounters(Protocol):
    def stream_readings(self, stream: str, outcome: str, n: int = 1) -> None: ...
    def stream_windows(self, stream: str, n: int) -> None: ...
    def stream_gaps(self, stream: str, n: int) -> None: ...


class StreamRunner:
    """Windows of one stream into ``sink``; ``on_message`` is the MQTT callback (inline-safe)."""

    def __init__(self, cfg: StreamConfig, input_name: str, input_shape: tuple[int, ...], sink: WindowSink,
                 counters: StreamCounters, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.input_name = input_name
        self.input_shape = tuple(input_shape)
        size = int(np.prod(self.input_shape, dtype=np.int64))
        if size != cfg.rows * cfg.channels:
            what = f"{cfg.rows} spectrum bins" if cfg.transform is Transform.SPECTRUM else f"{cfg.window}"
            raise ConfigError(f"[[streams]] {cfg.name}: a window holds {what} x {cfg.channels} = "
                            f"{cfg.rows * cfg.channels} values but input {input_name!r} holds {size} "
                            f"(shape {list(self.input_shape)})",
                            hint="make window x len(fields) (a spectrum: window // 2 x len(fields)) equal "
                            "the input's size")
        self._sink = sink
        self._counters = counters
        self._clock = clock
        self._windower = Windower(cfg.window_spec())
        self._channels = {f: i for i, f in enumerate(cfg.fields)}
        self._frames = FrameClock(cfg.sample_rate_hz, cfg.gap_tolerance_s)
        self._queue: queue.Queue[tuple[bytes, float] | None] = queue.Queue(maxsize=cfg.queue)
        self._thread: threading.Thread | None = None
        self._gaps_seen = 0
        self.idle = threading.Event()  # set while the queue is drained (tests and benchmarks await it)
        self.idle.set()

    def on_message(self, topic: str, payload: bytes) -> None:
        """Queue one message (never blocks paho's thread; a full queue drops and counts it)."""
        self.idle.clear()
        try:
            self._queue.put_nowait((bytes(payload), self._clock()))
        except queue.Full:
            self._counters.stream_readings(self.cfg.name, "overflow")
            if self._queue.empty():
                self.idle.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"stream-{self.cfg.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after what is queued (a partial window is dropped, as after a gap)."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < 256:  # one store transaction for what is already waiting
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._handle(batch)
                    return
                batch.append(nxt)
            self._handle(batch)
            if self._queue.empty():
                self.idle.set()

    def _handle(self, batch: list[tuple[bytes, float]]) -> None:
        windows: list[Window] = []
        for payload, arrival in batch:
            try:
                windows += self.process(payload, arrival)
            except Exception:  # noqa: BLE001 - a parser bug must not stop the stream
                log.exception("stream %s: a message could not be processed", self.cfg.name)
                self._counters.stream_readings(self.cfg.name, "malformed")
        if windows:
            self._store(windows)

    def process(self, payload: bytes, arrival: float) -> list[Window]:
        """Parse one payload, window its readings, count every outcome; returns the new windows."""
        name, cfg = self.cfg.name, self.cfg
        counts: dict[str, int] = {}
        windows: list[Window] = []
        if cfg.format is StreamFormat.F32:
            rows = parse_f32(payload, cfg.channels)
            if rows is None:
                counts["malformed"] = 1
            else:
                t0 = self._frames.start_of(len(rows), arrival)
                for i, r in enumerate(rows):
                    out, w = self._windower.push(t0 + i / cfg.sample_rate_hz, dict(enumerate(r.tolist())))
                    counts[out.value] = counts.get(out.value, 0) + 1
                    windows += w
        else:
            parsed = parse_senml(payload, self._channels, arrival) if cfg.format is StreamFormat.SENML \
                else parse_json(payload, self._channels, arrival, cfg.time_field)
            counts["malformed"], counts["unmapped"] = parsed.malformed, parsed.unmapped
            for t, values in parsed.readings:
                out, w = self._windower.push(t, values)
                counts[out.value] = counts.get(out.value, 0) + 1
                windows += w
        for outcome, n in counts.items():
            self._counters.stream_readings(name, outcome, n)
        gaps = self._windower.gaps - self._gaps_seen
        self._gaps_seen = self._windower.gaps
        self._counters.stream_gaps(name, gaps)
        return windows

    def _store(self, windows: list[Window]) -> None:
        values = np.stack([self._shape(w.values) for w in windows])
        ends = np.array([w.end_s for w in windows], np.float64)
        try:
            self._sink(self.input_name, values, ends)
        except Exception as exc:  # noqa: BLE001 - a full store (retention = reject), a failing disk
            log.warning("stream %s: %d windows not stored: %s", self.cfg.name, len(windows), exc)
            self._counters.stream_readings(self.cfg.name, "store_failed", len(windows) * self.cfg.window)
            return
        self._counters.stream_windows(self.cfg.name, len(windows))

    def _shape(self, values: np.ndarray) -> np.ndarray:
        if self.cfg.transform is Transform.SPECTRUM:
            values = spectrum(values)
        v = values if self.cfg.layout is Layout.TIME_MAJOR else values.T
        return np.ascontiguousarray(v).reshape(self.input_shape)

