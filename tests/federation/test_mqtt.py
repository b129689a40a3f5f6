"""MqttLink and the MQTT transport against a real Mosquitto started by the tests."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from federation import topics
from federation.broker import free_port, start_mosquitto
from federation.errors import TransportError
from federation.messages import NodeState, NodeStatus
from federation.mqtt import MqttLink, TlsOptions, parse_url

pytestmark = pytest.mark.mosquitto


def test_parse_url():
    a = parse_url("mqtt://u%40x:p%3Aw@broker.local:1884")
    assert (a.host, a.port, a.tls, a.username, a.password) == ("broker.local", 1884, False, "u@x", "p:w")
    b = parse_url("mqtts://10.0.0.2")
    assert (b.port, b.tls, b.username) == (8883, True, None)
    assert parse_url("mqtt://h").port == 1883
    for bad in ("http://h:1", "mqtt://:1883", "mqtt://h:99999", "mqtt://h:1/x", "h:1883"):
        with pytest.raises(TransportError):
            parse_url(bad)


def test_unreachable_broker_is_one_clear_error():
    t = time.monotonic()
    with pytest.raises(TransportError, match="cannot connect") as exc:
        MqttLink(f"mqtt://127.0.0.1:{free_port()}", client_id="nobody", connect_timeout=1.5)
    assert exc.value.hint and time.monotonic() - t < 5


def test_publish_subscribe_models_and_slow_handlers(mosquitto, mqtt_link_factory, swarm_id):
    link = mqtt_link_factory(mosquitto, "a")
    other = mqtt_link_factory(mosquitto, "b")
    fast: list[tuple[float, str]] = []
    slow_started = threading.Event()
    release = threading.Event()
    got_fast = threading.Event()

    def slow(topic, payload):
        slow_started.set()
        release.wait(10)

    def quick(topic, payload):
        fast.append((time.monotonic(), threading.current_thread().name))
        got_fast.set()

    link.subscribe(f"fractal/v1/{swarm_id}/slow", slow)
    link.subscribe(topics.status_all(swarm_id), quick)
    other.publish(f"fractal/v1/{swarm_id}/slow", "block")
    assert slow_started.wait(5)
    st = NodeStatus(node_id="n1", state=NodeState.ONLINE)
    other.publish(topics.status(swarm_id, "n1"), st, retain=True)
    # The slow handler is still blocked, yet the other subscription (and paho) keep going.
    assert got_fast.wait(5), "a slow callback blocked another subscription"
    assert not fast[0][1].startswith("paho") and "mqtt-sub" in fast[0][1]
    release.set()
    # retained + model payload: a late subscriber gets the NodeStatus JSON
    late: list[bytes] = []
    ev = threading.Event()
    other.subscribe(topics.status(swarm_id, "n1"), lambda t, p: (late.append(p), ev.set()))
    assert ev.wait(5) and NodeStatus.model_validate_json(late[0]).node_id == "n1"
    other.publish(topics.status(swarm_id, "n1"), b"", retain=True)


def test_mqtt_v5(mosquitto, mqtt_link_factory, swarm_id):
    link = mqtt_link_factory(mosquitto, "v5", protocol="5")
    ev = threading.Event()
    link.subscribe(f"fractal/v1/{swarm_id}/v5", lambda t, p: ev.set())
    link.publish(f"fractal/v1/{swarm_id}/v5", b"x")
    assert ev.wait(5)


def test_reconnect_resubscribes_after_broker_restart(fresh_mosquitto, mqtt_link_factory, swarm_id):
    sub = mqtt_link_factory(fresh_mosquitto, "sub")
    got: list[bytes] = []
    ev = threading.Event()
    sub.subscribe(f"fractal/v1/{swarm_id}/x", lambda t, p: (got.append(p), ev.set()))
    reconnected = threading.Event()
    sub.on_connect(lambda again: again and reconnected.set())
    fresh_mosquitto.restart(hard=True)  # a crash: no session survives (persistence off)
    assert reconnected.wait(10) and sub.connects == 2
    pub = mqtt_link_factory(fresh_mosquitto, "pub")
    time.sleep(0.2)  # the re-SUBSCRIBE is sent right after CONNACK; give it a moment
    pub.publish(f"fractal/v1/{swarm_id}/x", b"after restart")
    assert ev.wait(5) and got == [b"after restart"]


def test_transport_roundtrip_and_payload_limit(mosquitto, mqtt_link_factory):
    ta = mqtt_link_factory(mosquitto, "a").transport("a", max_payload=1024)
    tb = mqtt_link_factory(mosquitto, "b").transport("b", max_payload=1024)
    ta.send("b", b"x" * 1024)
    tb.send("b", b"self")  # to oneself: straight into the inbox
    got = {tb.recv(5), tb.recv(5)}
    assert got == {b"x" * 1024, b"self"}
    assert tb.recv(0.1) is None
    with pytest.raises(TransportError, match="max_payload"):
        ta.send("b", b"x" * 1025)


def _slow_receiver(link, swarm, member, delay):
    """Slow down the receiver's network thread: the broker's per-client queue then fills up."""
    link.subscribe(topics.allreduce(swarm, member), lambda t, p: time.sleep(delay), inline=True)


def test_flow_control_survives_a_tiny_broker_queue(fresh_mosquitto, mqtt_link_factory, swarm_id):
    n, delay = 800, 0.002
    # Control: raw QoS 1 publishes to a slow subscriber lose messages once the broker's queue
    # (max_queued_messages=50) overflows, so this broker really would drop.
    rx = mqtt_link_factory(fresh_mosquitto, "raw-rx")
    count = [0]
    rx.subscribe(topics.allreduce(swarm_id, "raw"), lambda t, p: count.__setitem__(0, count[0] + 1),
                 inline=True)
    _slow_receiver(rx, swarm_id, "raw", delay)
    tx = mqtt_link_factory(fresh_mosquitto, "raw-tx")
    for _ in range(n):
        tx.publish(topics.allreduce(swarm_id, "raw"), b"y" * 256)
    time.sleep(n * delay + 1.0)
    assert count[0] < n, "the test broker did not drop anything: the flow-control check would prove nothing"

    # The same burst through flow-controlled transports arrives complete and exactly once.
    ra = mqtt_link_factory(fresh_mosquitto, "fa")
    rb = mqtt_link_factory(fresh_mosquitto, "fb")
    ta = ra.transport("a", max_payload=512, window=16, flow_control=True)
    tb = rb.transport("b", max_payload=512, window=16, flow_control=True)
    _slow_receiver(rb, swarm_id, "b", delay)
    for i in range(n):
        ta.send("b", i.to_bytes(4, "big") * 64)  # returns at once: the rest waits in the backlog
    assert ta.pending("b") > 16
    seen = []
    deadline = time.monotonic() + 30
    while len(seen) < n and time.monotonic() < deadline:
        m = tb.recv(1)
        if m is not None:
            seen.append(int.from_bytes(m[:4], "big"))
    assert sorted(seen) == list(range(n))
    assert tb.recv(0.5) is None and tb.stats["rejected"] == 0


def test_flow_control_retransmits_across_a_broker_crash(fresh_mosquitto, mqtt_link_factory):
    kw = {"window": 4, "retransmit_s": 1.0, "flow_control": True}
    ta = mqtt_link_factory(fresh_mosquitto, "ca").transport("a", **kw)
    tb = mqtt_link_factory(fresh_mosquitto, "cb").transport("b", **kw)
    _slow_receiver(tb.link, tb.link.swarm, "b", 0.05)
    for i in range(40):
        ta.send("b", bytes([i]) * 100)
    time.sleep(0.3)
    fresh_mosquitto.restart(hard=True)
    got = set()
    deadline = time.monotonic() + 30
    while len(got) < 40 and time.monotonic() < deadline:
        m = tb.recv(1)
        if m is not None:
            assert m[0] not in got, "duplicate delivered"
            got.add(m[0])
    assert got == set(range(40))


def _make_certs(d):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def pem(obj, path):
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM) if hasattr(obj, "public_bytes")
                         and not hasattr(obj, "private_bytes") else obj.private_bytes(
                             serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption()))
        return str(path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test-ca")).issuer_name(name("test-ca"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
                __import__("ipaddress").ip_address("127.0.0.1"))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return pem(ca, d / "ca.pem"), pem(cert, d / "server.pem"), pem(key, d / "server.key")


def test_tls_mqtts(tmp_path):
    ca, cert, key = _make_certs(tmp_path)
    b = start_mosquitto(workdir=tmp_path / "b", tls={"certfile": cert, "keyfile": key})
    try:
        url = f"mqtts://127.0.0.1:{b.port}"
        with MqttLink(url, client_id="tls", tls=TlsOptions(ca=ca)) as link:
            ev = threading.Event()
            link.subscribe("t/tls", lambda t, p: ev.set())
            link.publish("t/tls", b"secret")
            assert ev.wait(5)
        with pytest.raises(TransportError):  # plain MQTT to a TLS listener
            MqttLink(f"mqtt://127.0.0.1:{b.port}", client_id="plain", connect_timeout=1.5)
        with pytest.raises(TransportError, match="mqtts"):
            MqttLink(f"mqtt://127.0.0.1:{b.port}", client_id="x", tls={"ca": ca})
    finally:
        b.close()
