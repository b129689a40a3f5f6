"""Round edge cases with the numpy stand-in artifact (fast): members without samples."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from edgenode.config import NodeConfig
from edgenode.errors import RoundFailed
from edgenode.node import EdgeNode
from federation.memory import MemoryHub
from federation.messages import RoundCommand
from tests.edgenode.fakes import NumpyArtifact


def swarm(tmp_path, ids, tag):
    hub = MemoryHub()
    (tmp_path / "art").mkdir(exist_ok=True)
    nodes = {}
    for i in ids:
        cfg = NodeConfig.from_dict({"node_id": i, "artifact": str(tmp_path / "art"),
                                    "data_dir": str(tmp_path / tag / i)})
        nodes[i] = EdgeNode(cfg, artifact=NumpyArtifact(), transport=hub.transport(i))
        nodes[i].start()
    return nodes


def run_all(nodes, cmd):
    errors = {}

    def go(n):
        try:
            n.run_round(cmd)
        except RoundFailed as exc:
            errors[n.node_id] = exc

    ts = [threading.Thread(target=go, args=(n,)) for n in nodes.values()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return errors


def test_member_without_samples_does_not_dilute_the_mean(tmp_path):
    rng = np.random.default_rng(0)
    data = {i: (rng.standard_normal((64, 64)).astype(np.float32), rng.integers(0, 10, 64)) for i in "ab"}
    three = swarm(tmp_path, ["a", "b", "c"], "three")
    two = swarm(tmp_path, ["a", "b"], "two")
    try:
        for nodes in (three, two):
            for i, (x, y) in data.items():
                nodes[i].add_samples({"x": x}, y)
        assert not run_all(three, RoundCommand(round_id="same", steps=5, lr=0.5, participants=list(three)))
        assert not run_all(two, RoundCommand(round_id="same", steps=5, lr=0.5, participants=list(two)))
        assert len({n.params_sha256 for n in three.values()}) == 1
        for p3, p2 in zip(three["c"].model.snapshot.params, two["a"].model.snapshot.params, strict=True):
            np.testing.assert_allclose(p3, p2, rtol=1e-5, atol=1e-6)  # c's zeros were rescaled away
        assert three["c"].last_result.losses and np.isnan(three["c"].last_result.losses[0])
    finally:
        for n in [*three.values(), *two.values()]:
            n.stop()


def test_no_samples_anywhere_fails_consistently(tmp_path):
    nodes = swarm(tmp_path, ["a", "b"], "empty")
    try:
        errors = run_all(nodes, RoundCommand(round_id="r", steps=2, participants=list(nodes)))
        assert set(errors) == {"a", "b"}
        assert all("no participant has training samples" in str(e) for e in errors.values())
        assert all(n.model_version == 0 for n in nodes.values())
    finally:
        for n in nodes.values():
            n.stop()


@pytest.mark.parametrize("drop", [0.03])
def test_lossy_transport_still_agrees(tmp_path, drop):
    """Dropped, duplicated and reordered frames (QoS 1 redelivery, broker hiccups) change nothing."""
    hub = MemoryHub()
    (tmp_path / "art").mkdir()
    nodes = {}
    rng = np.random.default_rng(1)
    for k, i in enumerate(["a", "b", "c"]):
        cfg = NodeConfig.from_dict({"node_id": i, "artifact": str(tmp_path / "art"),
                                    "data_dir": str(tmp_path / i)})
        nodes[i] = EdgeNode(cfg, artifact=NumpyArtifact(), transport=hub.transport(
            i, drop=drop, duplicate=0.1, reorder=0.2, seed=k))
        nodes[i].start()
        nodes[i].add_samples({"x": rng.standard_normal((32, 64))}, rng.integers(0, 10, 32))
    try:
        assert not run_all(nodes, RoundCommand(round_id="lossy", steps=3, participants=list(nodes),
                                               step_timeout_s=20))
        assert len({n.params_sha256 for n in nodes.values()}) == 1
        assert {n.model_version for n in nodes.values()} == {1}
    finally:
        for n in nodes.values():
            n.stop()


def test_members_with_different_float_semantics_still_commit_the_same_bits(tmp_path):
    """Mixed boards: one member's optimizer rounds differently (as an FMA-fusing aarch64 build
    may); the commit check notices and everybody adopts the first member's parameters."""
    from tests.edgenode.fakes import NumpyTrainer

    class FusedTrainer(NumpyTrainer):
        def apply(self, params, grads, state, lr=None):
            new, state = super().apply(params, grads, state, lr)
            new[1] = np.nextafter(new[1], np.float32(np.inf))  # one ulp off: a different rounding
            return new, state

    odd = NumpyArtifact()
    odd.trainer = FusedTrainer()
    hub = MemoryHub()
    (tmp_path / "art").mkdir()
    nodes = {}
    rng = np.random.default_rng(2)
    for i in ["a", "b", "c"]:
        cfg = NodeConfig.from_dict({"node_id": i, "artifact": str(tmp_path / "art"),
                                    "data_dir": str(tmp_path / "mixed" / i)})
        nodes[i] = EdgeNode(cfg, artifact=odd if i == "c" else NumpyArtifact(), transport=hub.transport(i))
        nodes[i].start()
        nodes[i].add_samples({"x": rng.standard_normal((32, 64))}, rng.integers(0, 10, 32))
    try:
        assert not run_all(nodes, RoundCommand(round_id="mixed", steps=3, participants=list(nodes)))
        assert len({n.params_sha256 for n in nodes.values()}) == 1
        assert all(n.last_result.final_sync for n in nodes.values())
        # a round of identical members needs no final broadcast
        homo = swarm(tmp_path, ["x", "y"], "homo")
        for n in homo.values():
            n.add_samples({"x": rng.standard_normal((32, 64))}, rng.integers(0, 10, 32))
        assert not run_all(homo, RoundCommand(round_id="homo", steps=3, participants=list(homo)))
        assert not any(n.last_result.final_sync for n in homo.values())
        for n in homo.values():
            n.stop()
    finally:
        for n in nodes.values():
            n.stop()


