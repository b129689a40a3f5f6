"""A heterogeneous swarm: two x86-64 nodes in this process and one aarch64 `fractal node` under
qemu-user (the sysroot of `make sysroot`), one Mosquitto. A round published over MQTT runs on all
three with each board's own TVM build, and they commit bit-identical parameters."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from federation import topics
from federation.messages import EventKind, NodeState, RoundCommand
from tests.edgenode.test_cli_node import free_port
from tests.fixtures_node import DIGITS_BATCH, DIGITS_LR, SwarmWatch, write_node_toml

pytestmark = [pytest.mark.slow, pytest.mark.emulate, pytest.mark.mosquitto]


@pytest.fixture(scope="module")
def digits_arm_artifact(tmp_path_factory) -> Path:
    from compiler import TrainSettings, compile_model, zoo

    d = tmp_path_factory.mktemp("digits-arm")
    zoo.save("digits-mlp", d / "digits-mlp.onnx", batch=DIGITS_BATCH)
    return compile_model(d / "digits-mlp.onnx", target="aarch64", out_dir=d / "digits-mlp-aarch64",
                         train=TrainSettings(loss="ce", optimizer="sgd", lr=DIGITS_LR, batch=DIGITS_BATCH),
                         progress=False)


def test_x86_and_aarch64_nodes_agree(mosquitto, swarm_id, mqtt_link_factory, node_factory, digits_artifact,
                                     digits_arm_artifact, digits_data, tmp_path):
    from compiler.emulate import sysroot_dir
    from deploy.armnode import arm_python

    x, y = digits_data
    arm_id = f"{swarm_id}-arm"
    port = free_port()
    cfg = write_node_toml(tmp_path / "arm" / "NODE.toml", {
        "node_id": arm_id, "artifact": str(digits_arm_artifact), "port": port, "data_dir": "data",
        "broker": mosquitto.url, "swarm": swarm_id, "heartbeat_s": 1.0})
    prefix, env = arm_python(sysroot_dir("aarch64"))
    log = open(tmp_path / "arm.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen([*prefix, "node", "--config", str(cfg)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    try:
        fleet = mqtt_link_factory(mosquitto, "fleet")
        watch = SwarmWatch(fleet, swarm_id)
        events, statuses, lock = watch.events, watch.statuses, watch.lock
        x86 = [node_factory(f"{swarm_id}-x{k}", digits_artifact, broker=mosquitto.url, swarm=swarm_id)
               for k in range(2)]
        for k, n in enumerate(x86):
            n.add_samples({"x": x[k:600:3]}, y[k:600:3])
        deadline = time.monotonic() + 240  # importing TVM under qemu takes a while
        while not (statuses.get(arm_id) and statuses[arm_id].state == NodeState.ONLINE):
            assert proc.poll() is None, (tmp_path / "arm.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the aarch64 node did not come online"
            time.sleep(0.2)
        assert statuses[arm_id].arch == "aarch64"
        while True:  # the agent is online a moment before uvicorn listens
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the aarch64 node's API did not come up"
                time.sleep(0.2)
        body = json.dumps({"inputs": {"x": x[2:600:3].tolist()}, "labels": y[2:600:3].tolist()}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/samples", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status in (200, 201)

        ids = sorted([arm_id, *(n.node_id for n in x86)])
        fleet.publish(topics.command(swarm_id),
                      RoundCommand(round_id="mixed", steps=10, lr=0.1, participants=ids, step_timeout_s=60))
        deadline = time.monotonic() + 180
        while True:
            with lock:
                done = {e.node_id: e for e in events if e.kind == EventKind.DONE}
                failed = [e for e in events if e.kind == EventKind.FAILED]
            assert not failed, failed
            if len(done) == 3:
                break
            assert time.monotonic() < deadline, events[-5:]
            time.sleep(0.1)
        assert len({e.params_sha256 for e in done.values()}) == 1
        assert {n.params_sha256 for n in x86} == {done[arm_id].params_sha256}
        # the aarch64 node serves the new parameters: same predictions as an x86 node
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/digits-mlp/infer", data=json.dumps(
            {"inputs": [{"name": "x", "shape": [4, 64], "datatype": "FP32", "data": x[:4].ravel().tolist()}]}
        ).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            arm_out = np.asarray(json.loads(r.read())["outputs"][0]["data"], np.float32).reshape(4, 10)
        np.testing.assert_allclose(arm_out, x86[0].infer({"x": x[:4]})["logits"], rtol=1e-4, atol=1e-5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
