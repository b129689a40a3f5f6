"""Image roll-outs and image rollbacks: device images pushed to nodes over MQTT, in stages.

Life cycle as the fleet sees it::

    POST /api/rollouts {image, nodes}
        --> RUNNING, stage 1: the canary (nodes[0]) gets an ImageUpdateCommand
              canary reports update DONE (new slot passed its health check, marked good), and its
              status shows it: the image's version, slot good, health passed (else FAILED: a
              "done" that still reports the old version is a lie or a bug, never a pass)
        --> stage 2: every other node gets the command
              every node reports DONE --> DONE
        a node reports ROLLED_BACK (its new slot failed, the board fell back by itself) or FAILED
        (download, verification or flash refused), or a stage passes its deadline
        --> FAILED with the reason; later stages are never sent (the roll-out stops by itself)

    POST /api/image-rollback {nodes}
        --> RUNNING: one stage, every node gets an ImageRollbackCommand (previous good slot)
        --> DONE when each reports DONE, FAILED like above

Nodes answer with their retained status (``NodeStatus.image.update`` carries the command's id
and the phase), so no message of its own travels back. One roll-out or rollback at a time: two
overlapping ones could leave a node between images that nobody tracks.
"""

from __future__ import annotations

import enum
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from api.fleet.history import FleetHistory
from api.fleet.images import GRANT_S
from api.fleet.operations import Operations, OpKind, RoundRejected
from federation import bounds as b
from federation import topics
from federation.messages import ImageRollbackCommand, ImageUpdateCommand, UpdatePhase

__all__ = ["RolloutRequest", "ImageRollbackRequest", "RolloutState", "NodeProgress", "Rollout",
           "RolloutManager"]


class RolloutRequest(BaseModel):
    """Body of ``POST /api/rollouts``: the catalogue image and the nodes, the canary first."""

    model_config = ConfigDict(extra="forbid")

    image: b.ImageId
    nodes: list[b.Id] = Field(min_length=1, max_length=b.PARTICIPANTS_MAX)


class ImageRollbackRequest(BaseModel):
    """Body of ``POST /api/image-rollback``: nodes that return to their previous good slot."""

    model_config = ConfigDict(extra="forbid")

    nodes: list[b.Id] = Field(min_length=1, max_length=b.PARTICIPANTS_MAX)


class RolloutState(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass
class NodeProgress:
    stage: int
    phase: str = "waiting"  # waiting (not asked yet), sent, then the node's UpdatePhase values
    error: str | None = None
    sent_at: float | None = None
    finished_at: float | None = None
    version: str | None = None  # image version the node reported last
    expect: str | None = None  # the version "done" must report: the image's (rollout), previous (rollback)


@dataclass
class Rollout:
    rollout_id: str
    kind: str  # "rollout" or "rollback"
    image: dict[str, Any] | None  # the catalogue entry (rollouts)
    stages: list[list[str]]
    url: str
    started_at: float
    nodes: dict[str, NodeProgress] = field(default_factory=dict)
    stage: int = 0
    stage_started: float = 0.0
    state: RolloutState = RolloutState.RUNNING
    reason: str | None = None
    finished_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id, "kind": self.kind, "state": self.state.value,
            "reason": self.reason, "started_at": self.started_at, "finished_at": self.finished_at,
            "image": self.image, "version": self.image["version"] if self.image else None,
            "canary": self.stages[0][0] if self.kind == "rollout" else None,
            "stages": [list(s) for s in self.stages], "stage": self.stage,
            "nodes": {n: {"stage": p.stage, "phase": p.phase, "error": p.error, "sent_at": p.sent_at,
                          "finished_at": p.finished_at, "version": p.version}
                      for n, p in self.nodes.items()},
        }


Publish = Callable[[str, BaseModel], None]


