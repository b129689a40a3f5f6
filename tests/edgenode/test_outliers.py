"""Outlier members on a real swarm (issue 12): four nodes over a real Mosquitto, real TVM training,
one hostile node whose gradient is scaled by 1e3.

* An outlier that reports its norm honestly is excluded from every step; the round commits
  without it on all four nodes, the DONE events (and the fleet's round) name it, and accuracy
  stays where the three honest nodes take it.
* A hostile node that lies about its norm (claims the unscaled one) is caught by its ring
  successor's claim check: the round fails naming it and nobody commits.
* The robust aggregates (coordinate-wise median, trimmed mean) over the all-gather commit too.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from compiler import load_artifact
from federation import topics
from federation.messages import EventKind, RoundCommand
from tests.fixtures_node import SwarmWatch

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]


class ScaledTrainer:
    """The artifact's trainer, with every gradient multiplied by ``factor`` (a broken or hostile
    member). Delegates the rest (batch, loss, apply, init_state)."""

    def __init__(self, inner, factor: float) -> None:
        self.inner, self.factor = inner, np.float32(factor)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def loss_and_grad(self, params, x, y):
        loss, grads = self.inner.loss_and_grad(params, x, y)
        return loss, [np.asarray(g) * self.factor for g in grads]


class LyingRing:
    """A member's collective that shrinks the norms it claims by ``factor`` (the step's update
    itself goes out unchanged)."""

    def __init__(self, inner, node_id: str, factor: float) -> None:
        self.inner, self.node_id, self.factor = inner, node_id, np.float32(factor)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def allreduce(self, vec, *, screen=None, **kw):
        if screen is not None:
            row, decide = screen
            screen = (np.asarray(row, np.float32) / self.factor, decide)
        return self.inner.allreduce(vec, screen=screen, **kw)


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _accuracy(node, x, y) -> float:
    out = node.infer({"x": x})[node.outputs[0].name]
    return float((np.argmax(out, axis=1) == y).mean())


@pytest.fixture
def swarm4(mosquitto, swarm_id, mqtt_link_factory, node_factory, digits_artifact, digits_data):
    x, y = digits_data
    art = load_artifact(digits_artifact)
    ids = [f"{swarm_id}-n{k}" for k in range(4)]
    nodes = {}
    for k, i in enumerate(ids):
        n = node_factory(i, digits_artifact, artifact=art, broker=mosquitto.url, swarm=swarm_id)
        n.add_samples({"x": x[k:1200:4]}, y[k:1200:4])
        nodes[i] = n
    fleet = mqtt_link_factory(mosquitto, "fleet")
    watch = SwarmWatch(fleet, swarm_id)
    _wait(lambda: all(watch.statuses.get(i) and watch.statuses[i].samples == 300 for i in ids), 15,
          "statuses of four nodes")
    return ids, nodes, fleet, watch, (x[1200:], y[1200:])


def _run(fleet, watch, swarm_id, ids, nodes, cmd, timeout=120):
    fleet.publish(topics.command(swarm_id), cmd)

    def ended():
        with watch.lock:
            evs = [e for e in watch.events if e.round_id == cmd.round_id]
        done = {e.node_id for e in evs if e.kind == EventKind.DONE}
        failed = {e.node_id for e in evs if e.kind == EventKind.FAILED}
        return done | failed == set(ids)

    _wait(ended, timeout, f"round {cmd.round_id} to end on every node")
    for n in nodes.values():
        assert n.wait_idle(10)
    with watch.lock:
        return [e for e in watch.events if e.round_id == cmd.round_id and e.kind != EventKind.STEP]


def _make_hostile(swarm4, k: int) -> tuple[str, float]:
    """Node k's gradient scaled by 1e3; -> (its id, the first node's accuracy before)."""
    ids, nodes, _, _, (xt, yt) = swarm4
    nodes[ids[k]].rounds.trainer = ScaledTrainer(nodes[ids[k]].rounds.trainer, 1e3)
    return ids[k], _accuracy(nodes[ids[0]], xt, yt)


def _committed(evs) -> list:
    """The DONE events of a round that committed on all four nodes, with one hash."""
    done = [e for e in evs if e.kind == EventKind.DONE]
    assert len(done) == 4, evs
    assert len({e.params_sha256 for e in done}) == 1, [e.params_sha256 for e in done]
    return done


def test_an_outlier_is_excluded_named_and_the_round_commits(swarm4, swarm_id):
    ids, nodes, fleet, watch, (xt, yt) = swarm4
    hostile, before = _make_hostile(swarm4, 2)
    # Without screening the hostile gradient dominates the mean: the round is wrecked, and only
    # the commit's update-norm bound keeps it from being committed (the whole round is lost).
    cmd = RoundCommand(round_id="unscreened", steps=40, lr=0.1, participants=ids, step_timeout_s=15,
                       outlier_factor=0)
    evs = _run(fleet, watch, swarm_id, ids, nodes, cmd)
    assert len(evs) == 4 and all(e.kind == EventKind.FAILED and "update norm" in e.reason for e in evs), evs
    assert {n.model_version for n in nodes.values()} == {0}

    cmd = RoundCommand(round_id="outlier-1", steps=40, lr=0.1, participants=ids, step_timeout_s=15)
    done = _committed(_run(fleet, watch, swarm_id, ids, nodes, cmd))
    assert all(e.excluded == [hostile] for e in done), [e.excluded for e in done]
    assert {e.model_version for e in done} == {1}
    after = _accuracy(nodes[ids[0]], xt, yt)
    assert after > max(0.6, before + 0.3), (before, after)  # the honest three trained the model

    # A liar: same scaled update, but it claims the unscaled norm. On the direct path (this
    # model's 4,810 floats) no claim travels: every member screens the rows themselves, so the
    # lie changes nothing: excluded and named again, the round commits.
    nodes[hostile].rounds.collective = LyingRing(nodes[hostile].rounds.collective, hostile, 1e3)
    assert nodes[hostile].rounds.collective.algorithm(4, 4810) == "direct"
    evs = _run(fleet, watch, swarm_id, ids, nodes, cmd.model_copy(update={"round_id": "liar-direct"}))
    done = _committed(evs)
    assert all(e.excluded == [hostile] for e in done) and {e.model_version for e in done} == {2}, done

    # Around the ring (a model too big for the direct path) the claims travel: the liar's
    # successor's claim check fails the first step; the round fails everywhere naming it and
    # nothing is committed.
    for n in nodes.values():
        getattr(n.rounds.collective, "inner", n.rounds.collective).direct_max_bytes = 0
    state = {i: (n.model_version, n.params_sha256) for i, n in nodes.items()}
    evs = _run(fleet, watch, swarm_id, ids, nodes, cmd.model_copy(update={"round_id": "liar-1"}))
    failed = [e for e in evs if e.kind == EventKind.FAILED]
    assert len(failed) == 4, evs
    assert all(hostile in e.reason for e in failed), [e.reason for e in failed]
    assert {i: (n.model_version, n.params_sha256) for i, n in nodes.items()} == state


@pytest.mark.parametrize("aggregation", ["median", "trimmed_mean"])
def test_robust_aggregation_commits_with_a_hostile_member(swarm4, swarm_id, aggregation):
    ids, nodes, fleet, watch, (xt, yt) = swarm4
    _, before = _make_hostile(swarm4, 1)
    # screening off: the robust aggregate alone must keep the hostile update out
    cmd = RoundCommand(round_id=f"robust-{aggregation}", steps=40, lr=0.1, participants=ids,
                       step_timeout_s=15, aggregation=aggregation, outlier_factor=0)
    _committed(_run(fleet, watch, swarm_id, ids, nodes, cmd))
    after = _accuracy(nodes[ids[0]], xt, yt)
    assert after > max(0.5, before + 0.2), (before, after)


@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_an_outlier_is_excluded_in_compressed_rounds(swarm4, swarm_id, compression):
    """int8 / top-k frames carry error feedback, which no norm claim bounds: the members exchange
    their encoded rows directly and screen the decoded rows. The hostile node is excluded and
    named, the round commits the same bits everywhere, and the model learns (before: screening
    was skipped for these codecs and the hostile update wrecked the round)."""
    ids, nodes, fleet, watch, (xt, yt) = swarm4
    hostile, before = _make_hostile(swarm4, 3)
    cmd = RoundCommand(round_id=f"{compression}-unscreened", steps=40, lr=0.1, participants=ids,
                       step_timeout_s=15, compression=compression, outlier_factor=0)
    evs = _run(fleet, watch, swarm_id, ids, nodes, cmd)
    assert len(evs) == 4 and all(e.kind == EventKind.FAILED for e in evs), evs
    assert {n.model_version for n in nodes.values()} == {0}

    cmd = RoundCommand(round_id=f"{compression}-screened", steps=60, lr=0.1, participants=ids,
                       step_timeout_s=15, compression=compression)
    done = _committed(_run(fleet, watch, swarm_id, ids, nodes, cmd))
    assert all(e.excluded == [hostile] for e in done), [e.excluded for e in done]
    assert {e.model_version for e in done} == {1}
    after = _accuracy(nodes[ids[0]], xt, yt)
    assert after > before + (0.3 if compression == "int8" else 0.05), (before, after)
