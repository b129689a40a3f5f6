"""Three nodes and a real Mosquitto: a RoundCommand published over MQTT runs on every node, the
allreduce travels through the broker, and all agree on params_sha256 (events and retained status)."""

from __future__ import annotations

import threading
import time

import pytest

from compiler import load_artifact
from federation import topics
from federation.messages import EventKind, NodeState, RoundCommand, parse_status
from tests.fixtures_node import SwarmWatch

pytestmark = pytest.mark.mosquitto


def test_round_over_mqtt(mosquitto, swarm_id, mqtt_link_factory, node_factory, digits_artifact, digits_data):
    x, y = digits_data
    art = load_artifact(digits_artifact)
    ids = [f"{swarm_id}-n{k}" for k in range(3)]
    nodes = []
    for k, i in enumerate(ids):
        n = node_factory(i, digits_artifact, artifact=art, broker=mosquitto.url, swarm=swarm_id)
        n.add_samples({"x": x[k:600:3]}, y[k:600:3])
        nodes.append(n)

    fleet = mqtt_link_factory(mosquitto, "fleet")
    watch = SwarmWatch(fleet, swarm_id)
    events, statuses, lock = watch.events, watch.statuses, watch.lock
    deadline = time.monotonic() + 10
    while not all(statuses.get(i) and statuses[i].state == NodeState.ONLINE and statuses[i].samples == 200
                  for i in ids):  # sample counts arrive with the next heartbeat (1 s here)
        assert time.monotonic() < deadline, statuses
        time.sleep(0.05)
    assert statuses[ids[0]].model == "digits-mlp" and statuses[ids[0]].arch

    cmd = RoundCommand(round_id="mqtt-r1", steps=20, lr=0.1, participants=ids, step_timeout_s=15)
    fleet.publish(topics.command(swarm_id), cmd)
    deadline = time.monotonic() + 90
    while True:
        with lock:
            done = {e.node_id: e for e in events if e.kind == EventKind.DONE and e.round_id == "mqtt-r1"}
            failed = [e for e in events if e.kind == EventKind.FAILED]
        assert not failed, failed
        if len(done) == 3:
            break
        assert time.monotonic() < deadline, events
        time.sleep(0.05)
    assert len({e.params_sha256 for e in done.values()}) == 1
    assert {e.model_version for e in done.values()} == {1}
    assert {n.params_sha256 for n in nodes} == {done[ids[0]].params_sha256}
    mine = [e for e in events if e.kind == EventKind.STEP and e.node_id == ids[0]]
    steps = sorted(mine, key=lambda e: e.step)
    assert steps and steps[-1].step == 19 and steps[-1].loss < steps[0].loss

    # the retained status follows the committed parameters
    deadline = time.monotonic() + 10
    while not all(statuses[i].model_version == 1 and statuses[i].params_sha256 == nodes[0].params_sha256
                  and statuses[i].state == NodeState.ONLINE for i in ids):
        assert time.monotonic() < deadline, statuses
        time.sleep(0.05)

    # a malformed command on the topic is rejected and counted, nodes keep working
    fleet.publish(topics.command(swarm_id), b'{"kind": "round.start", "round_id": 7}')
    deadline = time.monotonic() + 10
    while not all(n.metrics.commands_rejected == 1 for n in nodes):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    # graceful stop: the retained status says offline
    nodes[2].stop()
    deadline = time.monotonic() + 10
    while statuses[ids[2]].state != NodeState.OFFLINE:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_kill_9_node_process_reads_offline(mosquitto, swarm_id, mqtt_link_factory, digits_artifact, tmp_path):
    """`fractal node` with a broker: retained status online; SIGKILL -> the Last Will says offline."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.fixtures_node import write_node_toml

    node_id = f"{swarm_id}-proc"
    cfg = write_node_toml(tmp_path / "NODE.toml", {
        "node_id": node_id, "artifact": str(digits_artifact), "port": 0, "data_dir": "data",
        "broker": mosquitto.url, "swarm": swarm_id, "keepalive_s": 2})
    statuses, lock = [], threading.Lock()
    fleet = mqtt_link_factory(mosquitto, "watch")

    def on_status(topic, payload):
        with lock:
            statuses.append(parse_status(payload))

    fleet.subscribe(topics.status(swarm_id, node_id), on_status)
    proc = subprocess.Popen([sys.executable, "-c", "from api.cli import main; main()", "node", "--config",
                             str(cfg)], cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not any(s.state == NodeState.ONLINE for s in statuses):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    deadline = time.monotonic() + 10  # the socket closed: the broker fires the will at once
    while statuses[-1].state != NodeState.OFFLINE:
        assert time.monotonic() < deadline, statuses[-1]
        time.sleep(0.05)
    assert statuses[-1].node_id == node_id and statuses[-1].model == "digits-mlp"