def _not_done(image: dict[str, Any], expect: str | None) -> str | None:
    """Why a node's status that says ``done`` does not show it done, or None when it does.

    Done means the node's own (signed) status reports the expected version, booted from a slot
    marked good whose health check passed this boot; a phase alone proves nothing."""
    version, state, health = image.get("version"), image.get("state"), image.get("health")
    if version != expect:
        return f"its image is version {str(version)[:64]!r}, not {expect!r}"
    if state != "good" or health != "passed":
        return f"its slot is {str(state)[:16]!r} with health check {str(health)[:16]!r}, not good and passed"
    return None


class RolloutManager:
    """Thread-safe; MQTT status callbacks, the ticker and HTTP handlers all call in."""

    def __init__(self, *, swarm: str, publish: Publish, stage_timeout_s: float,
                 store: FleetHistory | None = None, keep: int = 100,
                 grant: Callable[[str, int], str] | None = None,
                 operations: Operations | None = None) -> None:
        self._swarm = swarm
        self._publish = publish
        self._timeout = stage_timeout_s
        # (image id, expiry) -> "exp=..&grant=..", the download grant each stage's URL carries
        self._grant = grant
        self._store = store
        self._keep = keep
        self._lock = threading.Lock()
        self._all: OrderedDict[str, Rollout] = OrderedDict()
        self._ops = operations if operations is not None else Operations()
        self._ops.register(OpKind.ROLLOUT, lambda: self._running_phrase("rollout"))
        self._ops.register(OpKind.IMAGE_ROLLBACK, lambda: self._running_phrase("rollback"))

    # -- queries ---------------------------------------------------------------------------------
    def running(self) -> Rollout | None:
        with self._lock:
            return self._running()

    def _running(self) -> Rollout | None:
        return next((r for r in self._all.values() if r.state is RolloutState.RUNNING), None)

    def _running_phrase(self, kind: str) -> str | None:
        r = self.running()
        return None if r is None or r.kind != kind else f"image {r.kind} {r.rollout_id} is still running"

    def get(self, rollout_id: str) -> dict[str, Any] | None:
        with self._lock:
            r = self._all.get(rollout_id)
            return r.to_dict() if r else None

    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        with self._lock:
            return [r.to_dict() for r in reversed(list(self._all.values())[-limit:])]

    # -- starting ----------------------------------------------------------------------------------
    def _targets(self, nodes: list[str], views: dict[str, dict]) -> list[str]:
        targets = list(dict.fromkeys(nodes))  # keep the order: the first is the canary
        unknown = [n for n in targets if n not in views]
        if unknown:
            raise RoundRejected(f"unknown node(s): {', '.join(unknown)}", 404)
        halted = [f"{n} ({views[n].get('halt') or 'no reason given'})" for n in targets
                  if views[n]["state"] == "halted"]
        if halted:
            raise RoundRejected(f"node(s) halted, no bootable slot: {'; '.join(halted)}")
        offline = [n for n in targets if not views[n]["online"]]
        if offline:
            raise RoundRejected(f"node(s) offline: {', '.join(offline)}")
        no_image = [n for n in targets if not views[n].get("image")]
        if no_image:
            raise RoundRejected(f"node(s) {', '.join(no_image)} do not run from a device image "
                                "(start them with `fractal boot --device PATH`)")
        unchecked = [n for n in targets if views[n]["image"].get("health") != "passed"]
        if unchecked:
            raise RoundRejected(f"node(s) still booting (health check not passed): {', '.join(unchecked)}")
        busy = [n for n in targets if views[n]["state"] != "online"]
        if busy:
            raise RoundRejected(f"node(s) busy with a training round: {', '.join(busy)}")
        return targets

    def _new_id(self, prefix: str, now: float) -> str:
        return prefix + time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(3)

    def start(self, req: RolloutRequest, *, image: dict[str, Any], url: str, nodes: list[dict],
              now: float) -> Rollout:
        """Check ``req`` against the image and the node views, send the canary its command.
        Raises :class:`RoundRejected` (404 unknown node, 409 not now / not possible: an operation it
        may not overlap runs, api/fleet/operations.py)."""
        with self._ops.starting(OpKind.ROLLOUT):
            views = {n["node_id"]: n for n in nodes}
            targets = self._targets(req.nodes, views)
            wrong_board = [f"{n} ({views[n]['board']})" for n in targets
                           if views[n]["board"] != image["board"]]
            if wrong_board:
                raise RoundRejected(f"image {image['id']} is for board {image['board']}, not for "
                                    f"{', '.join(wrong_board)}")
            there = [n for n in targets if views[n]["image"]["version"] == image["version"]]
            if there:
                raise RoundRejected(f"node(s) run version {image['version']} already: {', '.join(there)}")
            stages = [targets[:1]] + ([targets[1:]] if len(targets) > 1 else [])
            r = Rollout(rollout_id=self._new_id("u", now), kind="rollout", image=image, stages=stages,
                        url=url, started_at=now)
            cmd = self._register(r, now, {n: str(image["version"]) for n in targets})
        return self._launch(r, cmd, now)

    def start_rollback(self, req: ImageRollbackRequest, *, nodes: list[dict], now: float) -> Rollout:
        with self._ops.starting(OpKind.IMAGE_ROLLBACK):
            views = {n["node_id"]: n for n in nodes}
            targets = self._targets(req.nodes, views)
            none = [n for n in targets if not views[n]["image"].get("previous")]
            if none:
                raise RoundRejected(f"node(s) have no previous good slot to return to: {', '.join(none)}")
            r = Rollout(rollout_id=self._new_id("r", now), kind="rollback", image=None, stages=[targets],
                        url="", started_at=now)
            cmd = self._register(r, now, {n: str(views[n]["image"]["previous"]) for n in targets})
        return self._launch(r, cmd, now)

    def _register(self, r: Rollout, now: float, expect: dict[str, str]) -> BaseModel:
        """Make ``r`` the running one (the caller holds the coordinator's start lock); its first command."""
        r.nodes = {n: NodeProgress(stage=i, expect=expect[n])
                   for i, stage in enumerate(r.stages) for n in stage}
        with self._lock:
            self._all[r.rollout_id] = r
            while len(self._all) > self._keep:
                self._all.popitem(last=False)
            return self._stage_command(r, 0, now)

    def _launch(self, r: Rollout, cmd: BaseModel, now: float) -> Rollout:
        self._record(f"image.{r.kind}", r, now)
        self._publish(topics.command(self._swarm), cmd)
        return r

    def _stage_command(self, r: Rollout, stage: int, now: float) -> BaseModel:
        """Mark ``stage`` as sent (under the lock) and build its command."""
        r.stage, r.stage_started = stage, now
        for n in r.stages[stage]:
            r.nodes[n].phase, r.nodes[n].sent_at = "sent", now
        if r.kind == "rollback":
            return ImageRollbackCommand(rollback_id=r.rollout_id, nodes=r.stages[stage], issued_at=now,
                                        reason="operator")
        assert r.image is not None
        url = r.url
        if self._grant is not None:  # a fresh grant per stage, ending with the stage (GRANT_S at most)
            exp = math.ceil(now + min(self._timeout, GRANT_S))
            url = f"{r.url}?{self._grant(r.image['id'], exp)}"
        return ImageUpdateCommand(update_id=r.rollout_id, nodes=r.stages[stage], image_id=r.image["id"],
                                  version=r.image["version"], size=r.image["size"], url=url, issued_at=now)

    def downloading(self, image_id: str, node_id: str) -> bool:
        """Is ``node_id`` in the running roll-out of ``image_id``, sent its command and not done?
        (Only such a node may use a download grant in a signed swarm.)"""
        with self._lock:
            r = self._running()
            if r is None or r.kind != "rollout" or r.image is None or r.image["id"] != image_id:
                return False
            p = r.nodes.get(node_id)
            return p is not None and p.sent_at is not None and p.finished_at is None

    # -- progress ------------------------------------------------------------------------------
    def on_status(self, node_id: str, image: dict[str, Any] | None, now: float) -> Rollout | None:
        """A node's (online) status arrived; returns the roll-out it changed, if any."""
        if not image or not image.get("update"):
            return None
        upd = image["update"]
        cmd: BaseModel | None = None
        with self._lock:
            r = self._running()
            if r is None or upd.get("update_id") != r.rollout_id or node_id not in r.nodes:
                return None
            p = r.nodes[node_id]
            if p.sent_at is None or p.finished_at is not None:
                return None
            before = (p.phase, p.version)
            p.phase, p.version = str(upd["phase"]), image.get("version")
            role = "canary " if r.kind == "rollout" and p.stage == 0 else ""
            short = _not_done(image, p.expect) if upd["phase"] == UpdatePhase.DONE else None
            if upd["phase"] == UpdatePhase.DONE and short is None:
                p.finished_at = now
            elif short is not None:  # "done" in words only: never advances the roll-out
                p.finished_at, p.error = now, f"reported done, but {short}"
                r.state, r.finished_at = RolloutState.FAILED, now
                r.reason = f"{role}{node_id} {p.error}"
            elif upd["phase"] in (UpdatePhase.ROLLED_BACK, UpdatePhase.FAILED):
                p.finished_at, p.error = now, upd.get("error") or "no reason given"
                what = "rolled back by itself" if upd["phase"] == UpdatePhase.ROLLED_BACK else "refused"
                r.state, r.finished_at = RolloutState.FAILED, now
                r.reason = f"{role}{node_id} {what}: {p.error}"
            elif (p.phase, p.version) == before:
                return None
            if r.state is RolloutState.RUNNING and all(
                    r.nodes[n].finished_at is not None for n in r.stages[r.stage]):
                if r.stage + 1 < len(r.stages):
                    cmd = self._stage_command(r, r.stage + 1, now)
                else:
                    r.state, r.finished_at = RolloutState.DONE, now
        if r.state is not RolloutState.RUNNING:
            self._record(f"image.{r.kind}.{r.state.value}", r, now)
        if cmd is not None:
            self._publish(topics.command(self._swarm), cmd)
        return r

    def on_halt(self, node_id: str, reason: str, now: float) -> Rollout | None:
        """A node of the running roll-out says its board halted (no bootable slot): the roll-out
        fails now with that reason instead of waiting out its deadline; returns it."""
        with self._lock:
            r = self._running()
            if r is None or node_id not in r.nodes:
                return None
            p = r.nodes[node_id]
            if p.finished_at is not None:
                return None
            role = "canary " if r.kind == "rollout" and p.stage == 0 else ""
            p.finished_at, p.error = now, f"halted, no bootable slot: {reason}"
            r.state, r.finished_at = RolloutState.FAILED, now
            r.reason = f"{role}{node_id} {p.error}"
        self._record(f"image.{r.kind}.failed", r, now)
        return r

    def tick(self, now: float) -> Rollout | None:
        """Fail a roll-out whose current stage is past its deadline; returns it."""
        with self._lock:
            r = self._running()
            if r is None or now - r.stage_started <= self._timeout:
                return None
            late = [n for n in r.stages[r.stage] if r.nodes[n].finished_at is None]
            r.state, r.finished_at = RolloutState.FAILED, now
            r.reason = f"not done within {self._timeout:g} s: {', '.join(late)}"
        self._record(f"image.{r.kind}.failed", r, now)
        return r

    def _record(self, action: str, r: Rollout, now: float) -> None:
        if self._store is not None:
            d = r.to_dict()
            self._store.record_action(action, {k: d[k] for k in (
                "rollout_id", "kind", "state", "reason", "version", "canary", "stages")}, now)
