"""Membership over a real Mosquitto: retained statuses, Last Will on SIGKILL, heartbeats, rogues."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from federation import topics
from federation.membership import Membership, StatusPublisher, status_will
from federation.messages import NodeState, NodeStatus

pytestmark = pytest.mark.mosquitto

ROOT = Path(__file__).resolve().parents[2]


def _node(make, broker, node_id, swarm, heartbeat_s=1.0):
    st = NodeStatus(node_id=node_id, state=NodeState.ONLINE, heartbeat_s=heartbeat_s)
    link = make(broker, node_id, will=status_will(swarm, st), keepalive=2)
    return StatusPublisher(link, st)


def test_live_changes_and_graceful_stop(mosquitto, mqtt_link_factory, swarm_id):
    m = Membership(mqtt_link_factory(mosquitto, "observer"))
    changes: list[tuple[str, str | None, str | None]] = []
    m.on_change(lambda n, old, new: changes.append((n, old and old.state.value, new and new.state.value)))
    pub = _node(mqtt_link_factory, mosquitto, "n1", swarm_id)
    assert m.wait_for(lambda live: "n1" in live, 30)
    pub.update(state=NodeState.TRAINING, round_id="r1")
    assert m.wait_for(lambda live: live.get("n1") and live["n1"].state == NodeState.TRAINING, 30)
    pub.stop()  # graceful: publishes offline before disconnecting
    assert m.wait_for(lambda live: "n1" not in live, 30)
    assert m.all()["n1"].state == NodeState.OFFLINE
    # on_change callbacks run after the state is visible to wait_for: give them time, not a race
    deadline = time.monotonic() + 30
    while len(changes) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert changes[:3] == [("n1", None, "online"), ("n1", "online", "training"),
                           ("n1", "training", "offline")]
    # a late observer learns the same from the retained status
    late = Membership(mqtt_link_factory(mosquitto, "late"))
    assert late.wait_for(lambda live: True, 0.5) and "n1" not in late.live()
    deadline = time.monotonic() + 30
    while "n1" not in late.all() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert late.all()["n1"].state == NodeState.OFFLINE


def test_last_will_marks_a_sigkilled_member_offline(mosquitto, mqtt_link_factory, swarm_id):
    m = Membership(mqtt_link_factory(mosquitto, "observer"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "tests.federation.mqtt_member", "--url", mosquitto.url,
                          "--swarm", swarm_id, "--id", "victim"], stdout=subprocess.PIPE, text=True,
                         cwd=ROOT, env=env)
    try:
        assert m.wait_for(lambda live: "victim" in live, 20)
        os.kill(p.pid, signal.SIGKILL)
        t = time.monotonic()
        assert m.wait_for(lambda live: "victim" not in live, 5)
        assert time.monotonic() - t < 5 and m.all()["victim"].state == NodeState.OFFLINE
    finally:
        p.kill()
        p.wait(10)


def test_stale_heartbeat_is_not_live(mosquitto, mqtt_link_factory, swarm_id):
    m = Membership(mqtt_link_factory(mosquitto, "observer"))
    pub = _node(mqtt_link_factory, mosquitto, "quiet", swarm_id, heartbeat_s=0.5)
    assert m.wait_for(lambda live: "quiet" in live, 30)
    time.sleep(2.0)  # longer than the 3 x 0.5 s staleness limit: only heartbeats keep it live
    assert "quiet" in m.live(), "heartbeats keep a node live"
    pub.stop(offline=False)  # hung process: connection open, no more heartbeats, no will yet
    last = pub.status.ts  # when its last heartbeat was sent (wall clock)
    assert m.wait_for(lambda live: "quiet" not in live, 30)
    # Not before the 3 x heartbeat limit, counted from the last heartbeat (the observer received it
    # later, if anything). Counted from stop() it raced: a heartbeat thread late by > 0.2 s on a
    # loaded machine left less than 0.8 s between stop() and the limit.
    assert time.time() - last > 1.4
    assert m.all()["quiet"].state == NodeState.ONLINE


def test_status_republished_after_broker_restart(fresh_mosquitto, mqtt_link_factory, swarm_id):
    m = Membership(mqtt_link_factory(fresh_mosquitto, "observer"))
    pub = _node(mqtt_link_factory, fresh_mosquitto, "n1", swarm_id, heartbeat_s=30)
    assert m.wait_for(lambda live: "n1" in live, 30)
    fresh_mosquitto.restart(hard=True)  # forgets every retained status (persistence off)
    late = Membership(mqtt_link_factory(fresh_mosquitto, "late"))
    # the publisher re-sends on reconnect, long before its next 30 s heartbeat
    assert late.wait_for(lambda live: "n1" in live, 30)
    assert pub.published >= 2
    pub.stop()


def test_rogue_statuses_are_rejected_and_counted(mosquitto, mqtt_link_factory, swarm_id):
    m = Membership(mqtt_link_factory(mosquitto, "observer"))
    rogue = mqtt_link_factory(mosquitto, "rogue")
    bad = [b"\xff\xfe", b"[]", b"{}", b'{"node_id": "r1", "state": "online"}',  # no version
           b'{"v": 99, "node_id": "r2", "state": "online"}',
           b'{"v": 1, "kind": "status", "node_id": "r3", "state": "dancing"}',
           NodeStatus(node_id="impostor", state=NodeState.ONLINE).model_dump_json().encode()]
    for i, payload in enumerate(bad):
        rogue.publish(topics.status(swarm_id, f"r{i}"), payload)
    good = threading.Event()
    m.on_change(lambda n, old, new: n == "ok" and good.set())
    rogue.publish(topics.status(swarm_id, "ok"), NodeStatus(node_id="ok", state=NodeState.ONLINE))
    assert good.wait(30), "a valid status after the rogue ones was not processed"
    assert m.rejected == len(bad) and set(m.live()) == {"ok"}
    assert m.last_rejection and "r6" in m.last_rejection
    # an empty retained payload removes the node
    rogue.publish(topics.status(swarm_id, "ok"), b"", retain=True)
    assert m.wait_for(lambda live: not live, 30) and "ok" not in m.all()


def test_a_halted_node_is_known_but_never_live(mosquitto, mqtt_link_factory, swarm_id):
    """A board with no bootable slot publishes `halted` once (firmware/halt.py): members see it
    with its reason but never count it live."""
    m = Membership(mqtt_link_factory(mosquitto, "observer"))
    seen = threading.Event()
    m.on_change(lambda n, old, new: n == "h" and new is not None and seen.set())
    board = mqtt_link_factory(mosquitto, "h-boot")
    board.publish(topics.status(swarm_id, "h"), NodeStatus(node_id="h", state=NodeState.HALTED,
                                                           halt="slot a: below the floor 5"), retain=True)
    assert seen.wait(30)
    assert "h" not in m.live() and m.all()["h"].halt == "slot a: below the floor 5"


def test_a_heartbeat_never_republishes_an_older_status_after_a_newer_one():
    """The heartbeat thread copies the status, then queues its PUBLISH. An update() between the two
    went out first and the heartbeat's older copy after it, so the broker retained the old state
    (ONLINE after TRAINING; also ONLINE after stop()'s OFFLINE). Here the heartbeat is held inside
    its publish while update() runs: update's TRAINING must still be the later message."""

    class Link:
        swarm = "s"

        def __init__(self) -> None:
            self.sent: list[NodeState] = []
            self.heartbeat_inside, self.release = threading.Event(), threading.Event()

        def on_connect(self, hook) -> None:
            pass

        def publish(self, topic, payload, retain=False):
            if threading.current_thread().name.startswith("status:") and not self.heartbeat_inside.is_set():
                self.heartbeat_inside.set()
                self.release.wait(10)  # the heartbeat's copy (ONLINE) is not queued yet
            self.sent.append(payload.state)

    link = Link()
    pub = StatusPublisher(link, NodeStatus(node_id="n1", state=NodeState.ONLINE, heartbeat_s=0.1))
    try:
        assert link.heartbeat_inside.wait(30)
        t = threading.Thread(target=pub.update, kwargs={"state": NodeState.TRAINING})
        t.start()
        t.join(0.3)  # before the fix update() published at once, ahead of the heartbeat's copy
        link.release.set()
        t.join(10)
        assert not t.is_alive()
    finally:
        link.release.set()
        pub.stop(offline=False)
    first = link.sent.index(NodeState.TRAINING)
    assert NodeState.ONLINE not in link.sent[first:], link.sent
