"""Fleet fixtures: a real Mosquitto per module, a fleet service (uvicorn thread) per test with its
own swarm id (so retained statuses of other tests never leak in), and simulated nodes that
speak the real MQTT protocol (NodeStatus with a Last Will, RoundEvents)."""

from __future__ import annotations

import contextlib
import itertools
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from api.fleet.settings import FleetSettings
from api.fleet_app import create_fleet_app
from api.serving import ServerThread
from federation import topics
from federation.messages import EventKind, NodeState, NodeStatus, RoundEvent
from federation.mqtt import MqttLink

TOKEN = "fleet-test-token"
_ids = itertools.count()


@pytest.fixture(scope="session")
def broker(mosquitto):
    """The session's shared Mosquitto (tests/fixtures_broker.py); each fleet uses its own swarm id."""
    return mosquitto


@dataclass
class Fleet:
    url: str
    swarm: str
    service: object
    client: httpx.Client
    broker_url: str
    links: list = field(default_factory=list)
    server: ServerThread | None = None

    def stop(self) -> None:
        """Stop this fleet service now (as a restart would); teardown stops the rest."""
        if self.server is not None:
            self.server.stop()

    def link(self, name: str, **kw) -> MqttLink:
        """A raw MQTT client on this fleet's swarm (closed at teardown)."""
        ln = MqttLink(self.broker_url, swarm=self.swarm, client_id=f"{name}-{next(_ids)}", **kw)
        self.links.append(ln)
        return ln

    def announce(self, node_id: str, state: NodeState = NodeState.ONLINE, **kw) -> MqttLink:
        """Publish a retained status for ``node_id`` from its own connection (with a Last Will)."""
        will = NodeStatus(node_id=node_id, state=NodeState.OFFLINE)
        ln = self.link(node_id, will=(topics.status(self.swarm, node_id), will))
        fields = {"arch": "x86_64", "board": "x86_64", "model": "digits-mlp", "model_version": 1,
                  "params_sha256": "ab" * 32, "samples": 100, **kw}
        status = NodeStatus(node_id=node_id, state=state, **fields)
        ln.publish(topics.status(self.swarm, node_id), status, retain=True).wait_for_publish(5)
        return ln

    def event(self, link: MqttLink, round_id: str, node_id: str, kind: EventKind, **kw) -> None:
        ev = RoundEvent(kind=kind, round_id=round_id, node_id=node_id, **kw)
        link.publish(topics.round_events(self.swarm, round_id, node_id), ev).wait_for_publish(5)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.client.get(path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.client.post(path, **kw)

    def wait_for(self, pred: Callable[[], object], timeout: float = 30.0, what: str = "condition"):
        """``pred()``'s first truthy value, polled every 50 ms. The default ceiling is generous: it
        costs nothing when the condition comes true (the wait returns at once), and on a loaded
        2-core runner a retained delivery, a 50 ms tick and the HTTP polls all compete for the CPU.
        A test that means a time bound passes ``timeout`` explicitly."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def node(self, node_id: str) -> dict | None:
        nodes = self.get("/api/nodes").json()["nodes"]
        return next((n for n in nodes if n["node_id"] == node_id), None)


@pytest.fixture
def make_fleet(broker) -> Iterator[Callable[..., Fleet]]:
    """``make_fleet(**settings)`` starts a fleet service on a fresh swarm id; stops all at teardown."""
    started: list[tuple[ServerThread, Fleet]] = []

    def make(swarm: str | None = None, **overrides) -> Fleet:
        swarm = swarm or f"t{next(_ids)}-{int(time.time() * 1000) % 10**8}"
        settings = FleetSettings(broker=broker.url, swarm=swarm, token=TOKEN, tick_s=0.05, **overrides)
        app = create_fleet_app(settings)
        srv = ServerThread(app, lifespan="on", timeout_graceful_shutdown=1).start()
        client = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        fleet = Fleet(srv.url, swarm, app.state.fleet, client, broker.url, server=srv)
        started.append((srv, fleet))
        return fleet

    yield make
    for srv, fleet in started:
        fleet.client.close()
        for ln in fleet.links:
            with contextlib.suppress(Exception):
                ln.close()
        srv.stop()


@pytest.fixture
def fleet(make_fleet) -> Fleet:
    return make_fleet()


def collect(link: MqttLink, filter: str) -> queue.Queue:
    """Subscribe and return a queue of ``(topic, payload)``."""
    q: queue.Queue = queue.Queue()
    link.subscribe(filter, lambda t, p: q.put((t, p)))
    return q
