"""A node that reconnects says it is online only once its subscriptions are back.

The node connects with a clean session: after a dropped connection the broker holds no
subscription of its new session until the re-SUBSCRIBE (sent when the CONNACK arrives) is
processed, and drops every command published before that. paho puts a PUBLISH on the wire as
soon as the new socket exists, before the CONNACK, so a heartbeat status sent in that window
told the fleet "online" one round trip before the node could hear a command: a fleet starting a
round right then lost the command on that node for good (the round failed after the fleet's
start timeout). Here the fault proxy stretches that window to ~0.6 s and a fleet stand-in
publishes a round command the moment the node is back online.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from edgenode.config import NodeConfig
from edgenode.node import EdgeNode
from federation import topics
from federation.messages import NodeState, RoundCommand, RoundEvent, parse_status
from harness.faultproxy import ProxyThread
from tests.edgenode.fakes import NumpyArtifact

pytestmark = pytest.mark.mosquitto


def test_a_command_sent_as_soon_as_a_reconnected_node_is_online_reaches_it(
        mosquitto, swarm_id, mqtt_link_factory, tmp_path: Path) -> None:
    node_id = f"{swarm_id}-n0"
    (tmp_path / "art").mkdir()
    with ProxyThread("127.0.0.1", mosquitto.port) as proxy:
        cfg = NodeConfig.from_dict({
            "node_id": node_id, "artifact": str(tmp_path / "art"), "data_dir": str(tmp_path / "data"),
            "broker": f"mqtt://127.0.0.1:{proxy.port}", "swarm": swarm_id,
            "heartbeat_s": 0.1,  # several heartbeats fall into the reconnect's CONNECT..CONNACK window
            "keepalive_s": 10, "training": {"isolation": "thread", "step_timeout_s": 1.0}})
        node = EdgeNode(cfg, artifact=NumpyArtifact())
        events: list[RoundEvent] = []
        heard = threading.Event()
        cmd = RoundCommand(round_id="after-reconnect", steps=1, participants=[node_id, "ghost"],
                           step_timeout_s=1)

        def on_event(ev: RoundEvent) -> None:
            if ev.round_id == cmd.round_id:
                events.append(ev)
                heard.set()

        node.add_event_listener(on_event)
        node.start()
        try:
            fleet = mqtt_link_factory(mosquitto, "fleet")
            online, cut_seen, sent = threading.Event(), threading.Event(), threading.Event()

            def on_status(_topic: str, payload: bytes) -> None:
                s = parse_status(payload)
                if s.state is NodeState.OFFLINE:
                    if online.is_set():
                        cut_seen.set()  # the Last Will of the cut connection
                elif not online.is_set():
                    online.set()
                elif cut_seen.is_set() and not sent.is_set():
                    # as the fleet does: the node is online again, start a round with it at once
                    fleet.publish(topics.command(swarm_id), cmd)
                    sent.set()

            fleet.subscribe(topics.status(swarm_id, node_id), on_status)
            assert online.wait(30), "the node never said it is online"
            proxy.set_delay(300)  # each way: the CONNACK comes ~0.6 s after the new socket opens
            assert proxy.cut() == 1
            assert cut_seen.wait(30), "no Last Will after the cut"
            assert sent.wait(30), "the node never came back online"
            # The command went out after the node said it is online again: the node must hear it
            # (it starts the round, which fails for want of the ghost: either way an event).
            assert heard.wait(30), "the node never heard the command sent when it was back online"
            assert node.wait_idle(30)
        finally:
            node.stop(timeout=5)
