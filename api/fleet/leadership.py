"""Which fleet process leads: the one that acts (publishes commands, runs rounds, writes).

With SQLite the fleet is one process and always leads (:class:`SoleLeader`). With PostgreSQL
several ``fractal fleet`` processes of one swarm share the database and the broker, and the one
holding a session-level advisory lock leads (:class:`PostgresLeader`); the others follow: they
serve reads and the dashboard from the shared database and answer writes with 503 and the
leader's address (api/fleet/gate.py).

Why an advisory lock on a dedicated session rather than a lease row: PostgreSQL itself releases
the lock when the session ends, so a leader killed outright (SIGKILL, OOM) loses it as soon as
the server sees its connection close (at once on a live host: the kernel closes the socket), and
no clock or renewal period enters into it. A leader whose host vanishes without closing the
socket is noticed by TCP keepalives (the server's ``tcp_keepalives_*``; docs/operations.md gives
values bounding it near 11 s). The lock's session does nothing else, so a slow query never
delays the check. The leader runs ``SELECT 1`` on that session every ``leader_check_s``; when the
session is gone it stops acting at once and its process exits (fail-stop: it cannot know whether
another process already leads, and a restarted process simply follows).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

from api.fleet.store import redact

__all__ = ["Leadership", "PostgresLeader", "SoleLeader", "lock_key"]

log = logging.getLogger("fractal.fleet.leader")

Elected = Callable[[], None]
Lost = Callable[[str], None]


def _ident() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def lock_key(swarm: str) -> int:
    """The advisory lock's key for ``swarm``: a signed 64-bit number from its name."""
    digest = hashlib.sha256(b"fractal-edge fleet leader\0" + swarm.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class Leadership(Protocol):
    """Calls ``on_elected`` once this process leads, ``on_lost`` if it stops leading."""

    @property
    def leading(self) -> bool: ...
    @property
    def ident(self) -> str: ...  # this process, as the others see it: "host:pid"
    def start(self, on_elected: Elected, on_lost: Lost) -> None: ...
    def stop(self) -> None: ...


class SoleLeader:
    """The embedded fleet (SQLite): the only process, it leads from the start."""

    leading = True

    @property
    def ident(self) -> str:
        return _ident()

    def start(self, on_elected: Elected, on_lost: Lost) -> None:
        pass  # nothing to win: the service acted as leader from its construction

    def stop(self) -> None:
        pass


class PostgresLeader:
    """Leads while it holds ``pg_advisory_lock(lock_key(swarm))`` on its own connection."""

    def __init__(self, url: str, swarm: str, *, check_s: float) -> None:
        self.url = url
        self.key = lock_key(swarm)
        self.check_s = check_s
        self._leading = threading.Event()
        self._stop = threading.Event()
        self._conn: Any = None
        self._thread: threading.Thread | None = None

    @property
    def ident(self) -> str:
        return _ident()

    @property
    def leading(self) -> bool:
        return self._leading.is_set()

    def start(self, on_elected: Elected, on_lost: Lost) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(on_elected, on_lost),
                                        name="fleet-leadership", daemon=True)
        self._thread.start()

    def _connect(self) -> Any:
        from api.fleet.store import _connect_postgres

        return _connect_postgres(self.url, application_name="fractal-fleet-leadership")

    def _run(self, on_elected: Elected, on_lost: Lost) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            delay = self.check_s
            if self.leading:
                try:
                    self._conn.execute("SELECT 1")
                except Exception as exc:
                    self._leading.clear()
                    self._drop()
                    why = f"the leadership session to {redact(self.url)} ended ({str(exc).strip()[:200]})"
                    log.error("%s: this process stops leading", why)
                    on_lost(why)
                    return
                continue
            try:
                if self._conn is None:
                    self._conn = self._connect()
                got = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()[0]
            except Exception as exc:  # the server is down: keep following, try again
                log.warning("cannot reach %s to check the fleet's leadership: %s", redact(self.url),
                            str(exc).strip()[:200])
                self._drop()
                continue
            if got:
                log.warning("this fleet process (%s) leads", self.ident)
                try:
                    # Before `leading` turns true: a write let in earlier would start a round that
                    # the takeover then fails as the old leader's.
                    on_elected()
                except Exception:  # the takeover failed half-way: give the lead to another process
                    log.exception("taking the lead failed")
                    self._drop()
                    on_lost("taking the lead failed (see the log)")
                    return
                self._leading.set()

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def stop(self) -> None:
        """Stop checking and close the session: the lock is released at once (a clean handover)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._leading.clear()
        self._drop()
