"""An in-memory stand-in for ``federation.mqtt.MqttLink`` (publish/subscribe/close), so the fleet
app can be exercised without a broker (fuzzing, unit tests)."""

from __future__ import annotations

from collections.abc import Callable

from paho.mqtt.client import topic_matches_sub
from pydantic import BaseModel


class FakeLink:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.subs: list[tuple[str, Callable[[str, bytes], None]]] = []
        self.connected = True

    def publish(self, topic: str, payload, *, retain: bool = False, qos: int = 1) -> None:
        data = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else bytes(payload)
        self.published.append((topic, data))
        self.deliver(topic, data)

    def subscribe(self, filter: str, callback: Callable[[str, bytes], None]) -> None:
        self.subs.append((filter, callback))

    def deliver(self, topic: str, payload: bytes) -> None:
        for f, cb in self.subs:
            if topic_matches_sub(f, topic):
                cb(topic, payload)

    def close(self) -> None:
        self.connected = False
