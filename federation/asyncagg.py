"""Buffered asynchronous aggregation over a signed pub/sub link: the aggregator and a member.

The pure rules (formats, admission, weights) are in :mod:`federation.asyncbuf`; this module moves
their bytes over any :class:`~federation.transport.PubSubLink` (in practice a
:class:`~federation.signed.SignedLink` on MQTT, so every update and version is signed by its
sender and verified by its receivers before it gets here):

* :class:`Aggregator` (the fleet service holds it, PROTOCOL.md section 13) subscribes to
  ``async/up/+``, admits updates into its :class:`~federation.asyncbuf.Buffer` and publishes each
  new version, retained, on ``async/version``. It re-publishes the current version every
  ``refresh_s`` so that a member coming online after the signature's freshness window (60 s)
  still gets a version it can verify.
* :class:`AsyncMember` (a node) follows ``async/version``, commits every newer version whose
  bytes hash to its signed sha256, and publishes its update from the version it holds.

A refused update is counted and logged, never raised into the transport: nothing a member sends
can stall the aggregator.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from federation import topics
from federation.asyncbuf import (
    HEADER_MAX,
    Buffer,
    Refusal,
    Refused,
    Update,
    Version,
    decode_version,
    encode_update,
    encode_version,
    params_sha256,
)
from federation.broker import MESSAGE_SIZE_LIMIT
from federation.errors import FederationError
from federation.transport import PubSubLink, Subscription
from fractal.files import atomic_write

__all__ = ["Aggregator", "AsyncMember", "VersionRecord", "VersionStore", "FileVersionStore",
           "initial_version", "fits_one_message"]

log = logging.getLogger(__name__)

HISTORY_MAX = 1000  # versions the aggregator remembers for the fleet API


def fits_one_message(size: int) -> bool:
    """Whether a version of ``size`` parameters fits one MQTT message (with header and envelope)."""
    return 4 * size + HEADER_MAX + 4096 <= MESSAGE_SIZE_LIMIT


class VersionStore(Protocol):
    """Where the aggregator keeps its current version (an encoded :class:`Version`) across restarts."""

    def load(self) -> bytes | None: ...

    def save(self, data: bytes) -> None: ...


class FileVersionStore:
    """A file, replaced atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> bytes | None:
        return self.path.read_bytes() if self.path.exists() else None

    def save(self, data: bytes) -> None:
        atomic_write(self.path, data)


def _load_state(store: VersionStore | None, size: int) -> Version | None:
    if store is None:
        return None
    try:
        data = store.load()
        return None if data is None else decode_version(data, size=size)
    except (OSError, Refused) as exc:
        log.error("async: ignoring the saved version: %s", exc)
        return None


def initial_version(params: np.ndarray) -> Version:
    """Version 0: the parameters every member's image shipped."""
    p = np.ascontiguousarray(params, np.float32).ravel()
    return Version(0, params_sha256(p), p)


@dataclass(frozen=True)
class VersionRecord:
    """What the fleet API shows of one version (no parameters)."""

    version: int
    sha256: str
    at: float  # unix time it was published
    contributors: list[dict]
    excluded: dict[str, str]


