"""Issue 26, finding 10: the demo's broker has the production config's size limits.

Two 200 MiB publishes from an anonymous client on `fractal swarm`'s broker grew every node by
200 MiB and the broker to ~1 GB. Here the broker the demo starts (deploy.swarm.start_demo_broker)
gets a 200 MiB PUBLISH, streamed lazily over a raw socket: it must disconnect the sender after the
packet's length (no more than a few MiB accepted), deliver nothing, and keep its memory.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from deploy.swarm import start_demo_broker
from federation.broker import MAX_PACKET_SIZE, MESSAGE_SIZE_LIMIT, BrokerKind
from federation.mqtt import MqttLink

pytestmark = pytest.mark.mosquitto

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _hwm_kib(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", text, re.M).group(1))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _connect(port: int, client_id: bytes) -> socket.socket:
    """A raw MQTT 3.1.1 client, anonymous, clean session, CONNACK read."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(client_id).to_bytes(2, "big") + client_id
    s.sendall(b"\x10" + _varint(len(body)) + body)
    assert s.recv(4) == b"\x20\x02\x00\x00", "CONNACK"
    return s


def _publish_huge(port: int, topic: bytes, size: int) -> int:
    """PUBLISH (QoS 0) a ``size``-byte payload generated 1 MiB at a time; returns bytes sent
    before the broker cut the connection."""
    s = _connect(port, b"attacker")
    head = b"\x30" + _varint(2 + len(topic) + size) + len(topic).to_bytes(2, "big") + topic
    sent = 0
    block = b"\xa5" * MIB
    try:
        s.sendall(head)
        while sent < size:
            s.sendall(block[:min(MIB, size - sent)])
            sent += min(MIB, size - sent)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        s.close()
    return sent


def test_the_demo_broker_refuses_a_200_mib_publish():
    broker = start_demo_broker()
    try:
        assert broker.kind is BrokerKind.MOSQUITTO
        got: list[int] = []
        # a subscriber that would take anything (its own drop limit off): nothing big may arrive
        sub = MqttLink(broker.url, swarm="demo", client_id="watcher", max_message_bytes=1 << 30)
        sub.subscribe("#", lambda topic, payload: got.append(len(payload)))
        before = _hwm_kib(broker.pid)
        t0 = time.monotonic()
        sent = _publish_huge(broker.port, b"fractal/v1/demo/status/node-1", 200 * MIB)
        assert sent < 16 * MIB, f"the broker read {sent >> 20} MiB of the publish"
        assert time.monotonic() - t0 < 10
        # the broker still works, for a normal message, and delivered nothing else
        ok = MqttLink(broker.url, swarm="demo", client_id="normal")
        ok.publish("fractal/v1/demo/x", b"small").wait_for_publish(5)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == [5], got
        grew = (_hwm_kib(broker.pid) - before) >> 10
        assert grew < 20, f"the broker's peak RSS grew by {grew} MiB"
        ok.close()
        sub.close()
    finally:
        broker.close()


def test_the_limits_are_the_production_configs():
    conf = (ROOT / "deploy/mosquitto/mosquitto.conf").read_text()
    assert re.search(rf"^message_size_limit {MESSAGE_SIZE_LIMIT}$", conf, re.M)
    assert re.search(rf"^max_packet_size {MAX_PACKET_SIZE}$", conf, re.M)
    assert MESSAGE_SIZE_LIMIT >= (1 << 20) + 4096  # the ring's largest max_payload and its envelope fit
