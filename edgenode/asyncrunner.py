"""A node's side of asynchronous rounds (``[training] sync = "async"``, PROTOCOL.md section 13).

No rounds: the node follows the fleet's signed global versions (:class:`federation.asyncagg.AsyncMember`),
commits every newer one whose bytes hash to its signed sha256 as its model version, and, when it
has samples, trains ``local_steps`` steps of its trainer from the version it holds and publishes
one update. Then it waits for a newer version before it trains again (one update per version,
hence per buffer). Training runs in the node process on a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from edgenode.rounds import RoundParts
from edgenode.store import Samples
from federation.asyncagg import AsyncMember
from federation.asyncbuf import Version
from federation.steps import BatchSampler, flatten, unflatten
from federation.transport import PubSubLink

__all__ = ["AsyncRunner"]

log = logging.getLogger(__name__)


class AsyncRunner:
    """Commits the swarm's versions and sends this node's updates (one thread)."""

    def __init__(self, parts: RoundParts, link: PubSubLink, *, poll_s: float = 1.0,
                 resend_s: float = 60.0) -> None:
        self.parts = parts
        self.node_id = parts.config.node_id
        self.poll_s = poll_s
        self.resend_s = resend_s  # no new version this long after our update: send it again
        self._like = [np.asarray(p) for p in parts.model.snapshot.params]
        size = sum(int(p.size) for p in self._like)
        self.member = AsyncMember(link, self.node_id, size, on_commit=self._commit)
        self.updates_sent = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = np.random.default_rng()

    def start(self) -> None:
        self.member.start()
        self._thread = threading.Thread(target=self._loop, name=f"async-{self.node_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.member.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def _commit(self, v: Version) -> None:
        model = self.parts.model
        if v.version < model.version or (v.version == model.version and v.sha256 == model.sha256):
            return
        try:
            model.commit(unflatten(v.params, self._like), v.version)
        except Exception as exc:  # noqa: BLE001 - a disk error must not kill the link's thread
            self.last_error = f"cannot commit async version {v.version}: {exc}"
            log.error("%s", self.last_error)
            return
        self.parts.params_changed()
        self.parts.publish_status()

    def _loop(self) -> None:
        last_base = -1
        trainer = self.parts.trainer
        sent_at = time.monotonic()
        while not self._stop.is_set():
            try:
                base = self.member.wait_version(last_base + 1, timeout=self.poll_s)
            except TimeoutError:
                if time.monotonic() - sent_at > self.resend_s:
                    self.member.resend()
                    sent_at = time.monotonic()
                continue
            if trainer is None:
                return  # an inference-only artifact follows the versions and never trains
            samples = self._samples()
            if len(samples) == 0:
                self._stop.wait(self.poll_s)
                continue
            try:
                trained = self._train(base, samples)
                self.member.publish_update(base, trained, len(samples))
            except Exception as exc:  # noqa: BLE001 - logged; the next version brings a new try
                self.last_error = f"async update from version {base.version} failed: {exc}"
                log.warning("%s", self.last_error)
            else:
                self.updates_sent += 1
                sent_at = time.monotonic()
                log.info("async update sent from version %d (%d samples)", base.version, len(samples))
            last_base = base.version

    def _samples(self) -> Samples:
        """The newest training samples within ``round_memory_mb``, as a round takes them."""
        p = self.parts
        tc = p.config.training
        budget = int(tc.round_memory_mb * 1024 * 1024)
        samples = p.store.snapshot(limit=max(1, budget // max(1, p.store.sample_bytes)), part="train",
                                   share=tc.validation_share,
                                   which="normal" if p.anomaly is not None else "known")
        return samples if p.anomaly is None else p.anomaly.as_targets(samples)

    def _train(self, base: Version, samples: Samples) -> np.ndarray:
        tc = self.parts.config.training
        trainer = self.parts.trainer
        assert trainer is not None
        params = unflatten(base.params, self._like)
        state = trainer.init_state(params)
        sampler = BatchSampler(samples, int(trainer.batch), self._rng)
        for _ in range(tc.local_steps):
            if self._stop.is_set():
                break
            inputs, y = sampler.next()
            (x,) = inputs.values()  # training modules take one input tensor
            _, grads = trainer.loss_and_grad(params, x, y)
            params, state = trainer.apply(params, grads, state, lr=tc.lr)
        return flatten(params)
