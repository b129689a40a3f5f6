"""Who is in the swarm: retained NodeStatus messages, Last Wills and heartbeats.

Every member publishes its :class:`~federation.messages.NodeStatus` retained on
``topics.status(swarm, node)`` and registers the same status with ``state=offline`` as its
MQTT Last Will (:func:`status_will`), so the broker marks it offline when its connection dies
(SIGKILL, power loss, network cut; within 1.5x keepalive when nothing closes the socket).
:class:`Membership` follows those topics; the ring order of a round is derived from
:meth:`Membership.live` at the start of the round (``sorted(ids)``). Malformed or unversioned
payloads (a rogue client, an old release) are rejected and counted, never raised.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from pydantic import ValidationError

from federation import topics
from federation.messages import NodeState, NodeStatus, parse_status
from federation.transport import Publication, PubSubLink

__all__ = ["Membership", "StatusPublisher", "status_will", "ChangeCallback"]

log = logging.getLogger(__name__)

# (node_id, previous status or None, new status or None when the retained status was cleared)
ChangeCallback = Callable[[str, NodeStatus | None, NodeStatus | None], None]


def status_will(swarm: str, status: NodeStatus) -> tuple[str, bytes]:
    """The Last Will for ``MqttLink(will=...)``: this node's status with ``state=offline``."""
    offline = status.model_copy(update={"state": NodeState.OFFLINE, "round_id": None, "ts": time.time()})
    return topics.status(swarm, status.node_id), offline.model_dump_json().encode()


