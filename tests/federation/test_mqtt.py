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
    # The re-SUBSCRIBE goes out in the CONNACK handler, before the hook above fired; the broker
    # handles one client's packets in order, so once a later SUBSCRIBE is acknowledged
    # (subscribe() waits for its SUBACK) the re-subscription is in place too.
    sub.subscribe(f"fractal/v1/{swarm_id}/probe", lambda t, p: None, wait=5)
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


def test_cancel_drops_what_the_subscription_still_had_queued(mosquitto, mqtt_link_factory, swarm_id):
    """After Subscription.cancel() returns no callback of it starts, even for messages already
    queued for its worker (a closed aggregator must not take an update after close)."""
    link = mqtt_link_factory(mosquitto, "a")
    other = mqtt_link_factory(mosquitto, "b")
    topic = f"fractal/v1/{swarm_id}/cancel"
    got: list[bytes] = []
    started, release, all_in, fourth = (threading.Event() for _ in range(4))
    seen: list[bytes] = []

    def blocked(t, payload):
        got.append(payload)
        started.set()
        assert release.wait(10)

    def counter(t, payload):  # registered second: a message reached it after the first one
        seen.append(payload)
        if len(seen) == 3:
            all_in.set()
        if len(seen) == 4:
            fourth.set()

    sub = link.subscribe(topic, blocked)
    link.subscribe(topic, counter)
    for k in range(3):
        other.publish(topic, f"m{k}")
    assert started.wait(10) and all_in.wait(10)  # m1 and m2 wait in the blocked worker's queue
    sub.cancel()
    release.set()
    other.publish(topic, "m3")
    assert fourth.wait(10)  # the link still delivers to the other subscription, not to this one
    assert sub._thread is not None
    sub._thread.join(10)  # the worker ends at the cancel's sentinel, after the queued messages
    assert not sub._thread.is_alive()
    assert got == [b"m0"]
