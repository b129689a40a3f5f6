"""One MQTT connection per process (paho-mqtt 2.x) shared by status, commands and the allreduce.

:class:`MqttLink` owns a single paho client running its network loop in paho's own thread.
It reconnects forever (with back-off) and re-subscribes every filter after a reconnect (the
broker may have restarted and forgotten all sessions: we always connect with a clean session).
Callbacks registered with :meth:`MqttLink.subscribe` run in a worker thread per subscription,
never on paho's network thread, so a slow handler delays only itself: PUBACKs and keep-alives
keep flowing. :meth:`MqttLink.transport` adds an allreduce transport (a thin pipe; reliability is
:mod:`federation.session`'s) on the same connection (see :mod:`federation.mqtt_transport`).

URLs: ``mqtt://[user:pass@]host[:1883]`` and ``mqtts://[user:pass@]host[:8883]`` (TLS).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from pydantic import BaseModel

from federation import topics
from federation.broker import MESSAGE_SIZE_LIMIT
from federation.errors import TransportError
from federation.mqtt_transport import MqttTransport
from federation.transport import DEFAULT_MAX_PAYLOAD, Framing, Payload

__all__ = ["MqttVersion", "BrokerAddress", "TlsOptions", "Subscription", "MqttLink", "parse_url"]

log = logging.getLogger(__name__)

Callback = Callable[[str, bytes], None]


class _Client(paho.Client):
    """paho's client with one copy less per large outgoing packet.

    paho writes ``packet[pos:]`` to the socket; for a ``bytearray`` packet that slice copies the
    whole remainder (256 KiB-1 MiB per allreduce frame), on every partial write. A memoryview
    slices without copying. Only the packet object's type changes; paho's logic is untouched.
    """

    def _packet_queue(self, command, packet, *args, **kwargs):  # type: ignore[no-untyped-def]
        if len(packet) >= 16384 and isinstance(packet, bytearray):
            packet = memoryview(packet)
        return super()._packet_queue(command, packet, *args, **kwargs)


class MqttVersion(enum.StrEnum):
    V311 = "3.1.1"
    V5 = "5"


@dataclass(frozen=True)
class TlsOptions:
    """TLS settings for ``mqtts://``: CA bundle to trust, optional client certificate and key."""

    ca: str | None = None  # None: the system's trust store
    cert: str | None = None
    key: str | None = None
    insecure: bool = False  # skip host-name verification (self-signed test brokers only)


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool
    username: str | None = None
    password: str | None = None


def parse_url(url: str) -> BrokerAddress:
    """Parse ``mqtt://[user:pass@]host:port`` / ``mqtts://...``; TransportError when malformed."""
    hint = "use mqtt://[user:pass@]host:port or mqtts://[user:pass@]host:port"
    try:
        parts = urlsplit(url)
        port = parts.port
    except (ValueError, TypeError) as exc:
        raise TransportError(f"bad broker URL {url!r}: {exc}", hint=hint) from None
    if parts.scheme not in ("mqtt", "mqtts"):
        raise TransportError(f"bad broker URL {url!r}: scheme must be mqtt or mqtts", hint=hint)
    if not parts.hostname:
        raise TransportError(f"bad broker URL {url!r}: no host", hint=hint)
    if parts.path not in ("", "/") or parts.query:
        raise TransportError(f"bad broker URL {url!r}: unexpected path or query", hint=hint)
    tls = parts.scheme == "mqtts"
    return BrokerAddress(
        host=parts.hostname,
        port=port or (8883 if tls else 1883),
        tls=tls,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
    )


def _to_bytes(payload: Payload) -> bytes | bytearray:
    """A ``bytearray`` is handed to paho as is (no copy): the caller gives the buffer up and must
    not change it afterwards (``federation.ringmac`` seals each frame into a fresh one)."""
    if isinstance(payload, (bytes, bytearray)):
        return payload
    if isinstance(payload, BaseModel):
        return payload.model_dump_json().encode()
    if isinstance(payload, str):
        return payload.encode()
    return bytes(payload)


