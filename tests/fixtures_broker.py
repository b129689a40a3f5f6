"""Broker fixtures shared by every area's tests (auto-loaded by ``tests/conftest.py``).

* ``mosquitto``: one real Mosquitto for the whole session on a free loopback port (never a
  system broker). Do not stop, kill or restart it; use a unique swarm id per test so retained
  statuses of one test never leak into another (``swarm_id`` fixture).
* ``fresh_mosquitto``: a broker of your own for one test, which you may ``.restart()`` /
  ``.kill()``; ``max_queued_messages`` is small (50) so that a test proving flow control
  would fail against it if the code depended on the broker's queue depth.
* ``mqtt_link_factory``: ``make(broker, name, **kw) -> MqttLink`` on the test's swarm, with a
  client id made unique on the shared broker (``{swarm_id}-{name}``), closed after the test.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import pytest

from federation.broker import MosquittoBroker, start_mosquitto
from federation.mqtt import MqttLink

_counter = itertools.count()


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """A Mosquitto broker shared by the session (anonymous, default queue limits)."""
    broker = start_mosquitto(workdir=tmp_path_factory.mktemp("mosquitto"))
    try:
        yield broker
    finally:
        broker.close()


@pytest.fixture
def fresh_mosquitto(tmp_path) -> Iterator[MosquittoBroker]:
    """A Mosquitto broker owned by one test (may be restarted or killed); max_queued_messages=50."""
    broker = start_mosquitto(workdir=tmp_path / "mosquitto", max_queued_messages=50)
    try:
        yield broker
    finally:
        broker.close()


@pytest.fixture
def swarm_id(request: pytest.FixtureRequest) -> str:
    """A swarm id unique to this test (and process): isolates topics on the shared broker."""
    return f"t{os.getpid()}-{next(_counter)}"


@pytest.fixture
def mqtt_link_factory(swarm_id: str) -> Iterator[Callable[..., MqttLink]]:
    """``make(broker_or_url, name, **kw)``: an MqttLink on this test's swarm, closed afterwards."""
    links: list[MqttLink] = []

    def make(broker, name: str, **kw) -> MqttLink:
        url = broker if isinstance(broker, str) else broker.url
        kw.setdefault("swarm", swarm_id)
        link = MqttLink(url, client_id=f"{swarm_id}-{name}", **kw)
        links.append(link)
        return link

    yield make
    for link in links:
        link.close()
