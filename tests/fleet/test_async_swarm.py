"""Asynchronous rounds end to end (issue 28 item 4): real EdgeNodes with ``[training] sync =
"async"`` on a signed swarm over real Mosquitto, the real fleet service (HTTP) aggregating. Two
nodes are online first, the third comes online after version 1; the version advances, every node
commits the fleet's versions, and at the end all of them hold the aggregator's bytes and version;
GET /api/async shows the versions. A round cannot be asked for with sync "async"."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from deploy.keys import provision
from federation.steps import flatten

pytestmark = pytest.mark.mosquitto


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _flat_sha(node) -> str:
    return hashlib.sha256(flatten(node.model.snapshot.params).astype("<f4").tobytes()).hexdigest()


def test_async_swarm_nodes_join_late_and_agree(make_fleet, node_factory, digits_artifact, digits_data,
                                               tmp_path):
    x, y = digits_data
    keys = tmp_path / "keys"
    swarm = f"as{int(time.time() * 1000) % 10**8}"
    ids = [f"{swarm}-n{k}" for k in range(3)]
    provision(keys, swarm, ids)
    fleet = make_fleet(swarm=swarm, key_file=str(keys / "keys/fleet.key"),
                       keyring_file=str(keys / "keyring.json"), async_params=str(digits_artifact),
                       async_buffer=2, async_max_staleness=2)
    agg = fleet.service.aggregator
    assert agg is not None and agg.current.version == 0

    def node(k):
        n = node_factory(ids[k], digits_artifact, broker=fleet.broker_url, swarm=swarm,
                         key_file=str(keys / f"keys/{ids[k]}.key"), keyring_file=str(keys / "keyring.json"),
                         training={"sync": "async", "local_steps": 5, "isolation": "thread"})
        n.add_samples({"x": x[k:900:3]}, y[k:900:3])
        return n

    nodes = [node(0), node(1)]
    _wait(lambda: agg.current.version >= 1, 60, "version 1 from the first two nodes")
    nodes.append(node(2))  # comes online later
    _wait(lambda: any(c["member"] == ids[2] for r in agg.history for c in r.contributors), 60,
          "an update of the late node in a version")
    _wait(lambda: agg.current.version >= 4, 60, "version 4")
    agg.close()  # no more versions: every node settles on the last one
    final = agg.current
    _wait(lambda: all(n.model_version == final.version for n in nodes), 30, "every node at the last version")
    assert {_flat_sha(n) for n in nodes} == {final.sha256}
    assert len({n.params_sha256 for n in nodes}) == 1
    assert np.isfinite(final.params).all()
    late = [c for r in agg.history for c in r.contributors if c["member"] == ids[2]]
    assert min(c["base"] for c in late) >= 1

    body = fleet.get("/api/async").json()
    assert body["version"] == final.version and body["sha256"] == final.sha256
    assert body["buffer"] == 2 and body["max_staleness"] == 2
    assert [v["version"] for v in body["versions"]][:2] == [0, 1]
    # rounds stay synchronous: sync "async" is not a round's mode
    r = fleet.client.post("/api/rounds", json={"steps": 1, "sync": "async"})
    assert r.status_code == 422 and "async" in r.text
