"""Issue 26, also seen: an operator's script starting rounds back to back, each POST right after the
previous round reads ``done``, over a real swarm (three edge nodes with the TVM-compiled digits model,
a real Mosquitto, the fleet service). The nodes report themselves idle only just after their DONE
event; the fleet counts a participant whose DONE arrived as idle, holding what it committed."""

from __future__ import annotations

import time

import pytest

from compiler import load_artifact

pytestmark = pytest.mark.mosquitto


def test_five_rounds_back_to_back_are_all_accepted(make_fleet, node_factory, digits_artifact, digits_data):
    fleet = make_fleet(auto_rollback=False)
    x, y = digits_data
    art = load_artifact(digits_artifact)
    ids = [f"b2b-n{k}" for k in range(3)]
    for k, n in enumerate(ids):
        node = node_factory(n, digits_artifact, artifact=art, broker=fleet.broker_url, swarm=fleet.swarm)
        node.add_samples({"x": x[k:300:3]}, y[k:300:3])
    fleet.wait_for(lambda: sum(1 for v in fleet.get("/api/nodes").json()["nodes"]
                               if v["state"] == "online" and v["samples"] == 100) == 3, 20, "3 idle nodes")
    versions = []
    for i in range(5):
        r = fleet.post("/api/rounds", json={"steps": 2, "lr": 0.05})
        assert r.status_code == 201, (i, r.text)  # 409 "fewer than 2 nodes online and idle" before
        assert r.json()["participants"] == ids
        rid = r.json()["round_id"]
        deadline = time.monotonic() + 60
        while (rnd := fleet.get(f"/api/rounds/{rid}").json())["state"] == "running":
            assert time.monotonic() < deadline, rnd
            time.sleep(0.01)  # the next POST follows within 10 ms of `done`
        assert rnd["state"] == "done", rnd["reason"]
        versions.append(rnd["version_after"])
    assert versions == [1, 2, 3, 4, 5]