class Membership:
    """Tracks the retained statuses of one swarm (see module docstring).

    ``stale_factor``: a member whose last status is older than ``stale_factor x heartbeat_s``
    (its own declared heartbeat, measured on our clock at receipt) is not live either, which
    covers a half-open connection whose Last Will has not fired yet.
    """

    def __init__(self, link: PubSubLink, swarm: str | None = None, *, stale_factor: float = 3.0) -> None:
        self.link = link
        self.swarm = topics.validate_id(swarm or link.swarm, "swarm id")
        self.stale_factor = stale_factor
        self.rejected = 0  # malformed / unversioned / mismatched payloads
        self.last_rejection: str | None = None
        self._lock = threading.Lock()
        self._status: dict[str, NodeStatus] = {}
        self._seen_at: dict[str, float] = {}
        self._callbacks: list[ChangeCallback] = []
        self._changed = threading.Condition(self._lock)
        self._prefix = topics.status(self.swarm, "")
        self._sub = link.subscribe(topics.status_all(self.swarm), self._on_status)

    def _reject(self, topic: str, why: str) -> None:
        with self._lock:
            self.rejected += 1
            self.last_rejection = f"{topic}: {why}"
        log.warning("rejected status on %s: %s", topic, why)

    def _on_status(self, topic: str, payload: bytes) -> None:
        node = topic[len(self._prefix):]
        if not payload:  # an empty retained message clears the status: the node was removed
            self._apply(node, None)
            return
        try:
            # A payload without an explicit version is refused, not defaulted to ours: it comes
            # from a client that does not speak this protocol.
            if b'"v"' not in payload or not isinstance(json.loads(payload).get("v"), int):
                raise ValueError("no format version 'v'")
            status = parse_status(payload)
        except (ValidationError, ValueError, AttributeError) as exc:
            if isinstance(exc, ValidationError) and exc.errors():
                first = exc.errors()[0]
                why = f"{'.'.join(map(str, first['loc']))} {first['msg']}".strip()
            else:
                why = str(exc)
            self._reject(topic, why)
            return
        if status.node_id != node:
            self._reject(topic, f"node_id {status.node_id!r} does not match the topic")
            return
        self._apply(node, status)

    def _apply(self, node: str, status: NodeStatus | None) -> None:
        with self._lock:
            old = self._status.get(node)
            if status is None:
                self._status.pop(node, None)
                self._seen_at.pop(node, None)
            else:
                self._status[node] = status
                self._seen_at[node] = time.monotonic()
            callbacks = list(self._callbacks)
            self._changed.notify_all()
        changed = old is None or status is None or old.state != status.state
        if changed:
            for cb in callbacks:
                try:
                    cb(node, old, status)
                except Exception:
                    log.exception("membership callback failed")

    def on_change(self, callback: ChangeCallback) -> None:
        """Call ``callback(node_id, old, new)`` when a node appears, changes state or vanishes
        (runs on this membership's worker thread, not on paho's)."""
        with self._lock:
            self._callbacks.append(callback)

    def all(self) -> dict[str, NodeStatus]:
        """Every node with a retained status, offline ones included."""
        with self._lock:
            return dict(self._status)

    def live(self) -> dict[str, NodeStatus]:
        """Nodes whose last status is not offline (nor halted: no bootable slot) and not stale, by id."""
        now = time.monotonic()
        with self._lock:
            return {n: s for n, s in self._status.items()
                    if s.state not in (NodeState.OFFLINE, NodeState.HALTED)
                    and now - self._seen_at[n] <= self.stale_factor * max(s.heartbeat_s, 0.1)}

    def wait_for(self, predicate: Callable[[dict[str, NodeStatus]], bool], timeout: float) -> bool:
        """Block until ``predicate(self.live())`` holds (re-checked on every status); False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self.live()):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._changed:
                self._changed.wait(min(left, 0.25))

    def close(self) -> None:
        self._sub.cancel()


class StatusPublisher:
    """Publishes one node's retained status now, on every :meth:`update`, every ``heartbeat_s``
    and after every reconnect (a restarted broker without persistence forgot it).

    Create the link with ``will=status_will(swarm, status)`` so a crash reads as offline.
    """

    def __init__(self, link: PubSubLink, status: NodeStatus, *, swarm: str | None = None) -> None:
        self.link = link
        self.swarm = topics.validate_id(swarm or link.swarm, "swarm id")
        self._status = status
        # Guards the status; publish() holds it from its copy to the PUBLISH being queued, so the
        # heartbeat thread's copy cannot go out after a newer one from update()/stop() (the broker
        # would keep the older status as the retained one). link.publish never blocks on the broker.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.published = 0
        link.on_connect(self._on_reconnect)
        self.publish()
        self._thread = threading.Thread(target=self._run, name=f"status:{status.node_id}", daemon=True)
        self._thread.start()

    def _on_reconnect(self, reconnected: bool) -> None:
        if reconnected:
            self.publish()

    @property
    def status(self) -> NodeStatus:
        return self._status

    def update(self, **fields: object) -> NodeStatus:
        """Change fields (e.g. ``state=NodeState.TRAINING``) and publish at once."""
        with self._lock:
            self._status = self._status.model_copy(update=fields)
        self.publish()
        return self._status

    def publish(self) -> Publication | None:
        """Publish the current status (fresh ``ts``), retained, QoS 1."""
        with self._lock:
            if self._stop.is_set() and self._status.state != NodeState.OFFLINE:
                return None
            self._status = status = self._status.model_copy(update={"ts": time.time()})
            self.published += 1
            return self.link.publish(topics.status(self.swarm, status.node_id), status, retain=True)

    def _run(self) -> None:
        while not self._stop.wait(self._status.heartbeat_s):
            try:
                self.publish()
            except Exception as exc:  # a broker hiccup must not end the heartbeat
                log.warning("heartbeat publish failed: %s", exc)

    def stop(self, *, offline: bool = True, timeout: float = 2.0) -> None:
        """Stop the heartbeat; with ``offline`` publish the offline status and wait for the broker."""
        self._stop.set()
        if offline:
            with self._lock:
                self._status = self._status.model_copy(update={"state": NodeState.OFFLINE, "round_id": None})
            info = self.publish()
            if info is not None:
                try:
                    info.wait_for_publish(timeout)
                except (RuntimeError, ValueError):  # not connected: the Last Will covers it
                    pass
        self._thread.join(timeout)
