"""PostgreSQL fixtures (auto-loaded by ``tests/conftest.py``), for the fleet's shared store.

* ``postgres``: one real PostgreSQL server for the session, from the Debian package
  (deploy/install-system-deps.sh installs ``postgresql``), initialised into a fresh directory
  and listening on a free loopback port (never a system server). PostgreSQL refuses to run as
  root, so when the tests run as root the server runs as the package's ``postgres`` user.
  Do not stop it; each test takes a database of its own (``pg_url``).
* ``pg_url``: a ``postgresql://`` URL of a fresh, empty database on that server.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from federation.broker import free_port

_dbs = itertools.count()
USER = "fractal"


def pg_bindir() -> Path:
    """The newest installed PostgreSQL's binaries (Debian keeps them per major version)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(Path(p).parent.parent.name))
    if not found:
        raise RuntimeError("PostgreSQL is not installed: run deploy/install-system-deps.sh")
    return Path(found[-1]).parent


@dataclass
class PostgresServer:
    port: int
    proc: subprocess.Popen
    workdir: Path

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self) -> str:
        import psycopg

        name = f"t{os.getpid()}_{next(_dbs)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: PostgreSQL's fast shutdown
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """initdb into a fresh directory and start ``postgres`` on a free loopback port; wait until it
    accepts connections."""
    import psycopg

    bindir = pg_bindir()
    # Not under pytest's tmp dir: that one is private to root, and the server may run as postgres.
    workdir = Path(tempfile.mkdtemp(prefix="fractal-pg-"))
    data, sock = workdir / "data", workdir / "sock"
    sock.mkdir()
    user = None
    if os.geteuid() == 0:
        user = "postgres"
        pw = pwd.getpwnam(user)
        for p in (workdir, sock):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8",
                    "--no-sync"], check=True, capture_output=True, user=user, cwd=workdir)
    port = free_port()
    log = open(workdir / "postgres.log", "wb")  # noqa: SIM115 (the server writes it until close)
    # A throw-away server: no fsync. Short TCP keepalives, as docs/operations.md advises for a
    # fleet's leadership (a leader host that vanishes without closing its socket loses the lock).
    proc = subprocess.Popen([str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(sock),
                             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                             "-c", "full_page_writes=off", "-c", "synchronous_commit=off",
                             "-c", "tcp_keepalives_idle=5", "-c", "tcp_keepalives_interval=2",
                             "-c", "tcp_keepalives_count=3"],
                            stdout=log, stderr=subprocess.STDOUT, user=user, cwd=workdir)
    log.close()
    server = PostgresServer(port, proc, workdir)
    deadline = time.monotonic() + 60
    while True:  # ready when it accepts a connection (or dead: say why)
        if proc.poll() is not None:
            text = (workdir / "postgres.log").read_text(errors="replace")
            shutil.rmtree(workdir, ignore_errors=True)
            raise RuntimeError(f"postgres exited with {proc.returncode}:\n{text[-2000:]}")
        try:
            psycopg.connect(server.url(), connect_timeout=5).close()
            return server
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                server.close()
                raise
            time.sleep(0.1)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    server = start_postgres()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> str:
    """A fresh, empty database on the session's PostgreSQL."""
    return postgres.create_database()
