"""A device joins a real, signed fleet (issue 25 item 5), all real processes on this host: Mosquitto
with the dynamic-security plugin and no anonymous access, a signed fleet service that manages the
broker's clients, an existing member node, and a device node process (``fractal node``) whose
config holds no broker, no keys, only ``data/enrollment.toml``. The device makes its keys, is
pending (and cannot connect to the broker), is accepted through the fleet API, gets its broker
credentials and the fleet-signed keyring, shows up signed in GET /api/nodes and trains a round with
the existing node (same parameters on both). Revoked, it is out: its credentials no longer connect
and the member learnt the revocation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from federation import enrolment as wire
from federation.auth import Keyring, load_private_key
from federation.broker import free_port
from federation.errors import TransportError
from federation.mqtt import MqttLink
from tests.fixtures_enrolment import signed_fleet
from tests.fixtures_enrolment import wait_for as _wait
from tests.fixtures_node import write_node_toml

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

FRACTAL = str(Path(sys.executable).with_name("fractal"))


def test_device_enrols_joins_a_signed_round_and_is_revoked(dynsec_broker, tmp_path, node_factory,
                                                           digits_artifact, digits_data):
    with signed_fleet(tmp_path, dynsec_broker, "enrol-e2e", ["node-1"]) as fleet:
        _device_enrols_joins_and_is_revoked(fleet, tmp_path, node_factory, digits_artifact, digits_data)


def _device_enrols_joins_and_is_revoked(fleet, tmp_path, node_factory, digits_artifact, digits_data):
    host, swarm, c = fleet.host, fleet.swarm, fleet.client
    x, y = digits_data
    member_keys = fleet.member("node-1")
    node_ring = Path(member_keys["keyring_file"])  # the member's own copy of the keyring
    member = node_factory("node-1", digits_artifact, **member_keys)
    member.add_samples({"x": x[0:400:2]}, y[0:400:2])

    # the device: a NODE.toml with no broker and no keys; the boot partition's enrolment settings
    token = c.post("/api/enrollment-tokens", json={"ttl_s": 600, "uses": 1}).json()["token"]
    dev = tmp_path / "board-1"
    (dev / "data").mkdir(parents=True)
    (dev / "data/enrollment.toml").write_text(f'fleet = "{fleet.url}"\nenroll_token = "{token}"\n')
    port = free_port()
    write_node_toml(dev / "NODE.toml", {"node_id": "board-1", "artifact": str(digits_artifact), "port": port,
                                        "data_dir": str(dev / "data"), "heartbeat_s": 1.0})
    log = (tmp_path / "device.log").open("w")
    proc = subprocess.Popen([FRACTAL, "node", "--config", str(dev / "NODE.toml")], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        def pending():
            rows = c.get("/api/enrollments").json()["enrollments"]
            return next((r for r in rows if r["device_id"] == "board-1" and r["state"] == "pending"), None)

        row = _wait(pending, 60, "the device's enrolment request")
        device_pub = json.loads((dev / "data/keys/device.key").read_text())
        assert row["key_id"] == device_pub["key_id"] and row["key_fingerprint"].startswith("SHA256:")
        # pending: nothing on the broker (no client of that name; anonymous refused)
        for user in (None, "board-1"):
            with pytest.raises(TransportError, match="refused"):
                MqttLink(f"mqtt://{user + ':x@' if user else ''}{host}", swarm=swarm, client_id="pending",
                         connect_timeout=5)
        assert proc.poll() is None

        assert c.post("/api/enrollments/board-1/accept").json()["state"] == "accepted"
        node = _wait(lambda: next((n for n in c.get("/api/nodes").json()["nodes"]
                                   if n["node_id"] == "board-1" and n["online"]), None), 120,
                     "the enrolled device's signed status on the fleet")
        assert node["arch"] and c.get("/api/nodes").json()["rejected"].get("unknown_key", 0) == 0
        # the member learnt the device's key from the fleet's signed, retained keyring update
        _wait(lambda: "board-1" in Keyring.load(node_ring).members(), 10, "the member's keyring update")

        # a signed round of the existing member and the new device
        def live():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        _wait(live, 30, "the device's HTTP API")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/samples",
                       json={"inputs": {"x": x[1:400:2].tolist()}, "labels": y[1:400:2].tolist()}, timeout=30)
        assert r.status_code < 300, r.text
        _wait(lambda: next(n for n in c.get("/api/nodes").json()["nodes"]
                           if n["node_id"] == "board-1")["samples"] == 200, 20, "the device's samples")
        rid = c.post("/api/rounds", json={"steps": 5, "lr": 0.1, "nodes": ["node-1", "board-1"]}).json()
        assert "round_id" in rid, rid
        rnd = _wait(lambda: (g := c.get(f"/api/rounds/{rid['round_id']}").json())["state"] != "running" and g,
                    120, "the round to end")
        assert rnd["state"] == "done", rnd
        assert len({s["params_sha256"] for s in rnd["nodes"].values()}) == 1, rnd["nodes"]

        # revoked: key revoked everywhere, broker client gone
        enrolled = (dev / "data/enrolled.toml").read_text()
        password = enrolled.split("board-1:", 1)[1].split("@", 1)[0]
        assert c.post("/api/enrollments/board-1/revoke").json()["state"] == "revoked"
        _wait(lambda: device_pub["key_id"] in Keyring.load(node_ring).revoked, 10, "the member's revocation")
        with pytest.raises(TransportError, match="refused"):
            MqttLink(f"mqtt://board-1:{password}@{host}", swarm=swarm, client_id="board-1-again",
                     connect_timeout=5)
        # the device's private key stayed on the device: the fleet only ever saw its public half
        pub = wire.public_b64(load_private_key(dev / "data/keys/device.key").public_key())
        assert wire.device_key_id("board-1", pub) == device_pub["key_id"]
        assert device_pub["private_key"] not in (tmp_path / "fleet.sqlite").read_bytes().decode("latin-1")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        print((tmp_path / "device.log").read_text()[-3000:])
