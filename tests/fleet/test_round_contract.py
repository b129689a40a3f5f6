"""A round as the fleet checks it (issue 26 findings 8, 9 and 12 and its "also seen" items), each
reproducing the attack or the measurement: a fleet app over an in-memory MQTT link whose nodes
report what the real ones report."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.fleet.settings import FleetSettings
from api.fleet_app import create_fleet_app
from federation import topics
from federation.bounds import PARTICIPANTS_MAX, SITE_PARTICIPANTS_MAX
from federation.broker import MESSAGE_SIZE_LIMIT
from federation.messages import (
    EventKind,
    NodeState,
    NodeStatus,
    RoundCommand,
    RoundEvent,
    Validation,
    parse_command,
)
from tests.fleet.fake_link import FakeLink

TOKEN = "contract-token"
SWARM = "rc"
H1, H2 = "ab" * 32, "cd" * 32


class Swarm:
    """A fleet app and the nodes it hears from (statuses and round events over a FakeLink)."""

    def __init__(self, client: TestClient, link: FakeLink) -> None:
        self.client, self.link = client, link

    def status(self, node: str, state: NodeState = NodeState.ONLINE, **kw) -> None:
        fields = {"model_version": 2, "versions": [0, 1, 2], "params_sha256": H1, "samples_val": 15} | kw
        self.link.deliver(topics.status(SWARM, node),
                          NodeStatus(node_id=node, state=state, **fields).model_dump_json().encode())

    def event(self, rid: str, node: str, kind: EventKind, **kw) -> None:
        self.link.deliver(topics.round_events(SWARM, rid, node),
                          RoundEvent(kind=kind, round_id=rid, node_id=node, **kw).model_dump_json().encode())

    def post(self, path: str, body: dict):
        return self.client.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})

    def get(self, path: str):
        return self.client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})

    def commands(self) -> list:
        return [parse_command(p) for t, p in self.link.published if t == topics.command(SWARM)]

    def done(self, rid: str, node: str, *, acc_before: float = 0.96, acc_after: float = 0.96,
             samples: int = 15, sha: str = H2, version: int = 3) -> None:
        self.event(rid, node, EventKind.DONE, step=1, params_sha256=sha, model_version=version,
                   val_before=Validation(loss=0.3, accuracy=acc_before, samples=samples),
                   val_after=Validation(loss=0.3, accuracy=acc_after, samples=samples))


@pytest.fixture
def swarm(tmp_path) -> Iterator[Swarm]:
    link = FakeLink()
    app = create_fleet_app(FleetSettings(swarm=SWARM, token=TOKEN, broker="mqtt://unused:1",
                                         db=str(tmp_path / "f.sqlite")), link_factory=lambda s: link)
    with TestClient(app) as client:
        yield Swarm(client, link)


# -- finding 8 / issue 28 #2: more nodes than a command can carry -------------------------------------
def test_seventy_nodes_run_one_hierarchical_round_in_sites_of_at_most_one_ring(swarm):
    nodes = [f"n{i:02d}" for i in range(70)]
    for i, n in enumerate(nodes):
        swarm.status(n, site="east" if i < 30 else None)
    r = swarm.post("/api/rounds", {"steps": 1})
    assert r.status_code == 201 and len(r.json()["participants"]) == 70
    (cmd,) = swarm.commands()
    assert cmd.sites == {"east": nodes[:30], "default": nodes[30:]}
    assert swarm.get(f"/api/rounds/{cmd.round_id}").json()["sites"] == cmd.sites
    assert all(len(ms) <= SITE_PARTICIPANTS_MAX for ms in cmd.sites.values())
    # Hierarchical rounds run uncompressed means, screened across levels with the nodes' default
    # outlier factor (federation/PROTOCOL.md section 10).
    assert (cmd.outlier_factor, cmd.aggregation, cmd.compression) == (None, "mean", "none")


def test_a_hierarchical_round_takes_the_operators_outlier_factor(swarm):
    for n in ("a", "b"):
        swarm.status(n, site=f"site-{n}")
    assert swarm.post("/api/rounds", {"steps": 1, "outlier_factor": 4}).status_code == 201
    (cmd,) = swarm.commands()
    assert cmd.sites is not None and cmd.outlier_factor == 4


@pytest.mark.parametrize("asked", [{"aggregation": "median"}, {"compression": "int8"}])
def test_a_hierarchical_round_asked_for_codecs_or_robust_aggregation_is_a_422(swarm, asked):
    for n in ("a", "b"):
        swarm.status(n, site=f"site-{n}")
    r = swarm.post("/api/rounds", {"steps": 1, **asked})
    (key,) = asked
    assert r.status_code == 422 and key in r.text and "section 10" in r.text
    assert swarm.commands() == []
    assert swarm.post("/api/rounds", {"steps": 1, key: {"aggregation": "mean",
                                                        "compression": "none"}[key]}).status_code == 201


def test_past_one_thousand_nodes_are_refused_naming_the_limit_not_a_500(swarm):
    nodes = [f"n{i:04d}" for i in range(PARTICIPANTS_MAX + 1)]
    for n in nodes:
        swarm.status(n)
    r = swarm.post("/api/rounds", {"steps": 1})
    assert r.status_code == 409 and f"at most {PARTICIPANTS_MAX} participants" in r.text and "nodes" in r.text
    r = swarm.post("/api/rollback", {})
    assert r.status_code == 409 and f"at most {PARTICIPANTS_MAX} participants" in r.text
    r = swarm.post("/api/rounds", {"steps": 1, "nodes": nodes})
    assert r.status_code == 422 and str(PARTICIPANTS_MAX) in r.text
    assert swarm.post("/api/rollback", {"nodes": nodes}).status_code == 422
    assert swarm.commands() == []
    r = swarm.post("/api/rounds", {"steps": 1, "nodes": nodes[:PARTICIPANTS_MAX]})
    assert r.status_code == 201 and len(r.json()["participants"]) == PARTICIPANTS_MAX
    (cmd,) = swarm.commands()
    # One site of 1,000 (no site declared) is cut into 16 rings of 62-63, one leader each.
    assert cmd.sites is not None and len(cmd.sites) == 16
    assert {len(ms) for ms in cmd.sites.values()} == {62, 63}
    assert sum(len(ms) for ms in cmd.sites.values()) == PARTICIPANTS_MAX
    assert len(cmd.model_dump_json()) < MESSAGE_SIZE_LIMIT // 8


# -- finding 12: one bound per value -----------------------------------------------------------------
@pytest.mark.parametrize("lr", [50, 10.0000001, 100])
def test_lr_past_the_command_bound_is_a_422_naming_it(swarm, lr):
    swarm.status("a")
    swarm.status("b")
    r = swarm.post("/api/rounds", {"steps": 1, "lr": lr})
    assert r.status_code == 422 and "lr" in r.text and "10" in r.text
    assert swarm.post("/api/rounds", {"steps": 1, "lr": 10}).status_code == 201


@pytest.mark.parametrize(("before", "code"), [(2**63, 422), (2**64, 422), (2**63 - 1, 200)])
def test_actions_cursor_past_sqlite_integers_is_a_422(swarm, before, code):
    assert swarm.get(f"/api/actions?before={before}").status_code == code


# -- finding 9: an insider steering validation and stalling training ----------------------------------
def _round(swarm: Swarm, **body) -> tuple[str, list[str]]:
    r = swarm.post("/api/rounds", {"steps": 1, **body})
    assert r.status_code == 201, r.text
    return r.json()["round_id"], r.json()["participants"]


def test_a_node_claiming_2_40_validation_samples_cannot_set_the_swarm_figure(swarm):
    for n in ("a", "b", "c"):
        swarm.status(n)
    swarm.status("liar", samples_val=2**40)  # it lies in its status too
    rid, members = _round(swarm)
    for n in ("a", "b", "c"):
        swarm.done(rid, n, acc_before=0.96, acc_after=0.96)
    swarm.done(rid, "liar", acc_before=1.0, acc_after=1.0, samples=2**40)
    rnd = swarm.get(f"/api/rounds/{rid}").json()
    assert rnd["state"] == "done"
    assert rnd["validation_weights"] == {"a": 15, "b": 15, "c": 15, "liar": 30}  # twice the median member
    acc = rnd["validation"]["after"]["accuracy"]
    assert acc == pytest.approx((3 * 15 * 0.96 + 30 * 1.0) / 75) and acc < 0.98  # was 1.0: set by the liar


def test_a_node_lying_the_other_way_cannot_force_a_rollback(swarm):
    for n in ("a", "b", "c", "liar"):
        swarm.status(n)
    rid, _ = _round(swarm)
    for n in ("a", "b", "c"):
        swarm.done(rid, n, acc_before=0.96, acc_after=0.965)
    swarm.done(rid, "liar", acc_before=1.0, acc_after=0.0, samples=2**40)
    rnd = swarm.get(f"/api/rounds/{rid}").json()
    assert rnd["state"] == "done" and rnd["regressed"] is None
    assert not [c for c in swarm.commands() if c.kind == "model.rollback"]


def test_a_member_its_peers_keep_naming_is_left_out_then_readmitted(swarm):
    """A node sending its gradient x -4 makes every round fail at the vote, its peers naming it
    (RoundEvent.member); it names an honest peer back. After STRIKES_MAX rounds the fleet leaves it
    out with a reason the operator sees, the next round commits, and the operator can readmit it."""
    from api.fleet.rounds import STRIKES_MAX

    for n in ("a", "b", "c", "evil"):
        swarm.status(n)
    for i in range(STRIKES_MAX):
        rid, members = _round(swarm)
        assert "evil" in members
        for n in ("a", "b", "c"):
            swarm.event(rid, n, EventKind.FAILED, reason="evil voted no", member="evil")
        swarm.event(rid, "evil", EventKind.FAILED, reason="a voted no", member="a")
        assert swarm.get(f"/api/rounds/{rid}").json()["state"] == "failed"
        left = {v["node_id"]: v["left_out"] for v in swarm.get("/api/nodes").json()["nodes"]}
        assert left["a"] is None  # one accuser is not a majority of a's peers
        assert (left["evil"] is None) is (i < STRIKES_MAX - 1)
    assert "named by 3 of its 3 peers" in left["evil"] and "readmit" in left["evil"]
    rid, members = _round(swarm)
    assert members == ["a", "b", "c"]
    assert "evil" in swarm.get(f"/api/rounds/{rid}").json()["left_out"]
    for n in members:
        swarm.done(rid, n)
    assert swarm.get(f"/api/rounds/{rid}").json()["state"] == "done"
    # explicitly asked for, it is still left out (and said so)
    for n in members:
        swarm.status(n, params_sha256=H2, model_version=3, versions=[0, 1, 2, 3])
    r = swarm.post("/api/rounds", {"steps": 1, "nodes": ["a", "evil"]})
    assert r.status_code == 409 and "evil is left out" in r.text
    assert swarm.client.post("/api/nodes/evil/readmit", headers={"Authorization": f"Bearer {TOKEN}"}
                             ).json()["left_out"] is None
    assert swarm.client.post("/api/nodes/a/readmit", headers={"Authorization": f"Bearer {TOKEN}"}
                             ).status_code == 409
    swarm.status("evil", params_sha256=H2, model_version=3, versions=[0, 1, 2, 3])
    assert "evil" in _round(swarm)[1]


def test_a_member_excluded_from_steps_round_after_round_is_left_out(swarm):
    """Screening keeps rounds committing but names the member whose update it excluded."""
    from api.fleet.rounds import STRIKES_MAX

    for n in ("a", "b", "c", "evil"):
        swarm.status(n)
    for i in range(STRIKES_MAX):
        rid, members = _round(swarm)
        assert "evil" in members
        for n in members:
            swarm.event(rid, n, EventKind.DONE, step=1, params_sha256=H2 if i % 2 == 0 else H1,
                        model_version=3 + i, excluded=["evil"] if n != "evil" else None)
        for n in members:
            swarm.status(n, params_sha256=H2 if i % 2 == 0 else H1, model_version=3 + i)
    assert swarm.get("/api/nodes").json()["nodes"][-1]["left_out"]
    assert _round(swarm)[1] == ["a", "b", "c"]


# -- also seen: a round POSTed right after the previous one reads done ---------------------------------
def test_a_round_posted_right_after_done_finds_its_participants_idle(swarm):
    for n in ("a", "b", "c"):
        swarm.status(n)
    for i in range(3):
        rid, members = _round(swarm)
        for n in members:  # inside the round: the nodes report themselves training
            swarm.status(n, NodeState.TRAINING, round_id=rid)
        sha = H2 if i % 2 == 0 else H1
        for n in members:
            swarm.done(rid, n, sha=sha, version=3 + i)
        assert swarm.get(f"/api/rounds/{rid}").json()["state"] == "done"
        # their idle statuses have not arrived yet: the next round is accepted, from what they hold
        assert [c for c in swarm.commands() if isinstance(c, RoundCommand)][-1].round_id == rid
        nxt = swarm.post("/api/rounds", {"steps": 1})
        assert nxt.status_code == 201, nxt.text
        cmd = [c for c in swarm.commands() if isinstance(c, RoundCommand)][-1]
        assert cmd.start_sha256 == sha
        for n in members:
            swarm.event(nxt.json()["round_id"], n, EventKind.FAILED, reason="test")
        for n in members:
            swarm.status(n, params_sha256=sha, model_version=3 + i)


# -- also seen: rollbacks on noise, rounds during a rollback -------------------------------------------
def _flip(swarm: Swarm, before: list[int], after: list[int]) -> dict:
    """A round on three nodes with 15 validation samples each, ``before``/``after`` right answers."""
    for n in ("a", "b", "c"):
        swarm.status(n)
    rid, members = _round(swarm)
    for n, rb, ra in zip(members, before, after, strict=True):
        swarm.done(rid, n, acc_before=rb / 15, acc_after=ra / 15)
    return swarm.get(f"/api/rounds/{rid}").json()


def test_one_flipped_validation_sample_does_not_roll_back(swarm):
    """9/45 -> 8/45 right (a 2.2-point drop against the 2-point margin) is noise."""
    rnd = _flip(swarm, [3, 3, 3], [3, 2, 3])
    assert rnd["regressed"] is None
    assert not [c for c in swarm.commands() if c.kind == "model.rollback"]


def test_a_real_drop_rolls_back_and_a_round_during_it_is_refused_naming_it(swarm):
    rnd = _flip(swarm, [14, 14, 15], [7, 8, 6])
    assert "fell from" in rnd["regressed"] and "45 samples" in rnd["regressed"]
    rb = [c for c in swarm.commands() if c.kind == "model.rollback"]
    assert len(rb) == 1
    r = swarm.post("/api/rounds", {"steps": 1})
    assert r.status_code == 409
    assert f"automatic rollback {rb[0].rollback_id} of round {rnd['round_id']}" in r.text, r.text
    for n in ("a", "b", "c"):  # the nodes reach v2: the rollback is done
        swarm.status(n, model_version=2)
    assert swarm.post("/api/rounds", {"steps": 1}).status_code == 201
