"""Round manager logic without a broker: validation, loss aggregation, deadlines."""

from __future__ import annotations

import numpy as np
import pytest

from api.fleet.rounds import RoundManager, RoundRejected, RoundRequest, _interpolate
from federation.messages import EventKind, RoundCommand, RoundEvent


def _manager(sent):
    return RoundManager(swarm="s", publish=lambda t, m: sent.append((t, m)), start_timeout_s=5,
                        idle_timeout_s=5)


def test_interpolate_against_numpy():
    curve = [(0, 2.0), (10, 1.0), (25, 0.4)]
    xs, ys = zip(*curve, strict=True)
    for s in [0, 3, 10, 17, 25]:
        assert _interpolate(curve, s) == pytest.approx(float(np.interp(s, xs, ys)))
    assert _interpolate(curve, -1) is None and _interpolate(curve, 26) is None and _interpolate([], 0) is None


def test_mean_uses_interpolated_losses_and_marks_complete_steps():
    sent = []
    m = _manager(sent)
    rnd = m.start(RoundRequest(steps=30, nodes=None), online={"a", "b"}, known={"a", "b"}, now=0.0)
    assert isinstance(sent[0][1], RoundCommand) and sent[0][0] == "fractal/v1/s/cmd"
    rid = rnd.round_id
    for node, pts in {"a": [(0, 2.0), (20, 1.0)], "b": [(0, 3.0), (10, 2.0), (29, 0.1)]}.items():
        for step, loss in pts:
            m.on_event(RoundEvent(kind=EventKind.STEP, round_id=rid, node_id=node, step=step, loss=loss), 1.0)
    series = {s["step"]: s for s in m.get(rid)["loss"]}
    assert series[0]["mean"] == pytest.approx(2.5) and series[0]["complete"]
    assert series[10]["mean"] == pytest.approx((1.5 + 2.0) / 2) and series[10]["nodes"] == {"b": 2.0}
    assert series[29]["mean"] == pytest.approx(0.1) and not series[29]["complete"]  # a stopped at 20


def test_validation_and_deadline():
    sent = []
    m = _manager(sent)
    with pytest.raises(RoundRejected) as e:
        m.start(RoundRequest(steps=1), online={"a"}, known={"a", "b"}, now=0)
    assert e.value.status_code == 409 and "fewer than 2" in e.value.reason
    rnd = m.start(RoundRequest(steps=1, nodes=["a", "b", "c"]), online={"a", "b"},
                  known={"a", "b", "c"}, now=0)
    assert rnd.skipped == ["c"] and rnd.command.participants == ["a", "b"]
    assert m.tick(4.9) == []
    m.on_event(RoundEvent(kind=EventKind.STEP, round_id=rnd.round_id, node_id="a", step=0, loss=1.0), 4.0)
    failed = m.tick(5.1)
    assert [r.round_id for r in failed] == [rnd.round_id]
    assert m.get(rnd.round_id)["reason"] == "deadline passed: b (no report within 5s)"


def test_long_round_aggregation_stays_fast():

    m = _manager([])
    rnd = m.start(RoundRequest(steps=10_000), online={"a", "b", "c"}, known={"a", "b", "c"}, now=0.0)
    rng = np.random.default_rng(0)
    for node in ("a", "b", "c"):  # each node reports its own (throttled) subset of steps
        for step in np.unique(rng.integers(0, 10_000, 4000)):
            m.on_event(RoundEvent(kind=EventKind.STEP, round_id=rnd.round_id, node_id=node, step=int(step),
                                  loss=1.0 / (1 + step)), 1.0)
    series = m.get(rnd.round_id)["loss"]
    assert len(series) > 6000 and all(s["mean"] > 0 for s in series)
    thin = m.get(rnd.round_id, max_points=400)["loss"]
    assert len(thin) == 400 and thin[0] == series[0] and thin[-1] == series[-1]


