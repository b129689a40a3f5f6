"""Durable fleet state: round history, per-round metrics, the operator's actions and run-time
settings (the automatic-round policy) in the fleet's database (api/fleet/store.py).

One SQLite file per fleet (``FleetSettings.db``, WAL mode) or one PostgreSQL database
(``FleetSettings.database``, shared by the fleet processes of one swarm), written on every round
state change and every operator action, read when the service starts, so a restarted fleet shows
the same history.
A round that was still running when the leading fleet process stopped is closed as failed by the
next process that leads (its nodes were told nothing by a fleet that no longer exists, and their
own timeouts ended it; api/fleet/leadership.py).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from api.fleet.store import Database, open_database

__all__ = ["FleetHistory", "RESTARTED", "ACTION_ID_MAX", "ActionCursor"]

# SQLite's INTEGER and PostgreSQL's BIGINT are signed 64-bit numbers: a cursor above it cannot be
# bound (issue 26 finding 12).
ACTION_ID_MAX = 2**63 - 1
ActionCursor = Annotated[int, Field(ge=1, le=ACTION_ID_MAX)]

RESTARTED = "the fleet service restarted during the round"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rounds (
    round_id   TEXT PRIMARY KEY,
    started_at REAL NOT NULL,
    state      TEXT NOT NULL,
    body       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS rounds_started ON rounds (started_at);
CREATE TABLE IF NOT EXISTS actions (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    ts     REAL NOT NULL,
    action TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


class FleetHistory:
    """Thread-safe store of round dicts (as ``Round.to_dict`` makes them) and actions.

    ``target``: a SQLite path or a ``postgresql://`` URL."""

    def __init__(self, target: str | Path) -> None:
        self.target = str(target)
        self._lock = threading.Lock()
        self._conn: Database | None = None
        with self._lock:
            self._open()

    def _open(self) -> Database:
        """The connection, (re)opened on first use after :meth:`close` (a service may be restarted)."""
        if self._conn is None:
            self._conn = open_database(self.target, _SCHEMA)
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- rounds ---------------------------------------------------------------------------------
    def save_round(self, rnd: dict[str, Any]) -> None:
        """Insert or replace one round (its latest state and metrics)."""
        body = json.dumps(rnd, allow_nan=False, separators=(",", ":"))
        with self._lock:
            self._open().execute("INSERT INTO rounds (round_id, started_at, state, body) VALUES (?, ?, ?, ?) "
                                 "ON CONFLICT (round_id) DO UPDATE SET started_at = excluded.started_at, "
                                 "state = excluded.state, body = excluded.body",
                                 (rnd["round_id"], rnd["started_at"], rnd["state"], body))

    def get_round(self, round_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._open().execute("SELECT body FROM rounds WHERE round_id = ?", (round_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def rounds(self, limit: int, before: float | None = None) -> list[dict[str, Any]]:
        """Up to ``limit`` rounds started before ``before`` (all when None), newest first."""
        with self._lock:
            rows = self._open().execute(
                "SELECT body FROM rounds WHERE started_at < ? "
                "ORDER BY started_at DESC, round_id DESC LIMIT ?",
                (float("inf") if before is None else before, limit)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def close_interrupted(self, now: float, reason: str = RESTARTED) -> list[str]:
        """Mark rounds left running by a previous (leading) fleet process as failed; their ids."""
        with self._lock:
            rows = self._open().execute("SELECT body FROM rounds WHERE state = 'running'").fetchall()
        closed = []
        for (body,) in rows:
            rnd = json.loads(body)
            rnd.update(state="failed", reason=reason, finished_at=now)
            self.save_round(rnd)
            closed.append(rnd["round_id"])
        return closed

    # -- settings the operator changes at run time (e.g. the automatic-round policy) ------------
    def get_value(self, key: str) -> str | None:
        with self._lock:
            row = self._open().execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_value(self, key: str, value: str) -> None:
        with self._lock:
            self._open().execute("INSERT INTO kv (key, value) VALUES (?, ?) "
                                 "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    # -- operator actions -----------------------------------------------------------------------
    def record_action(self, action: str, detail: dict[str, Any], now: float | None = None) -> None:
        with self._lock:
            self._open().execute("INSERT INTO actions (ts, action, detail) VALUES (?, ?, ?)",
                             (time.time() if now is None else now, action,
                              json.dumps(detail, allow_nan=False, separators=(",", ":"))))

    def actions(self, limit: int, before: int | None = None) -> list[dict[str, Any]]:
        """Up to ``limit`` actions with an id below ``before`` (all when None), newest first."""
        with self._lock:
            rows = self._open().execute(
                "SELECT id, ts, action, detail FROM actions WHERE id < ? ORDER BY id DESC LIMIT ?",
                (ACTION_ID_MAX if before is None else min(before, ACTION_ID_MAX), limit)).fetchall()
        return [{"id": i, "ts": ts, "action": a, "detail": json.loads(d)} for i, ts, a, d in rows]
