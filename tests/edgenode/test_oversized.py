"""Issue 26, finding 10: a node drops oversized MQTT payloads before parsing them.

A real signed node on the session's Mosquitto (which, unlike the demo's and production's, has no
size limit): 3 MiB payloads on its command topic and its ring inbox are dropped unread and counted
as ``oversized`` (not ``unsigned``: nothing looked at them), and the node keeps working.
"""

from __future__ import annotations

import time

import pytest

from deploy.keys import provision
from federation import topics
from federation.broker import MESSAGE_SIZE_LIMIT
from federation.messages import NodeState

pytestmark = pytest.mark.mosquitto


def _rejected(node, reason: str) -> float:
    return node.registry.get_sample_value("fractal_node_messages_rejected_total", {"reason": reason}) or 0.0


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_node_drops_oversized_payloads_unread(mosquitto, swarm_id, mqtt_link_factory, node_factory,
                                                digits_artifact, tmp_path):
    node_id = f"{swarm_id}-n0"
    keys = tmp_path / "keys"
    provision(keys, swarm_id, [node_id])
    node = node_factory(node_id, digits_artifact, broker=mosquitto.url, swarm=swarm_id,
                        key_file=str(keys / f"keys/{node_id}.key"), keyring_file=str(keys / "keyring.json"))
    attacker = mqtt_link_factory(mosquitto, "attacker")
    big = b"{" + b" " * (MESSAGE_SIZE_LIMIT + 1024) + b"}"  # just over the limit; the attack used 200 MiB
    attacker.publish(topics.command(swarm_id), big).wait_for_publish(10)
    attacker.publish(topics.allreduce(swarm_id, node_id), big).wait_for_publish(10)
    _wait(lambda: _rejected(node, "oversized") >= 2, 15, "two oversized payloads counted")
    # the next (small, unsigned) command is still read, and counted for what it is
    small = b'{"v":1,"kind":"round.abort","round_id":"x"}'
    attacker.publish(topics.command(swarm_id), small).wait_for_publish(5)
    _wait(lambda: _rejected(node, "unsigned") >= 1, 10, "the small forgery counted")
    assert _rejected(node, "oversized") == 2 and _rejected(node, "unsigned") == 1
    assert _rejected(node, "malformed") == 0
    assert node.status().state == NodeState.ONLINE
