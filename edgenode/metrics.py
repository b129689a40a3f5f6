"""The node's own counters: plain numbers for ``info()``/tests and a Prometheus registry for /metrics."""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["NodeMetrics"]


class NodeMetrics:
    """Counters of one node. Read the attributes, or export :attr:`registry` (own registry, so
    several nodes in one test process never collide in the global default registry)."""

    def __init__(self, sample_count: Callable[[], int], model_version: Callable[[], int]) -> None:
        self._lock = threading.Lock()
        self.inferences = 0
        self.samples_added = 0
        self.rounds_ok = 0
        self.rounds_failed = 0
        self.commands_rejected = 0
        self.last_loss: float | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._inf = Counter("fractal_node_inferences", "Inference requests served", registry=r)
        self._inf_s = Histogram("fractal_node_inference_seconds", "Model execution time per request",
                                buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0),
                                registry=r)
        self._samples = Counter("fractal_node_samples_received", "Training samples stored", registry=r)
        self._rounds = Counter("fractal_node_rounds", "Training rounds by result", ["result"], registry=r)
        self._rejected = Counter("fractal_node_commands_rejected", "Malformed or refused MQTT commands",
                                 registry=r)
        self._loss = Gauge("fractal_node_last_loss", "Loss of the last training step", registry=r)
        self._training = Gauge("fractal_node_training", "1 while a round runs", registry=r)
        self._stream_readings = Counter(
            "fractal_node_stream_readings", "Sensor readings from [[streams]] by outcome (accepted, "
            "out_of_order, late, duplicate, malformed, unmapped, overflow, store_failed)",
            ["stream", "outcome"], registry=r)
        self._stream_windows = Counter("fractal_node_stream_windows", "Windows stored from [[streams]]",
                                       ["stream"], registry=r)
        self._stream_gaps = Counter("fractal_node_stream_gaps", "Windows restarted after a gap longer "
                                    "than the stream's gap_tolerance_s", ["stream"], registry=r)
        Gauge("fractal_node_samples", "Samples in the store", registry=r).set_function(sample_count)
        Gauge("fractal_node_model_version", "Committed parameter version",
              registry=r).set_function(model_version)
        Gauge("fractal_node_gc_frozen_objects", "Objects of this process kept out of the cyclic GC's "
              "reach since start-up (gc.freeze)", registry=r).set_function(gc.get_freeze_count)

    def inference(self, seconds: float) -> None:
        with self._lock:
            self.inferences += 1
        self._inf.inc()
        self._inf_s.observe(seconds)

    def samples(self, n: int) -> None:
        with self._lock:
            self.samples_added += n
        self._samples.inc(n)

    def round_finished(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.rounds_ok += 1
            else:
                self.rounds_failed += 1
        self._rounds.labels(result="ok" if ok else "failed").inc()

    def rejected(self) -> None:
        with self._lock:
            self.commands_rejected += 1
        self._rejected.inc()

    def loss(self, value: float) -> None:
        if math.isfinite(value):
            self.last_loss = float(value)
            self._loss.set(value)

    def training(self, on: bool) -> None:
        self._training.set(1 if on else 0)

    def stream_readings(self, stream: str, outcome: str, n: int = 1) -> None:
        if n:
            self._stream_readings.labels(stream=stream, outcome=outcome).inc(n)

    def stream_windows(self, stream: str, n: int) -> None:
        if n:
            self._stream_windows.labels(stream=stream).inc(n)

    def stream_gaps(self, stream: str, n: int) -> None:
        if n:
            self._stream_gaps.labels(stream=stream).inc(n)

    def snapshot(self) -> dict[str, float | int | None]:
        """The plain counters as a dict."""
        return {"inferences": self.inferences, "samples_added": self.samples_added,
                "rounds_ok": self.rounds_ok, "rounds_failed": self.rounds_failed,
                "commands_rejected": self.commands_rejected, "last_loss": self.last_loss}
