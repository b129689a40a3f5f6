"""Fan-out of fleet events to Server-Sent-Event subscribers.

MQTT callbacks run on paho's network thread; each SSE subscriber lives on the asyncio loop of
the HTTP server. :meth:`EventBus.publish` is thread-safe and never blocks: a subscriber that
falls behind loses its oldest events (it gets a fresh snapshot on reconnect) instead of
stalling MQTT.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import threading
from dataclasses import dataclass

__all__ = ["EventBus", "EventType", "Subscription", "json_safe"]


class EventType(enum.StrEnum):
    SNAPSHOT = "snapshot"  # first event of every stream: nodes + round history
    NODE = "node"  # one node's view changed
    ROUND = "round"  # one round changed (a step loss, done, failed)
    ROLLBACK = "rollback"  # a rollback started, finished or failed (an operator action was recorded)
    ROLLOUT = "rollout"  # an image roll-out or image rollback progressed
    IMAGES = "images"  # the image catalogue changed (an upload)
    AUTO_ROUNDS = "auto_rounds"  # the automatic-round policy or where its triggers stand changed
    ENROLLMENT = "enrollment"  # a device asked to enrol, or the operator decided (api/fleet/enrollment.py)
    ASYNC = "async"  # the asynchronous rounds' state (GET /api/async's body): an update or a version
    LEADER = "leader"  # this fleet process took the lead (api/fleet/leadership.py): {"role", "leader"}


@dataclass
class Subscription:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    async def get(self, timeout: float) -> tuple[str, str] | None:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None


class EventBus:
    def __init__(self, max_queue: int = 1000) -> None:
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        self._max_queue = max_queue

    def subscribe(self) -> Subscription:
        """Call from the event loop that will consume the subscription."""
        sub = Subscription(asyncio.get_running_loop(), asyncio.Queue(self._max_queue))
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subs)

    def publish(self, kind: EventType, data: dict) -> None:
        item = (kind.value, json.dumps(json_safe(data), separators=(",", ":"), allow_nan=False))
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(_put_dropping_oldest, sub.queue, item)
            except RuntimeError:  # loop closed: the subscriber is gone
                self.unsubscribe(sub)


def _put_dropping_oldest(queue: asyncio.Queue, item: tuple[str, str]) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)


def json_safe(value: object) -> object:
    """``value`` with every NaN/Inf float replaced by ``None``: the stream is standard JSON, which
    browsers' ``JSON.parse`` can read (a bare ``NaN`` made the dashboard drop the whole event)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
