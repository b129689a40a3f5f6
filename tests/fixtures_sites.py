"""Two site Mosquittos bridged to a backbone Mosquitto, from the files in deploy/mosquitto/
(site-bridge.conf, backbone.conf): real broker processes, for hierarchical rounds.

* ``site_brokers``: ``(backbone, {"east": broker, "west": broker})``, closed afterwards.
* :func:`wait_bridged`: blocks until both bridges carry the leaders' subtree (they connect
  asynchronously) and checks a site ring topic does not cross.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.sites import start_sites
from federation import topics
from federation.broker import MosquittoBroker
from federation.mqtt import MqttLink

SITE_NAMES = ["east", "west"]


@pytest.fixture
def site_brokers(tmp_path: Path) -> Iterator[tuple[MosquittoBroker, dict[str, MosquittoBroker]]]:
    sites = start_sites(SITE_NAMES, workdir=tmp_path)
    try:
        yield sites.backbone, sites.sites
    finally:
        sites.close()


def wait_bridged(sites: dict[str, MosquittoBroker], swarm: str) -> None:
    """Until a backbone-subtree message published on each site reaches the other; also proves a
    site ring topic (``ar/``) published meanwhile does not cross."""
    got: dict[str, threading.Event] = {s: threading.Event() for s in sites}
    leaked = threading.Event()
    links = {s: MqttLink(b.url, swarm=swarm, client_id=f"probe-{s}") for s, b in sites.items()}
    try:
        (a, la), (b, lb) = links.items()
        la.subscribe(topics.backbone_allreduce(swarm, "probe-a"), lambda t, p: got[a].set())
        lb.subscribe(topics.backbone_allreduce(swarm, "probe-b"), lambda t, p: got[b].set())
        lb.subscribe(topics.allreduce(swarm, "probe-b"), lambda t, p: leaked.set())
        for _ in range(100):
            la.publish(topics.backbone_allreduce(swarm, "probe-b"), b"x")
            lb.publish(topics.backbone_allreduce(swarm, "probe-a"), b"x")
            la.publish(topics.allreduce(swarm, "probe-b"), b"x")
            if got[a].wait(0.1) and got[b].wait(0.1):
                break
        assert got[a].is_set() and got[b].is_set(), "the bridges never carried the backbone subtree"
        assert not leaked.is_set(), "a site ring topic crossed the bridge"
    finally:
        for link in links.values():
            link.close()