def _record_final_params(monkeypatch) -> dict[str, str]:
    """node id -> params_sha256 of its own final parameters (before the final sync), per round."""
    from federation import phases

    seen: dict[str, str] = {}
    real_agree = phases.agree

    def recording(ctx, params, start):
        seen[ctx.node_id] = phases.vector_sha256(params)
        return real_agree(ctx, params, start)

    monkeypatch.setattr(phases, "agree", recording)
    return seen


def test_the_final_sync_follows_the_majority_and_checks_what_its_root_sends(tmp_path, monkeypatch):
    """A member first in ring order whose final parameters differ (a hostile one, or odd float
    semantics) cannot impose them: the hash a majority holds wins. A root whose broadcast does not
    match the hash it reported fails the round everywhere, nothing committed."""
    from tests.edgenode.fakes import NumpyTrainer

    class OddTrainer(NumpyTrainer):
        def apply(self, params, grads, state, lr=None):
            new, state = super().apply(params, grads, state, lr)
            new[1] = new[1] + np.float32(0.5)  # its own idea of the result
            return new, state

    before_sync = _record_final_params(monkeypatch)
    nodes = swarm(tmp_path, ["a", "b", "c"], "majority")
    nodes["a"].rounds.trainer = OddTrainer()  # "a" is first in ring order
    rng = np.random.default_rng(5)
    try:
        for n in nodes.values():
            n.add_samples({"x": rng.standard_normal((32, 64))}, rng.integers(0, 10, 32))
        assert not run_all(nodes, RoundCommand(round_id="maj", steps=2, participants=list(nodes)))
        assert before_sync["b"] == before_sync["c"] != before_sync["a"]
        assert {n.params_sha256 for n in nodes.values()} == {before_sync["b"]}
        assert all(n.last_result.final_sync for n in nodes.values())

        # b (the majority's first holder) now sends something else than what it reported
        ring = nodes["b"].rounds.collective
        real_broadcast = ring.broadcast
        monkeypatch.setattr(ring, "broadcast", lambda vec, **kw: real_broadcast(
            None if vec is None else np.asarray(vec) + np.float32(1.0), **kw))
        state = {i: (n.model_version, n.params_sha256) for i, n in nodes.items()}
        errors = run_all(nodes, RoundCommand(round_id="forged-final", steps=2, participants=list(nodes)))
        assert set(errors) == {"a", "b", "c"}, errors
        assert all("b sent final parameters that do not match" in str(errors[i]) for i in "ac"), errors
        assert {i: (n.model_version, n.params_sha256) for i, n in nodes.items()} == state
    finally:
        for n in nodes.values():
            n.stop()


