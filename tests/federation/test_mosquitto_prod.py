"""The production broker config (deploy/mosquitto/mosquitto.conf) as a second wall, tested against
a real Mosquitto started with that file (paths rewritten to a temp dir, TLS certificates from
deploy/certs.sh, users/ACLs from deploy/keys.py), with plain paho clients as attackers."""

from __future__ import annotations

import os
import pwd
import queue
import re
import signal
import ssl
import subprocess
import threading
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from deploy.keys import provision
from federation import topics
from federation.broker import free_port, mosquitto_path

ROOT = Path(__file__).resolve().parents[2]
SWARM = "prod"


class Client:
    """One paho client; ``connected`` / ``refused`` / ``dropped`` are events, ``inbox`` a queue."""

    def __init__(self, port: int, ca: Path, user: str | None, password: str | None,
                 client_id: str | None = None) -> None:
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.connected, self.refused, self.dropped = threading.Event(), threading.Event(), threading.Event()
        self.subscribed = threading.Event()
        self.rc: object = None
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or f"c-{uuid.uuid4().hex[:8]}",
                        protocol=mqtt.MQTTv311)
        c.tls_set(ca_certs=str(ca), tls_version=ssl.PROTOCOL_TLS_CLIENT)
        if user is not None:
            c.username_pw_set(user, password)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = lambda _c, _u, m: self.inbox.put((m.topic, bytes(m.payload)))
        c.on_subscribe = lambda *_a: self.subscribed.set()
        self.c = c
        c.connect_async("localhost", port, keepalive=30)
        c.loop_start()

    def _on_connect(self, _c, _u, _f, rc, _p) -> None:
        self.rc = rc
        (self.refused if rc.is_failure else self.connected).set()

    def _on_disconnect(self, _c, _u, _f, rc, _p) -> None:
        self.dropped.set()

    def wait(self) -> bool:
        """True if the broker accepted the CONNECT, False if it refused it (or the link dropped)."""
        for _ in range(100):
            if self.connected.wait(0.1):
                return True
            if self.refused.is_set() or self.dropped.is_set():
                self.c.disconnect()
                return False
        raise AssertionError("no CONNACK within 10 s")

    def sub(self, topic: str) -> None:
        self.subscribed.clear()
        self.c.subscribe(topic, qos=1)
        assert self.subscribed.wait(5)

    def pub(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def prod(tmp_path):
    """Mosquitto with deploy/mosquitto/mosquitto.conf; yields (port, ca, passwords, reprovision)."""
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(ROOT / "deploy/certs.sh"), str(certs), "localhost"], check=True,
                   capture_output=True, timeout=120)
    base = tmp_path / "fractal"
    provision(base, SWARM, ["node-1", "node-2", "node-3"])
    passwords = {p.stem: p.read_text().strip() for p in (base / "credentials").glob("*.pass")}
    port = free_port()
    conf = (ROOT / "deploy/mosquitto/mosquitto.conf").read_text()
    assert "use_username_as_clientid true" in conf and "allow_anonymous false" in conf
    conf = (conf.replace("/etc/mosquitto/fractal/certs", str(certs))
            .replace("/etc/mosquitto/fractal", str(base))
            .replace("listener 8883 0.0.0.0", f"listener {port} 127.0.0.1")
            .replace("log_dest syslog", "log_dest stderr"))
    assert "/etc/mosquitto" not in re.sub(r"#.*", "", conf)
    # As root Mosquitto would switch to user "mosquitto", which cannot read pytest's tmp dir.
    path = tmp_path / "mosquitto.conf"
    path.write_text(conf + f"\nuser {pwd.getpwuid(os.geteuid()).pw_name}\n")
    log = open(tmp_path / "mosquitto.log", "wb")
    proc = subprocess.Popen([mosquitto_path(), "-c", str(path)], stdout=log, stderr=subprocess.STDOUT)
    import socket
    import time

    deadline = time.monotonic() + 10
    while True:
        assert proc.poll() is None, (tmp_path / "mosquitto.log").read_text()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert time.monotonic() < deadline, "mosquitto did not start"
        time.sleep(0.05)

    def reprovision(**kw) -> None:
        provision(base, SWARM, ["node-1", "node-2", "node-3"], **kw)
        proc.send_signal(signal.SIGHUP)  # Mosquitto re-reads the password file and ACLs

    clients: list[Client] = []

    def client(user, password, client_id=None) -> Client:
        c = Client(port, certs / "ca.crt", user, password, client_id)
        clients.append(c)
        return c

    client.port = port  # type: ignore[attr-defined]
    try:
        yield client, passwords, reprovision, tmp_path / "mosquitto.log"
    finally:
        for c in clients:
            c.close()
        proc.terminate()
        proc.wait(5)
        log.close()