def test_robust_settings_reach_the_command_and_excluded_members_show_in_the_round():
    from pydantic import ValidationError

    sent = []
    m = _manager(sent)
    rnd = m.start(RoundRequest(steps=3, aggregation="median", outlier_factor=5), online={"a", "b", "c"},
                  known={"a", "b", "c"}, now=0.0)
    cmd = sent[0][1]
    assert cmd.aggregation == "median" and cmd.outlier_factor == 5
    for node in "abc":
        m.on_event(RoundEvent(kind=EventKind.DONE, round_id=rnd.round_id, node_id=node, step=3,
                              params_sha256="ab" * 32, model_version=1, excluded=["b"]), 1.0)
    assert m.get(rnd.round_id)["excluded"] == ["b"]
    for bad in ({"aggregation": "max"}, {"outlier_factor": 0.5}, {"outlier_factor": float("inf")}):
        with pytest.raises(ValidationError):
            RoundRequest(steps=3, **bad)


def test_an_offline_participant_fails_the_round_only_after_the_grace():
    sent = []
    m = RoundManager(swarm="s", publish=lambda t, msg: sent.append((t, msg)), start_timeout_s=1000,
                     idle_timeout_s=1000, offline_grace_s=5)
    rid = m.start(RoundRequest(steps=10), online={"a", "b"}, known={"a", "b"}, now=0.0).round_id
    # a Last Will at t=1, the node back in this round (its status names it) at t=2: the round goes on
    assert m.node_offline("b", 1.0) == [] and m.tick(5.9) == []
    m.node_online("b", "some-other-round")
    m.node_online("b", rid)
    assert m.tick(49.5) == [] and m.get(rid)["state"] == "running"
    # a round event counts as back too
    assert m.node_offline("b", 50.0) == []
    m.on_event(RoundEvent(kind=EventKind.STEP, round_id=rid, node_id="b", step=3, loss=1.0), 52.0)
    assert m.tick(58.0) == []
    # offline at 60 and never back in the round (a restarted node reports online without it): failed
    # once the grace is over (not at 64.9), naming it, aborted
    assert m.node_offline("b", 60.0) == [] and m.node_offline("b", 62.0) == []  # the first time counts
    m.node_online("b", None)
    assert m.tick(64.9) == []
    [rnd] = m.tick(65.1)
    assert rnd.state.value == "failed" and "b (went offline and did not come back within 5s)" in rnd.reason
    assert sent[-1][1].kind == "round.abort"


def test_without_a_grace_or_for_an_expired_node_the_round_fails_at_once():
    for grace, immediate in ((0.0, False), (5.0, True)):
        m = RoundManager(swarm="s", publish=lambda t, msg: None, start_timeout_s=50, idle_timeout_s=50,
                         offline_grace_s=grace)
        rid = m.start(RoundRequest(steps=10), online={"a", "b"}, known={"a", "b"}, now=0.0).round_id
        [rnd] = m.node_offline("b", 1.0, immediate=immediate)
        assert rnd.round_id == rid and rnd.reason == "node b went offline during the round"


def test_a_round_that_cannot_start_names_the_halted_nodes_and_why():
    """Issue 26 finding 7: a board with no bootable slot is unavailable with its reason."""
    m = _manager([])
    for nodes in (None, ["a", "h"]):
        with pytest.raises(RoundRejected) as e:
            m.start(RoundRequest(steps=1, nodes=nodes), online={"a"}, known={"a", "h"}, now=0,
                    halted={"h": "slot a: below the floor 5"})
        assert e.value.status_code == 409
        assert "; h is halted, no bootable slot: slot a: below the floor 5" in e.value.reason
    rnd = m.start(RoundRequest(steps=1, nodes=None), online={"a", "b"}, known={"a", "b", "h"}, now=0,
                  halted={"h": "slot a: below the floor 5"})
    assert rnd.command.participants == ["a", "b"]
