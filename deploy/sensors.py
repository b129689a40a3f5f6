"""Simulated sensor streams for the swarm demo: sklearn's digits split unevenly and non-IID.

Each node gets its own shard (sizes roughly N:N-1:...:1, and every node sees mostly "its"
classes), and a feeder thread per node POSTs the shard in small batches to the node's
``/v1/samples`` at a steady rate, like a sensor would.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np

__all__ = ["Shard", "digits_shards", "Feeder"]

log = logging.getLogger("fractal.swarm.feed")


@dataclass
class Shard:
    x: np.ndarray  # float32 [n, 64] in [0, 1]
    y: np.ndarray  # int64 [n]

    def class_counts(self) -> list[int]:
        return np.bincount(self.y, minlength=10).tolist()


def digits_shards(n: int, *, seed: int = 0, skew: float = 4.0) -> list[Shard]:
    """Split sklearn's 1,797 digits over ``n`` nodes: uneven sizes, class-skewed (non-IID).

    Node ``i`` draws each sample with weight ``(n - i)`` times ``skew`` when the digit's class
    is ``i mod n`` (its "home" classes); so node 0 is the largest and each node is biased.
    """
    from sklearn.datasets import load_digits

    if n < 1:
        raise ValueError("need at least one shard")
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    size_w = np.arange(n, 0, -1, dtype=np.float64)
    owner = np.empty(len(y), dtype=np.int64)
    for k, label in enumerate(y):
        w = size_w * np.where(np.arange(n) == label % n, skew, 1.0)
        owner[k] = rng.choice(n, p=w / w.sum())
    shards = []
    for i in range(n):
        idx = rng.permutation(np.flatnonzero(owner == i))
        shards.append(Shard(x[idx], y[idx]))
    return shards


class Feeder(threading.Thread):
    """POSTs a shard to ``{url}/v1/samples`` at ``rate`` samples/s until done or stopped."""

    def __init__(self, url: str, shard: Shard, *, input_name: str = "x", token: str | None = None,
                 rate: float = 40.0, batch_interval_s: float = 0.5, ready_timeout_s: float = 120.0) -> None:
        super().__init__(name=f"feeder:{url}", daemon=True)
        self.url = url.rstrip("/")
        self.shard = shard
        self.input_name = input_name
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.batch = max(1, round(rate * batch_interval_s))
        self.interval = batch_interval_s
        self.ready_timeout = ready_timeout_s
        self.sent = 0
        self.error: str | None = None
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=10) as client:
            if not self._wait_ready(client):
                if not self._halt.is_set():
                    self.error = f"{self.url} not ready after {self.ready_timeout:.0f}s"
                return
            n = len(self.shard.y)
            while self.sent < n and not self._halt.is_set():
                hi = min(n, self.sent + self.batch)
                body = {"inputs": {self.input_name: self.shard.x[self.sent:hi].tolist()},
                        "labels": self.shard.y[self.sent:hi].tolist()}
                try:
                    r = client.post("/v1/samples", json=body)
                except httpx.HTTPError as exc:  # node restarting: retry the same batch
                    log.debug("feeder %s: %s", self.url, exc)
                    self._halt.wait(1.0)
                    continue
                if r.status_code >= 400:
                    self.error = f"{self.url} refused samples: {r.status_code} {r.text[:200]}"
                    log.warning(self.error)
                    return
                self.sent = hi
                self._halt.wait(self.interval)

    def _wait_ready(self, client: httpx.Client) -> bool:
        deadline = time.monotonic() + self.ready_timeout
        while not self._halt.is_set() and time.monotonic() < deadline:
            try:
                if client.get("/v2/health/ready").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            self._halt.wait(0.3)
        return False