def test_tls_only_with_the_swarm_ca(prod):
    client, passwords, _, _ = prod
    import socket

    with socket.create_connection(("127.0.0.1", client.port)) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):  # the system trust store does not know our CA
            ssl.create_default_context().wrap_socket(raw, server_hostname="localhost")
    assert client("node-1", passwords["node-1"]).wait()


def test_anonymous_and_wrong_password_refused(prod):
    client, passwords, _, _ = prod
    assert not client(None, None).wait()
    assert not client("node-1", "wrong-password").wait()
    assert not client("nobody", passwords["node-1"]).wait()
    assert client("node-1", passwords["node-1"]).wait()


def test_node_cannot_publish_others_status_or_commands(prod):
    client, pw, _, _ = prod
    fleet = client("fleet", pw["fleet"])
    n1 = client("node-1", pw["node-1"])
    n2 = client("node-2", pw["node-2"])
    assert fleet.wait() and n1.wait() and n2.wait()
    fleet.sub(f"fractal/v1/{SWARM}/#")
    n2.sub(topics.command(SWARM))
    n2.sub(topics.allreduce(SWARM, "node-2"))
    n1.pub(topics.status(SWARM, "node-2"), b'{"state":"offline"}', retain=True)  # forged status
    n1.pub(topics.command(SWARM), b'{"kind":"round.start","lr":1e30}')  # forged command
    n1.pub(topics.round_events(SWARM, "r1", "node-2"), b'{"kind":"round.done"}')  # forged event
    n1.pub(f"fractal/v1/{SWARM}/elsewhere", b"x")
    n1.pub(topics.allreduce(SWARM, "node-2"), b"frame")  # allowed: ring frame to a peer
    n1.pub(topics.status(SWARM, "node-1"), b"mine")  # allowed: its own status (the barrier)
    got = [fleet.inbox.get(timeout=5) for _ in range(2)]
    assert got == [(topics.allreduce(SWARM, "node-2"), b"frame"), (topics.status(SWARM, "node-1"), b"mine")]
    assert n2.inbox.get(timeout=5) == (topics.allreduce(SWARM, "node-2"), b"frame")
    fleet.pub(topics.command(SWARM), b"from-fleet")  # the fleet may command
    assert n2.inbox.get(timeout=5) == (topics.command(SWARM), b"from-fleet")
    assert fleet.inbox.get(timeout=5) == (topics.command(SWARM), b"from-fleet")
    assert fleet.inbox.empty() and n2.inbox.empty()
    # A node cannot read another's ring inbox (subscription granted, nothing delivered).
    n1.sub(topics.allreduce(SWARM, "node-3"))
    n1.sub(topics.allreduce(SWARM, "node-1"))
    fleet.pub(topics.allreduce(SWARM, "node-3"), b"secret")
    fleet.pub(topics.allreduce(SWARM, "node-1"), b"barrier")
    assert n1.inbox.get(timeout=5) == (topics.allreduce(SWARM, "node-1"), b"barrier")
    assert n1.inbox.empty()


def test_client_id_takeover_impossible(prod):
    client, pw, _, _ = prod
    victim = client("node-1", pw["node-1"], client_id="node-1")
    assert victim.wait()
    victim.sub(topics.allreduce(SWARM, "node-1"))
    # node-2 (valid credentials) connects with node-1's client id: with use_username_as_clientid
    # its client id becomes "node-2", so node-1's session is not kicked out.
    attacker = client("node-2", pw["node-2"], client_id="node-1")
    assert attacker.wait()
    fleet = client("fleet", pw["fleet"], client_id="node-1")  # even the fleet's login
    assert fleet.wait()
    fleet.pub(topics.allreduce(SWARM, "node-1"), b"still-here")
    assert victim.inbox.get(timeout=5) == (topics.allreduce(SWARM, "node-1"), b"still-here")
    assert not victim.dropped.is_set()


def test_revoked_node_is_refused(prod):
    client, pw, reprovision, log = prod
    n3 = client("node-3", pw["node-3"])
    assert n3.wait()
    reprovision(revoke=["node-3"])
    # The reload is asynchronous: Mosquitto drops the revoked node's session when it applies it.
    assert n3.dropped.wait(10), log.read_text()
    assert not client("node-3", pw["node-3"]).wait()
    assert client("node-1", pw["node-1"]).wait()  # the others keep their access
