"""A minimal MQTT node process for Last-Will tests: retained status + Last Will + heartbeats.

    python -m tests.fleet.node_proc BROKER_URL SWARM NODE_ID KEEPALIVE_S

Prints ``READY`` once its first status is acknowledged. Killing it (SIGKILL) drops the TCP
connection without DISCONNECT, so the broker publishes the Last Will; stopping it (SIGSTOP)
keeps the socket open but silent, so only the keepalive timeout can reveal it.
"""

from __future__ import annotations

import sys
import time

from federation import topics
from federation.messages import NodeState, NodeStatus
from federation.mqtt import MqttLink


def main() -> None:
    url, swarm, node_id, keepalive = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    topic = topics.status(swarm, node_id)
    will = NodeStatus(node_id=node_id, state=NodeState.OFFLINE, keepalive_s=keepalive)
    link = MqttLink(url, swarm=swarm, client_id=node_id, will=(topic, will), keepalive=keepalive)
    heartbeat = keepalive / 2
    first = True
    while True:
        st = NodeStatus(node_id=node_id, state=NodeState.ONLINE, arch="x86_64", model="digits-mlp",
                        heartbeat_s=heartbeat, keepalive_s=keepalive)
        link.publish(topic, st, retain=True).wait_for_publish(5)
        if first:
            print("READY", flush=True)
            first = False
        time.sleep(heartbeat)


if __name__ == "__main__":
    main()
