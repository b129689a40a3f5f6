"""Start an MQTT broker on a free loopback port: Mosquitto (a child process) or amqtt (in-process).

Tests, benchmarks and the local swarm demo never rely on a system broker: they start their own
with :func:`start_mosquitto` (generated config in a temp dir) or, when Mosquitto is not
installed, :func:`start_embedded` (amqtt, pure Python, ~10x slower). :func:`start_default`
picks the first available. Every broker has ``.url``, ``.port``, ``.stop()``, ``.kill()`` and
``.restart()`` (same port, so clients reconnect to the same URL).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import hashlib
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from federation.errors import TransportError
from fractal.heap import child_env

__all__ = [
    "BrokerKind",
    "Broker",
    "MosquittoBroker",
    "EmbeddedBroker",
    "start_mosquitto",
    "start_embedded",
    "start_default",
    "mosquitto_path",
    "free_port",
    "MESSAGE_SIZE_LIMIT",
    "MAX_PACKET_SIZE",
]

log = logging.getLogger(__name__)

_HOST = "127.0.0.1"

# The swarm's largest MQTT payload, as deploy/mosquitto/mosquitto.conf's message_size_limit (the
# ring's max_payload, at most 1 MiB, plus its envelope fit): the demo's broker refuses larger
# publishes, and members drop larger payloads before parsing them (federation/mqtt.py).
MESSAGE_SIZE_LIMIT = 2 * 1024 * 1024
# A whole packet (payload, topic, headers). Mosquitto disconnects a client that announces a larger
# one as soon as it has read the length, so a huge publish never reaches the broker's memory
# (message_size_limit alone reads the whole packet first, then drops it).
MAX_PACKET_SIZE = MESSAGE_SIZE_LIMIT + 64 * 1024


class BrokerKind(enum.StrEnum):
    MOSQUITTO = "mosquitto"
    EMBEDDED = "amqtt"


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


def mosquitto_path() -> str | None:
    """Path of the mosquitto binary (PATH, then Debian's /usr/sbin), or None."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None


def _wait_accepting(port: int, deadline: float, alive=lambda: True) -> bool:
    while time.monotonic() < deadline:
        if not alive():
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex((_HOST, port)) == 0:
                return True
        time.sleep(0.02)
    return False


def _password_line(user: str, password: str) -> str:
    """One Mosquitto 2.x password-file line (``$7$`` = PBKDF2-SHA512, as ``mosquitto_passwd`` writes)."""
    iterations = 101
    salt = os.urandom(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"{user}:$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


@dataclass
class Broker:
    """A running broker. ``url`` is what :class:`federation.mqtt.MqttLink` takes."""

    kind: BrokerKind
    port: int
    username: str | None = None
    password: str | None = None

    @property
    def host(self) -> str:
        return _HOST

    @property
    def url(self) -> str:
        auth = f"{self.username}:{self.password}@" if self.username else ""
        return f"mqtt://{auth}{_HOST}:{self.port}"

    def stop(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def kill(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def restart(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MosquittoBroker(Broker):
    """A Mosquitto child process with a generated config (persistence off: a restart forgets
    sessions, queued messages and retained messages, like a crashed broker would)."""

    def __init__(self, port: int, workdir: Path, conf: Path, binary: str, *,
                 username: str | None = None, password: str | None = None) -> None:
        super().__init__(BrokerKind.MOSQUITTO, port, username, password)
        self.workdir = workdir
        self.conf = conf
        self.log_path = workdir / "mosquitto.log"
        self._binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._owns_workdir = True

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _start(self, timeout: float = 10.0) -> None:
        with open(self.log_path, "ab") as logf:
            self._proc = subprocess.Popen([self._binary, "-c", str(self.conf)], stdout=logf,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=child_env())  # frame-sized buffers in its heap too
        if not _wait_accepting(self.port, time.monotonic() + timeout, self.running):
            tail = self.log_path.read_text(errors="replace")[-800:]
            self.kill()
            raise TransportError(f"mosquitto did not start on port {self.port}: {tail.strip()}",
                                 hint="check the generated config in " + str(self.conf))

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after ``timeout``)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout)
        self._proc = None

    def kill(self) -> None:
        """Crash the broker (SIGKILL): clients see their connection reset."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(5)
        self._proc = None

    def restart(self, *, hard: bool = False) -> None:
        """Stop (or with ``hard`` kill) and start again on the same port with the same config."""
        (self.kill if hard else self.stop)()
        self._start()

    def close(self) -> None:
        """Stop and delete the temp dir."""
        self.stop()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_mosquitto(port: int | None = None, *, username: str | None = None, password: str | None = None,
                    max_queued_messages: int = 1000, max_inflight_messages: int = 20,
                    message_size_limit: int | None = None, max_packet_size: int | None = None,
                    workdir: str | Path | None = None,
                    tls: dict[str, str] | None = None, extra_config: str = "",
                    timeout: float = 10.0) -> MosquittoBroker:
    """Start Mosquitto on ``127.0.0.1:port`` (a free port by default) and wait until it accepts.

    ``username``/``password`` switch anonymous access off (a password file is generated);
    ``max_queued_messages`` is per client (Mosquitto silently DROPS QoS 1 messages past it);
    ``message_size_limit`` caps a PUBLISH payload in bytes (the broker drops larger ones),
    ``max_packet_size`` a whole packet (the broker disconnects the sender before reading it);
    ``tls`` = ``{"certfile", "keyfile",
    "cafile"?}`` makes the listener TLS-only (URL scheme stays the caller's choice: ``mqtts://``).
    """
    binary = mosquitto_path()
    if binary is None:
        raise TransportError("mosquitto is not installed",
                             hint="apt-get install mosquitto, or use start_embedded() (amqtt)")
    if (username is None) != (password is None):
        raise TransportError("give both username and password, or neither")
    port = port or free_port()
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="fractal-mosquitto-"))
    wd.mkdir(parents=True, exist_ok=True)
    lines = [
        f"listener {port} {_HOST}",
        # Run as whoever started us: as root Mosquitto would switch to user "mosquitto",
        # which cannot read the private temp dir holding the password file.
        f"user {pwd.getpwuid(os.geteuid()).pw_name}",
        "persistence false",
        f"max_queued_messages {int(max_queued_messages)}",
        f"max_inflight_messages {int(max_inflight_messages)}",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "connection_messages false",
        # Keep the broker responsive to a restart on the same port in tests.
        "set_tcp_nodelay true",
    ]
    if message_size_limit:
        lines.append(f"message_size_limit {int(message_size_limit)}")
    if max_packet_size:
        lines.append(f"max_packet_size {int(max_packet_size)}")
    if username is not None:
        pw = wd / "passwd"
        pw.write_text(_password_line(username, password or "") + "\n")
        pw.chmod(0o600)
        lines += ["allow_anonymous false", f"password_file {pw}"]
    else:
        lines.append("allow_anonymous true")
    if tls:
        lines += [f"certfile {tls['certfile']}", f"keyfile {tls['keyfile']}"]
        if tls.get("cafile"):
            lines.append(f"cafile {tls['cafile']}")
    if extra_config:
        lines.append(extra_config)
    conf = wd / "mosquitto.conf"
    conf.write_text("\n".join(lines) + "\n")
    broker = MosquittoBroker(port, wd, conf, binary, username=username, password=password)
    broker._owns_workdir = workdir is None
    broker._start(timeout)
    log.info("mosquitto started on %s (pid %s)", broker.url, broker.pid)
    return broker


class EmbeddedBroker(Broker):
    """amqtt running in a daemon thread with its own asyncio loop (for `pip install`-only setups)."""

    def __init__(self, port: int) -> None:
        super().__init__(BrokerKind.EMBEDDED, port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker = None

    def _config(self) -> dict:
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{_HOST}:{self.port}"}},
            # No $SYS or packet-logging plugins: they cost CPU on every message.
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }

    def _start(self, timeout: float = 10.0) -> None:
        from amqtt.broker import Broker as AmqttBroker  # optional heavy import

        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                broker = AmqttBroker(self._config(), loop=loop)
                self._broker = broker
                loop.run_until_complete(broker.start())
            except BaseException as exc:  # reported to the starting thread
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"amqtt-{self.port}", daemon=True)
        self._thread.start()
        # No TCP probe here: amqtt logs every connection that closes without CONNECT as an
        # error; start() returning means its listeners are bound.
        if not ready.wait(timeout) or errors:
            raise TransportError(f"embedded broker (amqtt) did not start on port {self.port}: "
                                 f"{errors[0] if errors else 'timeout'}")

    def stop(self, timeout: float = 3.0) -> None:
        """Shut amqtt down (its shutdown can hang on connected clients: bounded by ``timeout``)."""
        loop, broker = self._loop, self._broker
        if loop is None or broker is None or not loop.is_running():
            return
        fut = asyncio.run_coroutine_threadsafe(broker.shutdown(), loop)
        with contextlib.suppress(Exception):
            fut.result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread:
            self._thread.join(timeout)
        self._loop = self._broker = self._thread = None

    def kill(self) -> None:
        """An in-process broker cannot be SIGKILLed: this is a stop."""
        self.stop()

    def restart(self, **_: object) -> None:
        self.stop()
        self._start()


def start_embedded(port: int | None = None, *, timeout: float = 10.0) -> EmbeddedBroker:
    """Start amqtt 0.12 on ``127.0.0.1:port`` in a background thread and wait until it accepts."""
    broker = EmbeddedBroker(port or free_port())
    broker._start(timeout)
    return broker


def start_default(port: int | None = None, *, message_size_limit: int | None = None,
                  max_packet_size: int | None = None) -> Broker:
    """Mosquitto when installed (fast, production-grade), else the embedded amqtt broker (which
    has no size limits to set)."""
    if mosquitto_path():
        return start_mosquitto(port, message_size_limit=message_size_limit, max_packet_size=max_packet_size)
    log.warning("mosquitto not found: starting the embedded amqtt broker (slower)")
    return start_embedded(port)
