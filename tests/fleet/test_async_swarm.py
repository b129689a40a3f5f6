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
from tests.fixtures_enrolment import wait_for

pytestmark = pytest.mark.mosquitto


def _wait(pred, timeout, what, where=None):
    """wait_for; on a timeout the message also says ``where()`` (which node is where and why)."""
    try:
        wait_for(pred, timeout, what, poll_s=0.05)
    except AssertionError as exc:
        if where is None:
            raise
        raise AssertionError(f"{exc}\n{where()}") from None


def _flat_sha(node) -> str:
    return hashlib.sha256(flatten(node.model.snapshot.params).astype("<f4").tobytes()).hexdigest()


def _where(agg, nodes) -> str:
    """The aggregator's versions and, per node, the version it committed, the one its async
    member holds, what it refused, the updates it sent and its last error."""
    cur = agg.current
    lines = [f"aggregator at {cur.version} {cur.sha256[:12]}, pending {sorted(agg.buf.pending)}, "
             f"refused {dict(agg.refused)}, versions "
             f"{[(r.version, r.sha256[:12], [c['member'] for c in r.contributors]) for r in agg.history]}"]
    for n in nodes:
        r = n.async_runner
        held = None if r is None or r.member.current is None else r.member.current
        lines.append(f"{n.node_id}: model {n.model_version} {n.params_sha256[:12]}, member "
                     f"{None if held is None else (held.version, held.sha256[:12])}, "
                     f"refused {None if r is None else dict(r.member.refused)}, "
                     f"updates sent {None if r is None else r.updates_sent}, "
                     f"last_error {None if r is None else r.last_error}")
    return "\n".join(lines)


def test_async_swarm_nodes_join_late_and_agree(make_fleet, node_factory, digits_artifact, digits_data,
                                               tmp_path):
    x, y = digits_data
    keys = tmp_path / "keys"
    swarm = f"as{int(time.time() * 1000) % 10**8}"
    ids = [f"{swarm}-n{k}" for k in range(3)]
    provision(keys, swarm, ids)
    settings = {"swarm": swarm, "key_file": str(keys / "keys/fleet.key"),
                "keyring_file": str(keys / "keyring.json"), "async_params": str(digits_artifact),
                "async_buffer": 2, "async_max_staleness": 2, "db": str(tmp_path / "fleet.sqlite")}
    fleet = make_fleet(**settings)
    agg = fleet.service.aggregator
    assert agg is not None and agg.current.version == 0

    def node(k):
        n = node_factory(ids[k], digits_artifact, broker=fleet.broker_url, swarm=swarm,
                         key_file=str(keys / f"keys/{ids[k]}.key"), keyring_file=str(keys / "keyring.json"),
                         training={"sync": "async", "local_steps": 5, "isolation": "thread"})
        n.add_samples({"x": x[k:900:3]}, y[k:900:3])
        return n

    nodes = [node(0), node(1)]

    def where():
        return _where(agg, nodes)

    _wait(lambda: agg.current.version >= 1, 60, "version 1 from the first two nodes", where)
    nodes.append(node(2))  # comes online later
    _wait(lambda: any(c["member"] == ids[2] for r in agg.history for c in r.contributors), 60,
          "an update of the late node in a version", where)
    _wait(lambda: agg.current.version >= 4, 60, "version 4", where)
    # No more versions: close() returns once the last one is stored and published (an update the
    # link delivers later makes nothing), so every node settles on it.
    agg.close()
    final = agg.current
    _wait(lambda: all(n.model_version == final.version for n in nodes), 30,
          f"every node at the last version {final.version}", where)
    assert {_flat_sha(n) for n in nodes} == {final.sha256}
    assert {n.params_sha256 for n in nodes} == {final.sha256}  # the node's own hash: the same bytes
    assert np.isfinite(final.params).all()
    late = [c for r in agg.history for c in r.contributors if c["member"] == ids[2]]
    assert min(c["base"] for c in late) >= 1

    body = fleet.get("/api/async").json()
    assert body["version"] == final.version and body["sha256"] == final.sha256
    assert body["buffer"] == 2 and body["max_staleness"] == 2
    listed = [v["version"] for v in body["versions"]]  # the newest 50, oldest first, up to the last
    assert listed == list(range(final.version - len(listed) + 1, final.version + 1))
    assert len(listed) == min(final.version + 1, 50)  # from version 0 while fewer were made
    # rounds stay synchronous: sync "async" is not a round's mode
    r = fleet.client.post("/api/rounds", json={"steps": 1, "sync": "async"})
    assert r.status_code == 422 and "async" in r.text

    # The fleet restarts: it resumes at the stored version (the nodes never go back to version 0)
    fleet.stop()
    again = make_fleet(**settings)
    assert again.service.aggregator.current.sha256 == final.sha256
    assert again.get("/api/async").json()["version"] == final.version


@pytest.mark.slow
def test_fractal_swarm_async_real_processes(tmp_path_factory):
    """`fractal swarm --nodes 3 --async 2`: three node processes fed by their sensors train
    asynchronously, the fleet process publishes versions, and every node seen at a version holds
    exactly the bytes the fleet published for it (the node's params_sha256 and the version's sha256
    hash the same float32 bytes)."""
    import httpx

    from tests.fleet.swarm_proc import assert_no_orphans, start_swarm
    from tests.fleet.test_swarm_e2e import _node_urls

    sp = start_swarm(3, tmp_path_factory.getbasetemp() / "swarm-cache", "async-token", extra=("--async", "2"))
    try:
        urls = _node_urls(sp)
        auth = {"Authorization": "Bearer async-token"}
        seen: dict[int, set[str]] = {}
        with httpx.Client(timeout=10, headers=auth) as c:
            deadline = time.monotonic() + 120
            while True:
                for url in urls.values():
                    info = c.get(url + "/v1/node").json()
                    seen.setdefault(info["model_version"], set()).add(info["params_sha256"])
                state = c.get(sp.base + "/api/async").json()
                shared = [v for v, shas in seen.items() if v >= 1]
                if state["version"] >= 3 and shared:
                    break
                assert time.monotonic() < deadline, (state, seen, sp.output()[-3000:])
                time.sleep(0.3)
        assert all(len(shas) == 1 for shas in seen.values()), seen
        published = {v["version"]: v["sha256"] for v in state["versions"]}
        matched = [v for v, shas in seen.items() if v >= 1 and v in published]
        assert matched and all(seen[v] == {published[v]} for v in matched), (seen, published)
        contributors = {c["member"] for v in state["versions"] for c in v["contributors"]}
        assert len(contributors) >= 2, state
        children = sp.descendants()
    finally:
        code = sp.interrupt()
    assert code in (0, 130), sp.output()
    assert_no_orphans(children)
