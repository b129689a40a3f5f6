"""A member of a hierarchical swarm as its own OS process, for tests that kill a site leader.

Run as ``python -m tests.federation.hier_member --url SITE_BROKER_URL --swarm S --id ID``. It
connects to its site's broker, prints ``READY``, then reads one round per stdin line::

    TAG SITES_JSON [DIE]

and runs :meth:`HierarchicalAllreduce.allreduce` (SUM) of ``full(--size, value)`` (``value`` from
``--value``: integer-valued, so the exact sum is known), then the vote. It prints
``RESULT TAG <sha256 of the result bytes> <sites that did not prepare, comma-separated>`` or
``ABORTED TAG <reason>``. With ``DIE`` the member SIGKILLs itself right after publishing its first
backbone frame of that round: a leader dying mid-round, its site reduced, the leaders' ring begun.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import numpy as np

from federation.backbone import backbone_transport
from federation.errors import RoundAborted
from federation.hierarchy import HierarchicalAllreduce, Topology
from federation.mqtt import MqttLink
from federation.ring import RingAllreduce


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--swarm", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--size", type=int, default=20000)
    ap.add_argument("--value", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=3.0)
    a = ap.parse_args(argv)

    link = MqttLink(a.url, swarm=a.swarm, client_id=f"{a.swarm}-{a.id}", keepalive=2)
    backbone = backbone_transport(link, a.id, max_payload=8 * 1024)
    die = [False]
    send = backbone.send

    def send_or_die(dst: str, payload: bytes) -> None:
        send(dst, payload)
        if die[0]:
            os.kill(os.getpid(), signal.SIGKILL)

    backbone.send = send_or_die  # type: ignore[method-assign]
    engine = HierarchicalAllreduce(RingAllreduce(link.transport(a.id, max_payload=8 * 1024), swarm=a.swarm),
                                   RingAllreduce(backbone, swarm=a.swarm))
    vec = np.full(a.size, a.value, np.float32)
    print("READY", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        tag, sites = words[0], json.loads(words[1])
        die[0] = len(words) > 2 and words[2] == "DIE"
        topo = Topology.from_groups(sites)
        try:
            out = engine.allreduce(vec, topology=topo, tag=tag, op="sum", timeout=a.timeout)
            short = engine.vote(True, topology=topo, tag=f"{tag}.vote", timeout=a.timeout)
            print(f"RESULT {tag} {hashlib.sha256(out.tobytes()).hexdigest()} {','.join(short) or '-'}",
                  flush=True)
        except RoundAborted as exc:
            print(f"ABORTED {tag} {exc}".replace("\n", " "), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
