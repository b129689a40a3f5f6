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

from federation import topics
from federation.broker import MosquittoBroker, start_mosquitto
from federation.mqtt import MqttLink

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "mosquitto"
SITE_NAMES = ("east", "west")


def deploy_conf(name: str, **subst: str) -> str:
    """A deploy/mosquitto file with its @KEY@ placeholders filled, comments dropped."""
    text = (DEPLOY / name).read_text()
    for k, v in subst.items():
        text = text.replace(f"@{k}@", v)
    return "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))


@pytest.fixture
def site_brokers(tmp_path: Path) -> Iterator[tuple[MosquittoBroker, dict[str, MosquittoBroker]]]:
    started: list[MosquittoBroker] = []
    try:
        backbone = start_mosquitto(workdir=tmp_path / "backbone", extra_config=deploy_conf("backbone.conf"))
        started.append(backbone)
        sites = {}
        for s in SITE_NAMES:
            sites[s] = start_mosquitto(workdir=tmp_path / s, extra_config=deploy_conf(
                "site-bridge.conf", BACKBONE=f"127.0.0.1:{backbone.port}", SITE=s))
            started.append(sites[s])
        yield backbone, sites
    finally:
        for b in started:
            b.close()


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
