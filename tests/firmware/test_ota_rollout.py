"""Over the air, end to end: a real fleet with an image catalogue, a real Mosquitto, and two boards
run by real `fractal boot` processes, in a signed swarm (deploy/keys.py). A canary roll-out (the
second node only after the first passed its health check) whose first download is cut mid-way
and resumes with one range request; an operator image rollback; an image that fails its health
check stops the roll-out, and the canary falls back by itself while the other node is never
touched. Unsigned or node-signed image commands on the command topic change nothing."""

from __future__ import annotations

import re

import httpx
import pytest

from deploy.keys import provision
from federation import topics
from federation.messages import ImageRollbackCommand, ImageUpdateCommand
from federation.signed import load_identity
from tests.firmware.boards import make_board
from tests.firmware.test_ota import CuttingProxy
from tests.fleet.conftest import TOKEN, broker, make_fleet  # noqa: F401 - fixtures

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]


def _image(fleet, node_id: str) -> dict | None:
    n = fleet.node(node_id)
    return n["image"] if n and n["online"] else None


def _passed(fleet, node_id: str) -> dict | None:
    """The node's image once this boot's health check passed."""
    i = _image(fleet, node_id)
    return i if i and i["health"] == "passed" else None


def _rejected(board, reason: str) -> float:
    """The node's count of MQTT messages dropped for ``reason`` (its Prometheus metrics)."""
    text = httpx.get(f"http://127.0.0.1:{board.port}/metrics", timeout=5).text
    m = re.search(rf'^fractal_node_messages_rejected_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_rollout(fleet, rid: str, timeout: float = 300.0) -> dict:
    return fleet.wait_for(
        lambda: (r := fleet.get(f"/api/rollouts/{rid}").json())["state"] != "running" and r,
        timeout, f"roll-out {rid} to end",
    )


def test_canary_rollout_resume_operator_rollback_and_a_failing_image(make_fleet, fw_image, fw_keys, tmp_path):  # noqa: F811
    swarm = f"ota-{tmp_path.name[-12:].strip('_-') or 'x'}"
    keys = tmp_path / "swarm-keys"
    provision(keys, swarm, ["node-1", "node-2"])
    proxy = CuttingProxy(None, cut=0)  # the fleet's public URL: nodes download through it
    fleet = make_fleet(swarm=swarm, images_dir=str(tmp_path / "catalogue"),
                       image_keys=[f"{fw_keys['k1']}.pub"], public_url=proxy.url, rollout_stage_timeout_s=180,
                       key_file=str(keys / "keys/fleet.key"), keyring_file=str(keys / "keyring.json"))
    proxy.forward_to(fleet.url)
    pub = f"{fw_keys['k1']}.pub"
    boards = [make_board(tmp_path, n, fw_image("1.0.0"), pub, fleet.broker_url, fleet.swarm,
                         extra=f'key_file = "{keys}/keys/{n}.key"\nkeyring_file = "{keys}/keyring.json"\n')
              for n in ("node-1", "node-2")]
    try:
        for b in boards:
            img = fleet.wait_for(lambda b=b: _passed(fleet, b.node_id), 240, f"{b.node_id} booted\n{b.log()}")
            assert (img["version"], img["slot"], img["previous"]) == ("1.0.0", "a", None)

        good = fleet.post("/api/images", content=fw_image("2.0.0").read_bytes()).json()
        broken = fleet.post("/api/images", content=fw_image("3.0.0", broken=True).read_bytes()).json()
        proxy.cut = good["size"] // 3

        # forged image commands: unsigned, and signed by a node's key (only the fleet may command)
        forged = ImageUpdateCommand(update_id="forged-1", nodes=["node-1", "node-2"], image_id=good["id"],
                                    version="2.0.0", size=good["size"],
                                    url=f"{fleet.url}/api/images/{good['id']}?token={TOKEN}")
        raw = fleet.link("attacker")
        raw.publish(topics.command(swarm), forged).wait_for_publish(5)
        member = load_identity(keys / "keys/node-2.key", keys / "keyring.json").link(
            fleet.link("node-2-impostor"))
        member.publish(topics.command(swarm), forged.model_copy(update={"update_id": "forged-2"}))
        rollback = ImageRollbackCommand(rollback_id="forged-3", nodes=["node-1"])
        raw.publish(topics.command(swarm), rollback).wait_for_publish(5)

        # refusals: 4xx with the reason, nothing sent
        for body, code, word in (
            ({"image": "0" * 32, "nodes": ["node-1"]}, 404, "unknown image"),
            ({"image": good["id"], "nodes": ["node-1", "ghost"]}, 404, "unknown node"),
            ({"image": good["id"], "nodes": []}, 422, ""),
            ({"image": "../etc/passwd", "nodes": ["node-1"]}, 422, ""),
            ({"image": good["id"], "nodes": ["node-1"], "force": True}, 422, ""),
        ):
            r = fleet.post("/api/rollouts", json=body)
            assert r.status_code == code and word in r.text, (body, r.text)
        r = fleet.post("/api/image-rollback", json={"nodes": ["node-1"]})
        assert r.status_code == 409 and "no previous good slot" in r.text, r.text
        # without the operator token or a valid grant, the image does not download
        assert fleet.client.get(f"/api/images/{good['id']}", headers={"Authorization": ""}).status_code == 401
        assert fleet.client.get(f"/api/images/{good['id']}?exp=99999999999&grant={'0' * 64}",
                                headers={"Authorization": ""}).status_code == 401

        for b in boards:
            fleet.wait_for(lambda b=b: _rejected(b, "unsigned") >= 2 and _rejected(b, "wrong_role") >= 1, 10,
                           f"{b.node_id} dropped the forged commands")
        for b in boards:  # nothing recorded, nothing flashed, nobody restarted
            assert not (b.device / "data" / "ota-update.json").exists(), b.log()
            assert b.state()["slots"]["b"]["state"] == "empty"

        # 1. canary roll-out of 2.0.0: node-1 first, node-2 only after node-1 passed
        r = fleet.post("/api/rollouts", json={"image": good["id"], "nodes": ["node-1", "node-2"]})
        assert r.status_code == 202, r.text
        ro = r.json()
        assert ro["canary"] == "node-1" and ro["stages"] == [["node-1"], ["node-2"]]
        assert ro["nodes"]["node-2"]["sent_at"] is None
        assert fleet.post("/api/rollouts", json={"image": good["id"], "nodes": ["node-2"]}).status_code == 409
        done = _wait_rollout(fleet, ro["rollout_id"])
        assert done["state"] == "done", done
        n1, n2 = done["nodes"]["node-1"], done["nodes"]["node-2"]
        assert n2["sent_at"] >= n1["finished_at"]  # the canary rule
        for b in boards:
            img = fleet.wait_for(lambda b=b: (i := _image(fleet, b.node_id)) and i["version"] == "2.0.0"
                                 and i["health"] == "passed" and i,
                                 30, f"{b.node_id} at 2.0.0")
            assert (img["slot"], img["state"], img["previous"]) == ("b", "good", "1.0.0")
            assert img["update"]["phase"] == "done"
        # the canary's download was cut after a third and resumed: nothing was fetched twice
        relayed = proxy.settled()
        assert relayed[0] == good["size"] // 3
        assert sum(relayed) == 2 * good["size"] and len(relayed) == 3, relayed

        # 2. the operator rolls both back to their previous slot
        r = fleet.post("/api/image-rollback", json={"nodes": ["node-1", "node-2"]})
        assert r.status_code == 202, r.text
        back = _wait_rollout(fleet, r.json()["rollout_id"])
        assert back["state"] == "done" and back["kind"] == "rollback", back
        for b in boards:
            img = fleet.wait_for(lambda b=b: (i := _image(fleet, b.node_id)) and i["version"] == "1.0.0"
                                 and i["health"] == "passed" and i,
                                 30, f"{b.node_id} back at 1.0.0")
            assert (img["slot"], img["state"], img["previous"]) == ("a", "good", "2.0.0")

        # 3. an image that fails its health check: the canary falls back by itself, the roll-out stops
        r = fleet.post("/api/rollouts", json={"image": broken["id"], "nodes": ["node-1", "node-2"]})
        assert r.status_code == 202, r.text
        failed = _wait_rollout(fleet, r.json()["rollout_id"])
        assert failed["state"] == "failed", failed
        assert "canary node-1 rolled back by itself" in failed["reason"]
        assert "expected output" in failed["reason"], failed["reason"]
        assert failed["nodes"]["node-2"]["sent_at"] is None  # never asked
        img = fleet.wait_for(lambda: _passed(fleet, "node-1"), 30, "node-1 booted")
        assert (img["version"], img["slot"], img["update"]["phase"]) == ("1.0.0", "a", "rolled_back")
        s = boards[0].state()
        assert s["slots"]["b"]["state"] == "bad" and s["slots"]["b"]["version"] == "3.0.0"
        img2 = _image(fleet, "node-2")
        assert img2 is not None and (img2["version"], img2["slot"]) == ("1.0.0", "a")
        assert boards[1].state()["slots"]["b"]["version"] == "2.0.0"  # untouched

        # the fleet records a roll-out's end after the roll-out shows it (outside its lock, on the
        # thread that took the status): the failed roll-out above can be seen before its action
        wanted = {"image.rollout", "image.rollout.done", "image.rollback", "image.rollback.done",
                  "image.rollout.failed"}
        fleet.wait_for(lambda: wanted <= {a["action"] for a in fleet.get("/api/actions").json()["actions"]},
                       30, f"the actions {sorted(wanted)}")
        assert all(b.proc is not None and b.proc.poll() is None for b in boards)  # supervisors still up
    except AssertionError:
        for b in boards:
            print(f"---- {b.node_id}\n{b.log()}")
        raise
    finally:
        for b in boards:
            b.stop()
        proxy.close()
