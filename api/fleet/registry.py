"""Node registry: the swarm as seen through retained ``NodeStatus`` messages.

A node is offline when its last status says so (graceful stop or Last Will) or when it has
not been heard from for 1.5x its MQTT keepalive: the broker fires the Last Will at that
point, so waiting longer than that only hides a dead node. A node whose board found no slot it
may boot says so once (state ``halted``, ``halt`` = why; no heartbeats follow): it is shown
halted with that reason, never online, until it publishes another status.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from federation.bounds import REGISTRY_MAX_NODES
from federation.messages import NodeState, NodeStatus

__all__ = ["NodeRegistry", "NodeEntry", "STALE_FACTOR"]

STALE_FACTOR = 1.5


@dataclass
class NodeEntry:
    status: NodeStatus
    last_seen: float  # fleet clock, seconds since epoch
    expired: bool = False  # heartbeat timed out (reported once)

    def state(self, now: float) -> NodeState:
        if self.status.state is NodeState.HALTED:  # final until the board boots: no heartbeats
            return NodeState.HALTED
        if self.status.state is NodeState.OFFLINE or self.is_stale(now):
            return NodeState.OFFLINE
        return self.status.state

    def is_stale(self, now: float) -> bool:
        return now - self.last_seen > STALE_FACTOR * self.status.keepalive_s

    def view(self, now: float) -> dict:
        st = self.status
        state = self.state(now)
        reason = None
        if state is NodeState.HALTED:
            reason = f"halted: no bootable slot ({st.halt or 'no reason given'})"
        elif state is NodeState.OFFLINE:
            reason = "offline status (stopped or Last Will)" if st.state is NodeState.OFFLINE else (
                f"no heartbeat for {now - self.last_seen:.0f}s")
        return {
            "node_id": st.node_id,
            "state": state.value,
            "online": state not in (NodeState.OFFLINE, NodeState.HALTED),
            "offline_reason": reason,
            "halt": st.halt if state is NodeState.HALTED else None,
            "arch": st.arch,
            "board": st.board,
            "model": st.model,
            "model_version": st.model_version,
            "params_sha256": st.params_sha256,
            "params_short": st.params_sha256[:12],
            "samples": st.samples,
            "round_id": st.round_id,
            "api_url": st.api_url,
            "site": st.site,
            # Device facts newer nodes report (None when the node does not).
            "artifact": st.artifact.model_dump() if st.artifact else None,
            "inference": st.inference.model_dump(mode="json") if st.inference else None,
            "health": st.health.model_dump() if st.health else None,
            "samples_train": st.samples_train,
            "samples_val": st.samples_val,
            "samples_new": st.samples_new,
            "validation": st.validation.model_dump() if st.validation else None,
            "anomaly": st.anomaly.model_dump() if st.anomaly else None,
            "versions": list(st.versions),
            "image": st.image.model_dump(mode="json") if st.image else None,
            "keepalive_s": st.keepalive_s,
            "last_seen": self.last_seen,
            "age_s": round(max(0.0, now - self.last_seen), 3),
        }


class NodeRegistry:
    """Thread-safe map node id -> latest status; MQTT callbacks write, HTTP handlers read."""

    def __init__(self, max_nodes: int = REGISTRY_MAX_NODES) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeEntry] = {}
        self.max_nodes = max_nodes

    def update(self, status: NodeStatus, now: float) -> dict | None:
        """Record a status; returns the node's new view, or ``None`` when the registry is full
        and the node is new (ghost statuses must not grow it without limit)."""
        # A retained status may be old: trust its timestamp unless the node's clock runs ahead.
        seen = min(now, status.ts)
        with self._lock:
            if status.node_id not in self._nodes and len(self._nodes) >= self.max_nodes:
                return None
            entry = NodeEntry(status=status, last_seen=seen)
            self._nodes[status.node_id] = entry
            return entry.view(now)

    def remove(self, node_id: str) -> bool:
        """Forget a node (its retained status was cleared)."""
        with self._lock:
            return self._nodes.pop(node_id, None) is not None

    def expire(self, now: float) -> list[dict]:
        """Views of nodes whose heartbeat just went stale (each reported once per silence)."""
        out = []
        with self._lock:
            for entry in self._nodes.values():
                if entry.status.state in (NodeState.OFFLINE, NodeState.HALTED) or entry.expired:
                    continue
                if entry.is_stale(now):
                    entry.expired = True
                    out.append(entry.view(now))
        return out

    def online_ids(self, now: float) -> set[str]:
        with self._lock:
            return {nid for nid, e in self._nodes.items()
                    if e.state(now) not in (NodeState.OFFLINE, NodeState.HALTED)}

    def idle_ids(self, now: float) -> set[str]:
        """Online and not busy with a round (a node still inside an aborted round is not idle:
        a new round on it would fail at once with "busy")."""
        with self._lock:
            return {nid for nid, e in self._nodes.items() if e.state(now) is NodeState.ONLINE}

    def known(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self._nodes

    def snapshot(self, now: float) -> list[dict]:
        with self._lock:
            return [self._nodes[n].view(now) for n in sorted(self._nodes)]