class Subscription:
    """One callback on one topic filter. ``inline`` callbacks run on paho's network thread
    (internal, must be fast and non-blocking); others run in this subscription's own worker."""

    def __init__(self, link: MqttLink, filter: str, callback: Callback, *, inline: bool = False,
                 copy: bool = True) -> None:
        self.link = link
        self.filter = filter
        self.callback = callback
        self.inline = inline
        # copy=False hands paho's own payload buffer (a bytearray nobody else touches) to the
        # callback: no copy of a possibly megabyte-sized message. The callback must not mutate it.
        self.copy = copy
        self.errors = 0  # callback exceptions (logged, never propagated into paho)
        self._cancelled = False
        self._queue: queue.SimpleQueue[tuple[str, bytes] | None] | None = None
        self._thread: threading.Thread | None = None
        if not inline:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name=f"mqtt-sub:{filter}", daemon=True)
            self._thread.start()

    def _call(self, topic: str, payload: bytes) -> None:
        if self._cancelled:  # queued before cancel(): dropped, as cancel() promises
            return
        try:
            self.callback(topic, payload)
        except Exception:  # a handler bug must not kill the connection or the worker
            self.errors += 1
            log.exception("MQTT callback for %s failed", self.filter)

    def _run(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            self._call(*item)

    def deliver(self, topic: str, payload: bytes) -> None:
        if self._queue is None:
            self._call(topic, payload)
        else:
            self._queue.put((topic, payload))

    def cancel(self) -> None:
        """Stop delivering: no callback starts after this returns (messages still queued for the
        worker are dropped; one callback already running finishes on its own thread, so a caller
        that must know none runs any more waits for it itself, as ``Aggregator.close`` does). The
        broker subscription goes when its last callback goes."""
        self._cancelled = True
        self.link._remove(self)
        if self._queue is not None:
            self._queue.put(None)


class MqttLink:
    """A connected paho client (one per process); a :class:`~federation.transport.PubSubLink`.
    See module docstring."""

    # Ring frames travel as built, with their CRC (a SignedLink on top authenticates them).
    framing = Framing()

    def __init__(self, url: str, *, swarm: str = "default", client_id: str, username: str | None = None,
                 password: str | None = None, tls: TlsOptions | dict | None = None,
                 will: tuple[str, bytes | str | BaseModel] | None = None, keepalive: int = 10,
                 protocol: MqttVersion | str = MqttVersion.V311, connect_timeout: float = 10.0,
                 reconnect_max_s: float = 2.0, max_inflight: int = 64,
                 max_message_bytes: int = MESSAGE_SIZE_LIMIT,
                 on_oversized: Callable[[str, int], None] | None = None) -> None:
        self.address = parse_url(url)
        self.url = url
        self.swarm = topics.validate_id(swarm, "swarm id")
        self.client_id = topics.validate_id(client_id, "client id")
        self.keepalive = keepalive
        self.protocol = MqttVersion(protocol)
        self.connects = 0  # successful CONNACKs; > 1 means we reconnected
        # Larger payloads are dropped before any callback sees them (no parse, no signature
        # check, no copy), counted here and reported to on_oversized(topic, size).
        self.max_message_bytes = int(max_message_bytes)
        self.oversized = 0
        self._on_oversized = on_oversized
        self.disconnects = 0
        self._lock = threading.RLock()
        self._subs: dict[str, list[Subscription]] = {}
        # topic -> matching subscriptions; paho's topic_matches_sub builds a matcher per call
        # (~30 us), too slow for every frame. Cleared whenever the subscriptions change.
        self._route_cache: dict[str, list[Subscription]] = {}
        self._on_connect_hooks: list[Callable[[bool], None]] = []
        self._suback: dict[int, threading.Event] = {}
        self._connected = threading.Event()
        self._closed = False
        self._last_refusal: str | None = None
        self._transports: dict[str, MqttTransport] = {}

        v5 = self.protocol is MqttVersion.V5
        self._client = _Client(
            CallbackAPIVersion.VERSION2, client_id=client_id,
            protocol=MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311,
            clean_session=None if v5 else True,
        )
        user = username if username is not None else self.address.username
        pw = password if password is not None else self.address.password
        if user is not None:
            self._client.username_pw_set(user, pw)
        if self.address.tls:
            opts = TlsOptions(**tls) if isinstance(tls, dict) else (tls or TlsOptions())
            self._client.tls_set(ca_certs=opts.ca, certfile=opts.cert, keyfile=opts.key)
            self._client.tls_insecure_set(opts.insecure)
        elif tls:
            raise TransportError(f"TLS options given but {url!r} is not mqtts://",
                                 hint="use an mqtts:// URL to connect with TLS")
        if will is not None:
            # Retained: the will replaces a retained status with "offline" (see membership.py).
            self._client.will_set(will[0], _to_bytes(will[1]), qos=1, retain=True)
        self._client.max_inflight_messages_set(max_inflight)
        self._client.reconnect_delay_set(min_delay=0.2, max_delay=max(0.2, reconnect_max_s))  # type: ignore[arg-type]
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._client.on_socket_open = self._on_socket_open
        self._connect(connect_timeout)

    # --- connection -------------------------------------------------------------------------
    def _connect(self, timeout: float) -> None:
        a = self.address
        try:
            if self.protocol is MqttVersion.V5:
                self._client.connect_async(a.host, a.port, int(self.keepalive), clean_start=True)
            else:
                self._client.connect_async(a.host, a.port, int(self.keepalive))
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot connect to {a.host}:{a.port}: {exc}") from None
        self._client.loop_start()
        deadline = time.monotonic() + timeout
        # A refusal (bad credentials, not authorised) is final: fail fast instead of retrying.
        while not self._connected.wait(0.05) and not self._last_refusal and time.monotonic() < deadline:
            pass
        if not self._connected.is_set():
            refusal = self._last_refusal
            self._client.loop_stop()
            with contextlib.suppress(Exception):
                self._client.disconnect()
            why = f"refused: {refusal}" if refusal else f"no CONNACK within {timeout:.0f} s"
            raise TransportError(f"cannot connect to MQTT broker {a.host}:{a.port} ({why})",
                                 hint="check the broker URL, that the broker runs, and the credentials")

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        """Block until connected (e.g. after a broker restart); False on timeout."""
        return self._connected.wait(timeout)

    def on_connect(self, hook: Callable[[bool], None]) -> None:
        """Call ``hook(reconnected)`` on paho's thread after every successful (re)connect,
        after the subscriptions were renewed. Keep it short: publish, set flags."""
        with self._lock:
            self._on_connect_hooks.append(hook)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._last_refusal = str(reason_code)
            log.warning("broker refused connection: %s", reason_code)
            return
        with self._lock:
            self.connects += 1
            filters = list(self._subs)
            hooks = list(self._on_connect_hooks)
        if filters:
            client.subscribe([(f, 1) for f in filters])
        if self.connects > 1:
            log.info("MQTT reconnected (connect #%d, %d subscriptions renewed)", self.connects, len(filters))
        self._connected.set()
        for hook in hooks:
            try:
                hook(self.connects > 1)
            except Exception:
                log.exception("on_connect hook failed")

    @staticmethod
    def _on_socket_open(client, userdata, sock) -> None:
        # paho leaves Nagle on: small acks would then wait ~40 ms for the peer's delayed ACK,
        # which caps a flow-controlled stream of small messages at a few hundred per second.
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # paho appends each recv() to the packet being read (bytes +=): bigger socket
            # buffers mean fewer, larger pieces for a 256 KiB+ allreduce frame.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connected.clear()
        self.disconnects += 1
        if not self._closed:
            log.info("MQTT connection lost (%s); paho reconnects", reason_code)

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        with self._lock:
            ev = self._suback.pop(mid, None)
        if ev:
            ev.set()

    def _on_message(self, client, userdata, msg: paho.MQTTMessage) -> None:
        size = len(msg.payload)
        if size > self.max_message_bytes:
            self.oversized += 1
            # debug, not warning: a flood of them must not flood the log too (the count says it)
            log.debug("dropped a %d-byte message (over %d bytes) on %s", size, self.max_message_bytes,
                      msg.topic[:200])
            if self._on_oversized is not None:
                try:
                    self._on_oversized(msg.topic, size)
                except Exception:  # noqa: BLE001 - a counter's bug must not kill paho's thread
                    log.exception("on_oversized failed")
            return
        topic = msg.topic
        matched = self._route_cache.get(topic)
        if matched is None:
            with self._lock:
                matched = [s for f, subs in self._subs.items() if paho.topic_matches_sub(f, topic)
                           for s in subs]
                if len(self._route_cache) > 4096:  # e.g. one topic per round id: stay bounded
                    self._route_cache.clear()
                self._route_cache[topic] = matched
        payload = msg.payload
        for sub in matched:
            # copy=False: paho's bytearray, read-only by contract, typed as the bytes it reads as
            sub.deliver(topic, bytes(payload) if sub.copy else cast(bytes, payload))

    # --- pub/sub ----------------------------------------------------------------------------
    def publish(self, topic: str, payload: Payload, retain: bool = False,
                qos: int = 1) -> paho.MQTTMessageInfo:
        """Queue a PUBLISH (never blocks on the broker; QoS 1 survives a reconnect in paho's queue)."""
        info = self._client.publish(topic, _to_bytes(payload), qos=qos, retain=retain)
        if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic} failed: {paho.error_string(info.rc)}")
        return info

    def publish_frame(self, topic: str, frame: bytearray, room: int) -> paho.MQTTMessageInfo:
        """Publish a ring frame built with ``room`` spare bytes after it (this link wants none:
        ``framing.room`` is 0; the spare bytes are left out)."""
        return self.publish(topic, memoryview(frame)[:len(frame) - room] if room else frame)

    def subscribe(self, filter: str, callback: Callback, *, inline: bool = False,
                  wait: float | None = 5.0, copy: bool = True) -> Subscription:
        """Deliver every message matching ``filter`` to ``callback(topic, payload)`` (off paho's
        thread unless ``inline``). With ``wait``, block until the broker acknowledged it.
        ``copy=False``: the payload is paho's read-only-by-contract bytearray, not a bytes copy."""
        sub = Subscription(self, filter, callback, inline=inline, copy=copy)
        ev = threading.Event()
        with self._lock:
            first = filter not in self._subs
            self._subs.setdefault(filter, []).append(sub)
            self._route_cache = {}
            if first and self.connected:
                rc, mid = self._client.subscribe(filter, qos=1)
                if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and mid is not None:
                    self._suback[mid] = ev
                # else: not connected after all; _on_connect re-subscribes every filter
        if first and wait and self.connected and not ev.wait(wait):
            log.warning("no SUBACK for %s within %.1f s", filter, wait)
        return sub

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.filter, [])
            if sub in subs:
                subs.remove(sub)
            self._route_cache = {}
            if not subs and sub.filter in self._subs:
                del self._subs[sub.filter]
                if self.connected:
                    self._client.unsubscribe(sub.filter)

    # --- allreduce transport ----------------------------------------------------------------
    def transport(self, member_id: str, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> MqttTransport:
        """A :class:`~federation.transport.Transport` for ``member_id`` on this connection: its
        inbox is fed by ``topics.allreduce(swarm, member_id)``; sends never block on the receiver.
        The reliability (acks, windows, retransmission, de-duplication) is the session layer's
        (:mod:`federation.session`), above this transport."""
        with self._lock:
            if member_id in self._transports and not self._transports[member_id].closed:
                raise TransportError(f"member {member_id!r} already has a transport on this link")
        t = MqttTransport(self, member_id, max_payload=max_payload)
        with self._lock:
            self._transports[member_id] = t
        return t

    def close(self) -> None:
        """Disconnect cleanly (no Last Will) and stop every worker thread."""
        if self._closed:
            return
        for t in list(self._transports.values()):
            t.close()
        with self._lock:
            subs = [s for lst in self._subs.values() for s in lst]
        for s in subs:
            s.cancel()
        self._closed = True
        with contextlib.suppress(Exception):
            self._client.disconnect()
        self._client.loop_stop()
        self._connected.clear()

    def __enter__(self) -> MqttLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