def test_without_a_majority_the_first_member_imposes_nothing_beyond_rounding(tmp_path, monkeypatch):
    """All three final hashes differ (e.g. a hostile member sent different rows to different peers):
    the first member's parameters are adopted only if they are within rounding of everyone's own;
    a first member whose result is another model fails the round everywhere, nothing committed."""
    from tests.edgenode.fakes import NumpyTrainer

    def shifted(by):
        class Shifted(NumpyTrainer):
            def apply(self, params, grads, state, lr=None):
                new, state = super().apply(params, grads, state, lr)
                new[1] = by(new[1])
                return new, state
        return Shifted()

    before_sync = _record_final_params(monkeypatch)
    nodes = swarm(tmp_path, ["a", "b", "c"], "nomajority")
    rng = np.random.default_rng(7)
    try:
        for n in nodes.values():
            n.add_samples({"x": rng.standard_normal((32, 64))}, rng.integers(0, 10, 32))
        # one ulp up on "a", one down on "b": three hashes, no majority, rounding only -> a's
        nodes["a"].rounds.trainer = shifted(lambda v: np.nextafter(v, np.float32(np.inf)))
        nodes["b"].rounds.trainer = shifted(lambda v: np.nextafter(v, np.float32(-np.inf)))
        assert not run_all(nodes, RoundCommand(round_id="ulps", steps=2, participants=list(nodes)))
        assert len(set(before_sync.values())) == 3
        assert {n.params_sha256 for n in nodes.values()} == {before_sync["a"]}
        assert all(n.last_result.final_sync for n in nodes.values())

        # "a" (first in ring order) ends on another model: refused by b and c, nothing committed
        nodes["a"].rounds.trainer = shifted(lambda v: v + np.float32(0.5))
        state = {i: (n.model_version, n.params_sha256) for i, n in nodes.items()}
        errors = run_all(nodes, RoundCommand(round_id="imposed", steps=2, participants=list(nodes)))
        assert len(set(before_sync.values())) == 3
        assert set(errors) == {"a", "b", "c"}, errors
        assert all("a has final parameters" in str(errors[i]) and "no majority" in str(errors[i])
                   for i in "bc"), errors
        assert {i: (n.model_version, n.params_sha256) for i, n in nodes.items()} == state
    finally:
        for n in nodes.values():
            n.stop()


def test_sync_gap_limit_scales_with_the_update_and_the_parameters():
    from federation.bounds import SYNC_GAP_OF_PARAMS, SYNC_GAP_OF_UPDATE
    from federation.phases import sync_gap_limit

    start = np.zeros(4)
    mine = np.array([3.0, 4.0, 0.0, 0.0])  # update norm 5, params norm 5
    assert sync_gap_limit(mine, start) == pytest.approx(5 * SYNC_GAP_OF_UPDATE + 5 * SYNC_GAP_OF_PARAMS)
    assert sync_gap_limit(mine, mine) == pytest.approx(5 * SYNC_GAP_OF_PARAMS)  # no update: params only


def test_round_trains_on_the_newest_samples_within_its_memory_budget(tmp_path):
    """round_memory_mb bounds the in-memory copy: only the newest samples that fit are used."""
    hub = MemoryHub()
    (tmp_path / "art").mkdir()
    cfg = NodeConfig.from_dict({"node_id": "a", "artifact": str(tmp_path / "art"),
                                "data_dir": str(tmp_path / "a"),
                                "training": {"round_memory_mb": 100 * 264 / 2**20}})  # 100 samples
    node = EdgeNode(cfg, artifact=NumpyArtifact(), transport=hub.transport("a"))
    seen = []
    orig = node.store.snapshot
    node.store.snapshot = lambda limit=None, **kw: seen.append((kw.get("part"), limit)) or orig(limit, **kw)
    node.start()
    try:
        # distinct samples: identical ones share one side of the validation split
        node.add_samples({"x": np.random.default_rng(0).random((300, 64))}, np.zeros(300, np.int64))
        assert node.store.sample_bytes == 64 * 4 + 8
        node.run_round(RoundCommand(round_id="r", steps=1, participants=["a"]))
        assert ("train", 100) in seen  # (the validation share is read within the same budget)
    finally:
        node.stop()