class Aggregator:
    """Buffers signed updates and publishes each new global version (thread-safe)."""

    def __init__(self, link: PubSubLink, initial: Version, *, buffer: int, max_staleness: int,
                 outlier_factor: float = 10.0, server_lr: float = 1.0, refresh_s: float = 20.0,
                 on_version: Callable[[Version], None] | None = None,
                 on_change: Callable[[], None] | None = None,
                 store: VersionStore | None = None) -> None:
        if not fits_one_message(initial.params.size):
            raise FederationError(f"a model of {initial.params.size} parameters does not fit one "
                                  f"{MESSAGE_SIZE_LIMIT >> 20} MiB version message",
                                  hint="run synchronous rounds for this model")
        self.link = link
        self.swarm = link.swarm
        # The current version survives a restart: nodes never go back, so an aggregator that
        # restarted at version 0 would refuse every update as from the future.
        self.store = store
        saved = _load_state(store, initial.params.size)
        if saved is not None and saved.version > initial.version:
            log.info("async: resuming at version %d", saved.version)
            initial = saved
        self.buf = Buffer(initial, buffer=buffer, max_staleness=max_staleness,
                          outlier_factor=outlier_factor, server_lr=server_lr)
        self.refresh_s = refresh_s
        self.on_version = on_version
        self.on_change = on_change  # after every update taken, refused or aggregated (the dashboard's card)
        self.history = [VersionRecord(initial.version, initial.sha256, time.time(), [], {})]
        self.refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sub: Subscription | None = None
        self._refresher: threading.Thread | None = None

    @property
    def current(self) -> Version:
        return self.buf.current

    def start(self) -> Aggregator:
        self._publish(self.buf.current)
        self._sub = self.link.subscribe(topics.async_updates_all(self.swarm), self._on_update)
        if self.refresh_s > 0:
            self._refresher = threading.Thread(target=self._refresh, name="async-refresh", daemon=True)
            self._refresher.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            with self._lock:  # under the lock: a refresh never lands after a newer version
                if self._stop.is_set():
                    return  # closed while we waited for the lock: publish nothing more
                self._publish(self.buf.current)

    def _publish(self, v: Version) -> None:
        self.link.publish(topics.async_version(self.swarm), encode_version(v), retain=True, qos=1)

    def _on_update(self, topic: str, payload: bytes) -> None:
        try:
            self._take(topic, payload)
        finally:
            if self.on_change is not None:
                self.on_change()

    def _take(self, topic: str, payload: bytes) -> None:
        member = topic.rsplit("/", 1)[-1]
        with self._lock:
            if self._stop.is_set():
                # Closed (the fleet lost the lead, or stops): the link may still deliver what it
                # had queued, but a closed aggregator makes no version (close() says why).
                log.debug("async update from %s dropped: the aggregator is closed", member)
                return
            try:
                nxt = self.buf.admit(member, payload)
            except Refused as exc:
                self.refused[exc.why.value] += 1
                log.info("async update from %s refused: %s", member, exc)
                return
            if nxt is None:
                return
            for who, why in nxt.excluded.items():
                self.refused[Refusal.OUTLIER.value] += 1
                log.info("async update from %s excluded from version %d: %s", who, nxt.version, why)
            self.history.append(VersionRecord(
                nxt.version, nxt.sha256, time.time(),
                [{"member": c.member, "base": c.base, "samples": c.samples, "staleness": c.staleness,
                  "weight": c.weight} for c in nxt.contributions], dict(nxt.excluded)))
            del self.history[:-HISTORY_MAX]
            if self.store is not None:  # durable before anyone can commit it
                self.store.save(encode_version(nxt))
            self._publish(nxt)
        log.info("async version %d published (%d updates)", nxt.version, len(nxt.contributions))
        if self.on_version is not None:
            self.on_version(nxt)

    def status(self) -> dict:
        """The fleet API's view: current version, buffer fill, bounds, refusals, recent versions."""
        with self._lock:
            return {"version": self.buf.current.version, "sha256": self.buf.current.sha256,
                    "buffer": self.buf.k, "max_staleness": self.buf.max_staleness,
                    "pending": sorted(self.buf.pending), "refused": dict(self.refused),
                    "versions": [vars(r) for r in self.history[-50:]]}

    def close(self) -> None:
        """Stop aggregating. When this returns, the current version is the last one this
        aggregator made, already stored and published: an update being taken finishes first,
        and one the link delivers later (its subscription may have had it queued) is dropped.
        Without this a fleet process that lost the lead could still store and publish a version
        after the new leader resumed from the stored one: two versions with one number."""
        self._stop.set()
        if self._sub is not None:
            self._sub.cancel()
        with self._lock:  # waits for an update being taken; every later one sees _stop
            pass


class AsyncMember:
    """A node's side: follows the published versions and sends one update per version it trained from."""

    def __init__(self, link: PubSubLink, member_id: str, size: int, *,
                 on_commit: Callable[[Version], None] | None = None) -> None:
        self.link = link
        self.member_id = member_id
        self.size = size
        self.on_commit = on_commit
        self.current: Version | None = None
        self.last_update: bytes | None = None  # what resend() publishes again
        self.refused: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._closed = False
        self._sub: Subscription | None = None

    def start(self) -> AsyncMember:
        self._sub = self.link.subscribe(topics.async_version(self.link.swarm), self._on_version)
        return self

    def _on_version(self, topic: str, payload: bytes) -> None:
        try:
            v = decode_version(payload, size=self.size)  # checks the params' sha256
        except Refused as exc:
            self.refused[exc.why.value] += 1
            log.warning("async version refused: %s", exc)
            return
        with self._cond:
            if self._closed:
                return  # the link delivered it after close(): the node stopped following
            if self.current is not None and v.version <= self.current.version:
                return  # a refresh of what we hold, or an older one: never go back
            self.current = v
            self._cond.notify_all()
        if self.on_commit is not None:
            self.on_commit(v)

    def wait_version(self, at_least: int = 0, timeout: float = 30.0) -> Version:
        """The newest committed version once it is ``>= at_least`` (TimeoutError otherwise)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.current is None or self.current.version < at_least:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.member_id}: no async version >= {at_least} within {timeout} s")
                self._cond.wait(left)
            return self.current

    def publish_update(self, base: Version, trained: np.ndarray, samples: int) -> Update:
        """Send ``trained - base.params`` as this member's update from ``base``."""
        delta = (np.asarray(trained, np.float32).ravel() - base.params).astype(np.float32)
        u = Update(self.member_id, base.version, base.sha256, int(samples), delta)
        self.last_update = encode_update(u)
        self.resend()
        return u

    def resend(self) -> None:
        """Publish the last update again (newly signed). An aggregator that holds it ignores it;
        one that restarted and lost its buffer takes it: without this the swarm would wait for a
        version that the lost updates were to make."""
        if self.last_update is not None:
            self.link.publish(topics.async_update(self.link.swarm, self.member_id), self.last_update, qos=1)

    def close(self) -> None:
        with self._cond:
            self._closed = True
        if self._sub is not None:
            self._sub.cancel()
