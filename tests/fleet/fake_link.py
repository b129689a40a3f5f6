"""An in-memory stand-in for ``federation.mqtt.MqttLink``: a
:class:`~federation.transport.PubSubLink` whose messages go to its own subscribers, so the fleet
app can be exercised without a broker (fuzzing, unit tests)."""

from __future__ import annotations

from collections.abc import Callable

from paho.mqtt.client import topic_matches_sub

from federation.mqtt_transport import MqttTransport
from federation.transport import DEFAULT_MAX_PAYLOAD, Callback, Framing, Payload


class _Done:
    """A publish that is already done (delivered synchronously)."""

    def wait_for_publish(self, timeout: float | None = None) -> None:
        return None


class _Sub:
    def __init__(self, link: FakeLink, entry: tuple[str, Callback]) -> None:
        self.link, self.entry = link, entry

    def cancel(self) -> None:
        if self.entry in self.link.subs:
            self.link.subs.remove(self.entry)


class FakeLink:
    framing = Framing()

    def __init__(self, swarm: str = "default") -> None:
        self.swarm = swarm
        self.published: list[tuple[str, bytes]] = []
        self.subs: list[tuple[str, Callback]] = []
        self.hooks: list[Callable[[bool], None]] = []
        self.connected = True

    def publish(self, topic: str, payload: Payload, *, retain: bool = False, qos: int = 1) -> _Done:
        if isinstance(payload, str):
            data = payload.encode()
        elif isinstance(payload, (bytes, bytearray, memoryview)):
            data = bytes(payload)
        else:
            data = payload.model_dump_json().encode()
        self.published.append((topic, data))
        self.deliver(topic, data)
        return _Done()

    def publish_frame(self, topic: str, frame: bytearray, room: int) -> _Done:
        return self.publish(topic, memoryview(frame)[:len(frame) - room])

    def subscribe(self, filter: str, callback: Callback, *, inline: bool = False, copy: bool = True) -> _Sub:
        entry = (filter, callback)
        self.subs.append(entry)
        return _Sub(self, entry)

    def on_connect(self, hook: Callable[[bool], None]) -> None:
        self.hooks.append(hook)

    def transport(self, member_id: str, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> MqttTransport:
        return MqttTransport(self, member_id, max_payload=max_payload)

    def deliver(self, topic: str, payload: bytes) -> None:
        for f, cb in list(self.subs):
            if topic_matches_sub(f, topic):
                cb(topic, payload)

    def close(self) -> None:
        self.connected = False
