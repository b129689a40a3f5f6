"""The broker launchers: a real Mosquitto (and amqtt) on a free loopback port, restartable."""

from __future__ import annotations

import socket
import threading

import pytest

from federation.broker import start_embedded, start_mosquitto
from federation.errors import TransportError
from federation.mqtt import MqttLink

pytestmark = pytest.mark.mosquitto


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _roundtrip(url: str, client: str, **kw) -> bytes | None:
    got: list[bytes] = []
    done = threading.Event()
    with MqttLink(url, client_id=client, **kw) as link:
        link.subscribe("t/x", lambda t, p: (got.append(p), done.set()))
        link.publish("t/x", b"hello")
        done.wait(5)
    return got[0] if got else None


def test_mosquitto_start_stop_restart_kill(tmp_path):
    b = start_mosquitto(workdir=tmp_path, max_queued_messages=50, message_size_limit=4096)
    try:
        conf = (tmp_path / "mosquitto.conf").read_text()
        assert "127.0.0.1" in conf and "persistence false" in conf and "max_queued_messages 50" in conf
        assert b.url == f"mqtt://127.0.0.1:{b.port}" and _accepts(b.port)
        assert _roundtrip(b.url, "c1") == b"hello"
        pid = b.pid
        b.restart()
        assert b.pid != pid and _accepts(b.port)
        assert _roundtrip(b.url, "c2") == b"hello"
        b.kill()
        assert not _accepts(b.port) and not b.running()
        b.restart()
        assert _accepts(b.port)
    finally:
        b.close()
    assert not _accepts(b.port)


def test_mosquitto_password_file(tmp_path):
    b = start_mosquitto(workdir=tmp_path, username="fleet", password="s3cret")
    try:
        assert b.url == f"mqtt://fleet:s3cret@127.0.0.1:{b.port}"
        assert _roundtrip(b.url, "ok") == b"hello"
        with pytest.raises(TransportError, match="refused"):
            MqttLink(f"mqtt://fleet:wrong@127.0.0.1:{b.port}", client_id="bad", connect_timeout=3)
        with pytest.raises(TransportError, match="refused"):
            MqttLink(f"mqtt://127.0.0.1:{b.port}", client_id="anon", connect_timeout=3)
    finally:
        b.close()


def test_embedded_broker_roundtrip_and_restart():
    b = start_embedded()
    try:
        assert _roundtrip(b.url, "e1") == b"hello"
        b.restart()
        assert _roundtrip(b.url, "e2") == b"hello"
    finally:
        b.stop()
    assert not _accepts(b.port)
