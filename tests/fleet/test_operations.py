"""One coordinator of the fleet's operations (api/fleet/operations.py): two POSTs fired at the same
moment at the fleet app start exactly one of two conflicting operations, the other gets a 409 naming
the one that runs; operations the table lets overlap both start.

The race is made deterministic: each manager's start is wrapped so both requests wait at a barrier
after the HTTP layer and before the manager starts (where the service used to check the other
managers, one by one, without a common lock: both requests passed their checks and both started)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from itertools import combinations
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.fleet.operations import MAY_OVERLAP, Operations, OpKind, may_overlap
from api.fleet.rollback import RollbackManager, RollbackRequest
from api.fleet.rollouts import ImageRollbackRequest, RolloutManager, RolloutRequest
from api.fleet.rounds import RoundRejected
from api.fleet.settings import FleetSettings
from api.fleet_app import create_fleet_app
from federation import topics
from federation.messages import ImageInfo, NodeState, NodeStatus
from tests.fleet.fake_link import FakeLink

TOKEN = "ops-token"
SWARM = "ops"
NODES = ("n1", "n2", "n3")

# POST path and body of each operation, all aimed at the same nodes
REQUESTS: dict[OpKind, tuple[str, dict[str, Any]]] = {
    OpKind.ROUND: ("/api/rounds", {"steps": 1}),
    OpKind.ROLLBACK: ("/api/rollback", {}),
    OpKind.IMAGE_ROLLBACK: ("/api/image-rollback", {"nodes": list(NODES)}),
}
# the manager method each operation starts through (where the barrier goes)
STARTS: dict[OpKind, tuple[str, str]] = {
    OpKind.ROUND: ("rounds", "start"),
    OpKind.ROLLBACK: ("rollbacks", "start"),
    OpKind.IMAGE_ROLLBACK: ("rollouts", "start_rollback"),
}


@pytest.fixture
def fleet(tmp_path) -> Iterator[tuple[TestClient, Any]]:
    link = FakeLink()
    app = create_fleet_app(FleetSettings(swarm=SWARM, token=TOKEN, broker="mqtt://unused:1",
                                         db=str(tmp_path / "f.sqlite")), link_factory=lambda s: link)
    with TestClient(app) as client:
        image = ImageInfo(version="1.1.0", slot="b", state="good", health="passed", previous="1.0.0")
        for n in NODES:  # idle, at v2 keeping v1, running from a device image with a previous slot
            status = NodeStatus(node_id=n, state=NodeState.ONLINE, model_version=2, versions=[1, 2],
                                params_sha256="ab" * 32, image=image, board="x86_64")
            link.deliver(topics.status(SWARM, n), status.model_dump_json().encode())
        yield client, app.state.fleet


def _race(client: TestClient, service: Any, a: OpKind, b: OpKind) -> dict[OpKind, Any]:
    """POST ``a`` and ``b`` from two threads that meet at a barrier right before their managers start."""
    barrier = threading.Barrier(2, timeout=30)
    for kind in (a, b):
        mgr_name, method = STARTS[kind]
        mgr = getattr(service, mgr_name)
        original: Callable[..., Any] = getattr(mgr, method)

        @functools.wraps(original)
        def gated(*args: Any, _original: Callable[..., Any] = original, **kw: Any) -> Any:
            barrier.wait()  # both requests are past the HTTP layer and the service: now start
            return _original(*args, **kw)

        setattr(mgr, method, gated)
    out: dict[OpKind, Any] = {}

    def post(kind: OpKind) -> None:
        path, body = REQUESTS[kind]
        out[kind] = client.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})

    threads = [threading.Thread(target=post, args=(k,)) for k in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not barrier.broken, "a request never reached its manager"
    return out


CONFLICTS = [(a, b) for a, b in combinations(REQUESTS, 2) if not may_overlap(a, b)]
OVERLAPS = [(a, b) for a, b in combinations(REQUESTS, 2) if may_overlap(a, b)]


@pytest.mark.parametrize(("a", "b"), CONFLICTS, ids=[f"{a.name}-{b.name}" for a, b in CONFLICTS])
def test_of_two_conflicting_operations_started_at_once_exactly_one_starts(fleet, a, b):
    client, service = fleet
    res = _race(client, service, a, b)
    codes = sorted(r.status_code for r in res.values())
    assert codes in ([201, 409], [202, 409]), {k.name: (r.status_code, r.text) for k, r in res.items()}
    (lost,) = [k for k, r in res.items() if r.status_code == 409]
    (won,) = [k for k in res if k is not lost]
    why = res[lost].json()["error"]
    assert why.startswith("cannot start a") and f" {lost} now: " in why, why
    assert why.endswith("start it after that ends"), why
    # the message names the operation that runs, by its id
    started = res[won].json()
    rid = started.get("round_id") or started.get("rollback_id") or started.get("rollout_id")
    assert rid and rid in why, (why, started)


@pytest.mark.parametrize(("a", "b"), OVERLAPS, ids=[f"{a.name}-{b.name}" for a, b in OVERLAPS])
def test_operations_the_table_lets_overlap_both_start_at_once(fleet, a, b):
    client, service = fleet
    res = _race(client, service, a, b)
    assert all(r.status_code in (201, 202) for r in res.values()), {k.name: r.text for k, r in res.items()}


def test_the_table_is_symmetric_and_no_operation_overlaps_itself():
    assert OVERLAPS and CONFLICTS  # the races above cover both answers
    for pair in MAY_OVERLAP:
        assert len(pair) == 2
    for a in OpKind:
        assert not may_overlap(a, a)
        for b in OpKind:
            assert may_overlap(a, b) == may_overlap(b, a)


def test_managers_alone_refuse_their_own_second_operation_and_share_one_coordinator():
    """A roll-out and an image rollback (one manager) conflict through the same table."""
    sent: list = []
    ops = Operations()
    ro = RolloutManager(swarm="s", publish=lambda t, m: sent.append(m), stage_timeout_s=60, operations=ops)
    rb = RollbackManager(swarm="s", publish=lambda t, m: sent.append(m), timeout_s=60, operations=ops)
    img = {"version": "1.1.0", "slot": "b", "state": "good", "health": "passed", "previous": "1.0.0"}
    views = [{"node_id": n, "online": True, "state": "online", "image": img, "board": "x86_64",
              "model_version": 2, "versions": [1, 2]} for n in NODES]
    r = ro.start_rollback(ImageRollbackRequest(nodes=["n1"]), nodes=views, now=0)
    image = {"id": "e" * 32, "board": "x86_64", "version": "2.0.0", "size": 1}
    want = f"cannot start an image roll-out now: image rollback {r.rollout_id} is still running"
    with pytest.raises(RoundRejected, match=want):
        ro.start(RolloutRequest(image=image["id"], nodes=["n2"]), image=image, url="http://f/x", nodes=views,
                 now=1)
    # the parameter rollback may overlap the image rollback (table), through the same coordinator
    assert rb.start(RollbackRequest(), nodes=views, now=2).command.to_version == 1
    assert len(sent) == 2

