"""Issue 26 finding 9 over a real swarm: an insider (a member with a valid place in the swarm) sends
its gradient scaled by -40 or -4 every step. The members' screening excludes its update (-40: its
norm, above 10 x the median; -4: under that bound, but pointing against the members' median, the
direction check of federation/aggregators) and their DONE events name it; after STRIKES_MAX such
rounds the fleet leaves it out with a reason the operator sees, the next round commits without
it, and the operator can readmit it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from api.fleet.rounds import STRIKES_MAX
from compiler import load_artifact

pytestmark = pytest.mark.mosquitto


class ScaledGradients:
    """The insider's trainer: the real one, its gradients times ``k``."""

    def __init__(self, inner, k: float) -> None:
        self.inner, self.k = inner, np.float32(k)
        self.batch, self.loss = inner.batch, inner.loss

    def loss_and_grad(self, params, x, y):
        loss, grads = self.inner.loss_and_grad(params, x, y)
        return loss, [g * self.k for g in grads]

    def init_state(self, params):
        return self.inner.init_state(params)

    def apply(self, *args, **kw):
        return self.inner.apply(*args, **kw)


def _run(fleet, steps: int = 3) -> dict:
    r = fleet.post("/api/rounds", json={"steps": steps, "lr": 0.05})
    assert r.status_code == 201, r.text
    rid = r.json()["round_id"]
    deadline = time.monotonic() + 60
    while (rnd := fleet.get(f"/api/rounds/{rid}").json())["state"] == "running":
        assert time.monotonic() < deadline, rnd
        time.sleep(0.05)
    return rnd


@pytest.mark.parametrize("scale", [-40.0, -4.0])
def test_an_insider_whose_updates_keep_being_excluded_is_left_out(make_fleet, node_factory, digits_artifact,
                                                                  digits_data, scale):
    fleet = make_fleet(auto_rollback=False)
    x, y = digits_data
    art = load_artifact(digits_artifact)
    ids = ["a", "b", "c", "evil"]
    for i, n in enumerate(ids):
        node = node_factory(n, digits_artifact, artifact=art, broker=fleet.broker_url, swarm=fleet.swarm,
                            training={"isolation": "thread"})  # the round computes in this process
        node.add_samples({"x": x[i:400:4]}, y[i:400:4])
        if n == "evil":
            node.rounds.trainer = ScaledGradients(node.rounds.trainer, scale)
    fleet.wait_for(lambda: sum(1 for v in fleet.get("/api/nodes").json()["nodes"]
                               if v["state"] == "online" and v["samples"] == 100) == 4, 20, "4 idle nodes")
    for _ in range(STRIKES_MAX):
        # x -4 is named when the direction check left it out in at least half the steps
        rnd = _run(fleet, 3 if scale == -40.0 else 8)
        assert rnd["participants"] == ids and rnd["state"] == "done" and rnd["excluded"] == ["evil"], rnd
        fleet.wait_for(lambda: all(v["state"] == "online" for v in fleet.get("/api/nodes").json()["nodes"]),
                       10, "idle statuses")  # every member's final events are in
    why = fleet.node("evil")["left_out"]
    assert why and "named by 3 of its 3 peers in 3 rounds" in why
    assert all(fleet.node(n)["left_out"] is None for n in ("a", "b", "c"))
    rnd = _run(fleet)
    assert rnd["participants"] == ["a", "b", "c"] and "evil" in rnd["left_out"]
    assert rnd["state"] == "done" and rnd["excluded"] == []
    assert fleet.post("/api/nodes/evil/readmit").json()["left_out"] is None
    assert fleet.node("evil")["left_out"] is None
