"""A swarm member as its own OS process, for tests that SIGKILL it.

Run as ``python -m tests.federation.mqtt_member --url URL --swarm S --id ID [--mode ring ...]``.

Modes:
* ``status``: connect with the offline Last Will, publish a retained online status, print
  ``READY``, then heartbeat until killed.
* ``ring``: additionally run one allreduce of a seeded random vector (``--size``, ``--seed``)
  with ``--group`` under ``--tag``; prints ``ROUND`` right before it starts, ``SENT`` after its
  first frame, then ``DONE`` or ``ABORTED``. The test kills it while the round runs.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from federation.membership import StatusPublisher, status_will
from federation.messages import NodeState, NodeStatus
from federation.mqtt import MqttLink


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--swarm", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--mode", choices=["status", "ring"], default="status")
    ap.add_argument("--group", default="")
    ap.add_argument("--tag", default="r1")
    ap.add_argument("--size", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--max-payload", type=int, default=64 * 1024)
    a = ap.parse_args(argv)

    status = NodeStatus(node_id=a.id, state=NodeState.ONLINE, heartbeat_s=1.0, keepalive_s=2.0)
    link = MqttLink(a.url, swarm=a.swarm, client_id=f"{a.swarm}-{a.id}", will=status_will(a.swarm, status),
                    keepalive=2)
    pub = StatusPublisher(link, status)
    transport = link.transport(a.id, max_payload=a.max_payload) if a.mode == "ring" else None
    print("READY", flush=True)
    if a.mode == "status":
        while True:
            time.sleep(1)
    from federation.errors import RoundAborted
    from federation.ring import RingAllreduce

    send = transport.send
    sent = [0]

    def send_and_tell(dst: str, payload: bytes) -> None:
        send(dst, payload)
        sent[0] += 1
        if sent[0] == 1:  # the test kills us now: provably mid-round, with most frames unsent
            print("SENT", flush=True)

    transport.send = send_and_tell
    ring = RingAllreduce(transport, swarm=a.swarm)
    vec = np.random.default_rng(a.seed).standard_normal(a.size).astype(np.float32)
    pub.update(state=NodeState.TRAINING, round_id=a.tag)
    print("ROUND", flush=True)
    try:
        ring.allreduce(vec, group=a.group.split(","), tag=a.tag, op="sum", timeout=a.timeout)
        print("DONE", flush=True)
    except RoundAborted as exc:
        print(f"ABORTED {exc}", flush=True)
    while True:  # stay alive until killed, like a node between rounds
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
