"""Simulated nodes speaking the real MQTT protocol to a fleet: they announce retained statuses with
device facts, answer a ``RoundCommand`` with batched STEP events and a DONE carrying validation
results, and a ``RollbackCommand`` with a status at the asked version. The fleet cannot tell them
from real nodes, so the dashboard can be driven through every fleet feature in seconds."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from federation import topics
from federation.messages import (
    ArtifactInfo,
    EventKind,
    NodeHealth,
    NodeState,
    NodeStatus,
    RollbackCommand,
    RoundCommand,
    RoundEvent,
    Validation,
    parse_command,
)
from federation.mqtt import MqttLink

__all__ = ["SimNode", "SimSwarm"]


@dataclass
class SimNode:
    node_id: str
    link: MqttLink
    swarm: str
    version: int = 0
    accuracy: float = 0.6  # validation accuracy of the current version
    history: dict[int, float] = field(default_factory=dict)  # version -> its accuracy (the kept versions)
    started: float = field(default_factory=time.time)
    samples_new: int = 0  # samples since its last committed round (a round resets it)

    def status(self, state: NodeState = NodeState.ONLINE, round_id: str | None = None) -> NodeStatus:
        return NodeStatus(
            node_id=self.node_id, state=state, arch="x86_64", board="x86_64", model="digits-mlp",
            model_version=self.version, params_sha256=f"{self.version:064x}", samples=100, round_id=round_id,
            api_url=f"http://127.0.0.1:1/{self.node_id}",
            artifact=ArtifactInfo(model="digits-mlp", target="x86_64", tuned=False, tvm_version="0.19.0"),
            health=NodeHealth(uptime_s=time.time() - self.started, cpu_percent=2.0, mem_rss_bytes=150 << 20,
                              mem_percent=1.0, disk_free_bytes=20 << 30),
            samples_train=80, samples_val=20, samples_new=self.samples_new,
            validation=self.validation(),
            versions=sorted(self.history)[-5:])

    def validation(self) -> Validation:
        return Validation(loss=1 - self.accuracy, accuracy=self.accuracy, samples=20,
                          model_version=self.version)

    def announce(self, **kw: object) -> None:
        self.link.publish(topics.status(self.swarm, self.node_id), self.status(**kw),  # type: ignore[arg-type]
                          retain=True).wait_for_publish(5)

    def emit(self, ev: RoundEvent) -> None:
        self.link.publish(topics.round_events(self.swarm, ev.round_id, self.node_id), ev).wait_for_publish(5)


class SimSwarm:
    """``SimSwarm(broker_url, swarm, ["a", "b"])``; ``gain`` is what the next round adds to the
    validation accuracy (negative: a round that makes the model worse)."""

    def __init__(self, broker_url: str, swarm: str, ids: list[str], *, round_s: float = 0.6) -> None:
        self.swarm, self.round_s, self.gain = swarm, round_s, 0.05
        self.nodes: dict[str, SimNode] = {}
        for nid in ids:
            will = (topics.status(swarm, nid), NodeStatus(node_id=nid, state=NodeState.OFFLINE))
            cid = f"sim-{nid}-{time.time_ns() % 10**9}"
            link = MqttLink(broker_url, swarm=swarm, client_id=cid, will=will)
            node = SimNode(nid, link, swarm)
            node.history[0] = node.accuracy
            self.nodes[nid] = node
            link.subscribe(topics.command(swarm), lambda t, p, n=node: self._on_command(n, p))
            node.announce()

    def _on_command(self, node: SimNode, payload: bytes) -> None:
        cmd = parse_command(payload)
        if isinstance(cmd, RoundCommand) and node.node_id in cmd.participants:
            threading.Thread(target=self._round, args=(node, cmd), daemon=True).start()
        elif isinstance(cmd, RollbackCommand) and node.node_id in cmd.nodes:
            node.version = cmd.to_version
            node.accuracy = node.history[cmd.to_version]
            for v in [v for v in node.history if v > cmd.to_version]:
                del node.history[v]
            node.announce()

    def _round(self, node: SimNode, cmd: RoundCommand) -> None:
        node.announce(state=NodeState.TRAINING, round_id=cmd.round_id)
        before = node.validation()
        # Three batched STEP events over the round's time: every step's loss arrives.
        per = math.ceil(cmd.steps / 3)
        for first in range(0, cmd.steps, per):
            time.sleep(self.round_s / 3)
            losses = [2.0 * math.exp(-3 * s / cmd.steps) + 0.05 * math.sin(s + 2 * int(node.node_id[-1]))
                      for s in range(first, min(cmd.steps, first + per))]
            node.emit(RoundEvent(kind=EventKind.STEP, round_id=cmd.round_id, node_id=node.node_id,
                                 step=first + len(losses) - 1, loss=losses[-1], losses=losses))
        node.version += 1
        node.samples_new = 0
        node.accuracy = min(1.0, max(0.0, node.accuracy + self.gain))
        node.history[node.version] = node.accuracy
        after = node.validation()
        node.emit(RoundEvent(kind=EventKind.DONE, round_id=cmd.round_id, node_id=node.node_id, step=cmd.steps,
                             params_sha256="ab" * 32, model_version=node.version, val_before=before,
                             val_after=after))
        node.announce()

    def close(self) -> None:
        for n in self.nodes.values():
            n.link.publish(topics.status(self.swarm, n.node_id), b"", retain=True).wait_for_publish(5)
            n.link.close()
