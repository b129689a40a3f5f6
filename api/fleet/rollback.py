"""Rollbacks: every named node returns to one earlier parameter version, together.

Life cycle as the fleet sees it::

    POST /api/rollback, or a round whose validation got worse than the margin
        --> PENDING --(every target's status reports model_version == to_version)--> DONE
               |--(a deadline passes first)--> FAILED (which nodes did not get there)

The fleet checks what it can before it publishes the ``RollbackCommand``: the targets are online,
none is below ``to_version``, and each still holds it (nodes list the versions they keep).
The nodes answer with their retained status, so a rollback needs no message of its own back.
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from api.fleet.history import FleetHistory
from api.fleet.operations import Operations, OpKind, RoundRejected
from api.fleet.rounds import too_many_participants
from federation import topics
from federation.bounds import PARTICIPANTS_MAX, Id
from federation.messages import RollbackCommand

__all__ = ["RollbackRequest", "RollbackState", "Rollback", "RollbackManager"]


class RollbackRequest(BaseModel):
    """Body of ``POST /api/rollback``: ``nodes`` null = every online node; ``to_version`` null =
    one before the newest version among them."""

    model_config = ConfigDict(extra="forbid")

    nodes: Annotated[list[Id], Field(min_length=1, max_length=PARTICIPANTS_MAX)] | None = None
    to_version: int | None = Field(default=None, ge=0, le=2**31)


class RollbackState(enum.StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Rollback:
    command: RollbackCommand
    by: str  # "operator" or "auto" (a round that made validation worse)
    round_id: str | None  # the round it undoes, when it was started for one
    started_at: float
    state: RollbackState = RollbackState.PENDING
    reason: str | None = None  # why it FAILED
    finished_at: float | None = None
    reached: dict[str, int] = field(default_factory=dict)  # node -> version it reported since

    def to_dict(self) -> dict:
        c = self.command
        return {"rollback_id": c.rollback_id, "state": self.state.value, "by": self.by,
                "round_id": self.round_id, "nodes": list(c.nodes), "to_version": c.to_version,
                "why": c.reason, "reason": self.reason, "started_at": self.started_at,
                "finished_at": self.finished_at, "reached": dict(sorted(self.reached.items()))}


Publish = Callable[[str, BaseModel], None]


class RollbackManager:
    """Thread-safe; one rollback at a time (two overlapping ones could leave the swarm split)."""

    def __init__(self, *, swarm: str, publish: Publish, timeout_s: float, store: FleetHistory | None = None,
                 keep: int = 100, operations: Operations | None = None) -> None:
        self._swarm = swarm
        self._publish = publish
        self._timeout = timeout_s
        self._store = store
        self._keep = keep
        self._lock = threading.Lock()
        self._all: OrderedDict[str, Rollback] = OrderedDict()
        self._ops = operations if operations is not None else Operations()
        self._ops.register(OpKind.ROLLBACK, self._pending_phrase)

    def pending(self) -> Rollback | None:
        with self._lock:
            return next((r for r in self._all.values() if r.state is RollbackState.PENDING), None)

    def _pending_phrase(self) -> str | None:
        rb = self.pending()
        if rb is None:
            return None
        rid = rb.command.rollback_id
        what = (f"the automatic rollback {rid} of round {rb.round_id} ({rb.command.reason})"
                if rb.by == "auto" else f"rollback {rid}")
        return f"{what} is still pending (to v{rb.command.to_version})"

    def get(self, rollback_id: str) -> dict | None:
        with self._lock:
            rb = self._all.get(rollback_id)
            return rb.to_dict() if rb else None

    def start(self, req: RollbackRequest, *, nodes: list[dict], now: float, by: str = "operator",
              round_id: str | None = None, why: str = "", current: dict[str, int] | None = None) -> Rollback:
        """Check ``req`` against the node views (``NodeRegistry.snapshot``), publish, record.
        ``current`` overrides the versions the views show (a round's DONE events arrive before the
        nodes' new statuses). Raises :class:`RoundRejected` (404 unknown node, 409 not now: an
        operation it may not overlap runs, api/fleet/operations.py)."""
        with self._ops.starting(OpKind.ROLLBACK):
            rb = self._register(req, nodes=nodes, now=now, by=by, round_id=round_id, why=why, current=current)
        self._record("rollback", rb, now)
        self._publish(topics.command(self._swarm), rb.command)
        return rb

    def _register(self, req: RollbackRequest, *, nodes: list[dict], now: float, by: str,
                  round_id: str | None, why: str, current: dict[str, int] | None) -> Rollback:
        views = {n["node_id"]: n for n in nodes}
        if req.nodes is None:
            targets = sorted(n for n, v in views.items() if v["online"])
            if not targets:
                raise RoundRejected("no node is online to roll back")
            if len(targets) > PARTICIPANTS_MAX:
                raise RoundRejected(too_many_participants(len(targets), "a rollback"))
        else:
            targets = sorted(set(req.nodes))
            unknown = [n for n in targets if n not in views]
            if unknown:
                raise RoundRejected(f"unknown node(s): {', '.join(unknown)}", 404)
            offline = [n for n in targets if not views[n]["online"]]
            if offline:
                raise RoundRejected(f"node(s) offline: {', '.join(offline)}; a rollback needs every "
                                    "target online (or leave it out)")
        current = {n: int(views[n]["model_version"]) for n in targets} | {
            n: v for n, v in (current or {}).items() if n in targets}
        to = req.to_version if req.to_version is not None else max(current.values()) - 1
        if to < 0:
            raise RoundRejected("no earlier parameter version to roll back to (every target is at v0)")
        ahead = [f"{n} (v{v})" for n, v in current.items() if v < to]
        if ahead:
            raise RoundRejected(f"cannot roll forward: {', '.join(ahead)} below v{to}")
        if all(v == to for v in current.values()):
            raise RoundRejected(f"every target is at v{to} already")
        missing = [f"{n} (keeps {_span(views[n]['versions'])})" for n in targets
                   if views[n].get("versions") and current[n] != to and to not in views[n]["versions"]]
        if missing:
            raise RoundRejected(f"v{to} is no longer kept by {', '.join(missing)}")
        cmd = RollbackCommand(rollback_id="b" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
                              + "-" + secrets.token_hex(3), nodes=targets, to_version=to,
                              reason=why, issued_at=now)
        rb = Rollback(command=cmd, by=by, round_id=round_id, started_at=now,
                      reached={n: v for n, v in current.items() if v == to})
        with self._lock:
            self._all[cmd.rollback_id] = rb
            while len(self._all) > self._keep:
                self._all.popitem(last=False)
        return rb

    def on_status(self, node_id: str, model_version: int, now: float) -> Rollback | None:
        """A node's status arrived; returns the rollback it completed (DONE), if any."""
        with self._lock:
            rb = next((r for r in self._all.values() if r.state is RollbackState.PENDING), None)
            if rb is None or node_id not in rb.command.nodes:
                return None
            if model_version == rb.command.to_version:
                rb.reached[node_id] = model_version
            else:
                rb.reached.pop(node_id, None)
            if len(rb.reached) < len(rb.command.nodes):
                return None
            rb.state, rb.finished_at = RollbackState.DONE, now
        self._record("rollback.done", rb, now)
        return rb

    def tick(self, now: float) -> Rollback | None:
        """Fail a pending rollback past its deadline; returns it."""
        with self._lock:
            rb = next((r for r in self._all.values() if r.state is RollbackState.PENDING), None)
            if rb is None or now - rb.started_at <= self._timeout:
                return None
            late = [n for n in rb.command.nodes if n not in rb.reached]
            rb.state, rb.finished_at = RollbackState.FAILED, now
            rb.reason = (f"not at v{rb.command.to_version} within {self._timeout:g}s: {', '.join(late)}")
        self._record("rollback.failed", rb, now)
        return rb

    def _record(self, action: str, rb: Rollback, now: float) -> None:
        if self._store is not None:
            self._store.record_action(action, rb.to_dict(), now)


def _span(versions: list[int]) -> str:
    vs = sorted(versions)
    return f"v{vs[0]}" if len(vs) == 1 else f"v{vs[0]}..v{vs[-1]}"