@pytest.mark.parametrize("outlier_factor", [None, 0])  # int8/topk: a coded exchange, screened or not
@pytest.mark.parametrize("compression", ["fp16", "int8", "topk"])
@pytest.mark.parametrize("sync", ["gradient", "local-sgd"])
def test_compressed_rounds_agree_and_learn(tmp_path, compression, sync, outlier_factor):
    nodes = swarm(tmp_path, ["a", "b", "c"], f"{compression}-{sync}")
    rng = np.random.default_rng(5)
    w_true = rng.standard_normal((64, 10)).astype(np.float32)
    try:
        for n in nodes.values():
            x = rng.standard_normal((128, 64)).astype(np.float32)
            n.add_samples({"x": x}, (x @ w_true).argmax(1))
        cmd = RoundCommand.model_validate({"round_id": "c", "steps": 30, "lr": 0.5, "sync": sync,
                                           "local_steps": 2, "participants": list(nodes),
                                           "compression": compression, "outlier_factor": outlier_factor})
        assert not run_all(nodes, cmd)
        assert len({n.params_sha256 for n in nodes.values()}) == 1
        losses = nodes["a"].last_result.losses
        assert np.mean(losses[-5:]) < np.mean(losses[:5]) * 0.8, losses
    finally:
        for n in nodes.values():
            n.stop()


class _NanTrainer:
    """The stand-in trainer with every gradient NaN (a diverged member)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def loss_and_grad(self, params, x, y):
        loss, grads = self.inner.loss_and_grad(params, x, y)
        return loss, [np.full_like(np.asarray(g), np.nan) for g in grads]


@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_unscreened_compressed_round_fails_naming_a_diverged_member(tmp_path, compression):
    """int8 would turn a NaN update into zeros; the coded exchange carries it as non-finite, so
    every member fails the step naming the diverged one and nobody commits."""
    nodes = swarm(tmp_path, ["a", "b", "c"], f"nan-{compression}")
    rng = np.random.default_rng(1)
    try:
        for n in nodes.values():
            x = rng.standard_normal((64, 64)).astype(np.float32)
            n.add_samples({"x": x}, rng.integers(0, 10, 64))
        nodes["b"].rounds.trainer = _NanTrainer(nodes["b"].rounds.trainer)
        cmd = RoundCommand(round_id="nan", steps=3, lr=0.1, participants=list(nodes), compression=compression,
                           outlier_factor=0)
        errors = run_all(nodes, cmd)
        assert set(errors) == {"a", "b", "c"}, errors
        assert all("b" in str(e) and "not finite" in str(e) for e in errors.values()), errors
        assert all(n.model_version == 0 for n in nodes.values())
    finally:
        for n in nodes.values():
            n.stop()


def test_the_rounds_a_node_started_survive_a_restart_and_bad_files_are_ignored(tmp_path):
    import collections
    import json

    from edgenode.rounds import SEEN_ROUNDS_KEPT, load_seen_rounds, save_seen_rounds

    assert load_seen_rounds(tmp_path) == {}  # no file yet
    seen = collections.OrderedDict.fromkeys(f"r{k}" for k in range(SEEN_ROUNDS_KEPT + 5))
    save_seen_rounds(tmp_path, seen)
    back = load_seen_rounds(tmp_path)
    assert list(back) == list(seen)[-SEEN_ROUNDS_KEPT:]  # newest kept, in order
    for junk in (b"{not json", b'{"r1": 1}', json.dumps(["ok", 7, None, "fine"]).encode()):
        (tmp_path / "rounds-seen.json").write_bytes(junk)
        assert list(load_seen_rounds(tmp_path)) == (["ok", "fine"] if junk.startswith(b"[") else [])
    ro = tmp_path / "gone"  # a data directory that vanished: logged, not raised
    save_seen_rounds(ro, seen)
    assert not ro.exists()
