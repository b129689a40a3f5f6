"""Validation share, kept parameter versions and rollback through EdgeNode: two nodes on one
MemoryHub, the real TVM training module (digits-mlp), real RingAllreduce."""

from __future__ import annotations

import threading

import pytest

from compiler import load_artifact
from federation.memory import MemoryHub
from federation.messages import EventKind, RollbackCommand, RoundCommand

IDS = ["v0", "v1"]
TRAINING = {"step_timeout_s": 5.0, "validation_share": 0.25, "keep_versions": 2}


@pytest.fixture(scope="module")
def shared_artifact(digits_artifact):
    return load_artifact(digits_artifact)


@pytest.fixture
def pair(node_factory, digits_artifact, shared_artifact, digits_data):
    hub = MemoryHub()
    x, y = digits_data
    nodes, events = {}, {i: [] for i in IDS}
    for k, i in enumerate(IDS):
        n = node_factory(i, digits_artifact, artifact=shared_artifact, transport=hub.transport(i),
                         training=TRAINING)
        n.add_samples({"x": x[k:1200:2]}, y[k:1200:2])
        n.add_event_listener(events[i].append)
        nodes[i] = n
    return hub, nodes, events


def _round(nodes, rid, steps=30, lr=0.1):
    cmd = RoundCommand(round_id=rid, steps=steps, lr=lr, participants=IDS, step_timeout_s=10)
    for n in nodes.values():
        n.handle_command(cmd.model_dump_json())
    for n in nodes.values():
        assert n.wait_idle(120), f"{n.node_id} still busy"


def _rollback(nodes, to_version):
    cmd = RollbackCommand(rollback_id=f"b{to_version}", nodes=IDS, to_version=to_version)
    for n in nodes.values():
        n.handle_command(cmd.model_dump_json())


def test_validation_share_is_stable_and_reported(pair, node_factory, digits_artifact, shared_artifact):
    hub, nodes, events = pair
    n0 = nodes["v0"]
    st = n0.status()
    assert st.samples_train + st.samples_val == st.samples == 600
    assert 0.18 * 600 < st.samples_val < 0.32 * 600, st.samples_val
    assert st.artifact.model == "digits-mlp" and st.artifact.tvm_version and st.health.disk_free_bytes > 0
    assert st.versions == [0]

    _round(nodes, "val-1")
    done = [e for e in events["v0"] if e.kind is EventKind.DONE]
    assert len(done) == 1
    before, after = done[0].val_before, done[0].val_after
    assert before.samples == after.samples == st.samples_val
    assert (before.model_version, after.model_version) == (0, 1)
    assert after.accuracy > before.accuracy + 0.1 and after.loss < before.loss
    # The reported accuracy is the model's on exactly the validation rows of the store.
    val = n0.store.snapshot(part="val", share=TRAINING["validation_share"])
    assert len(val) == st.samples_val
    acc = float((n0.infer(val.inputs)["logits"].argmax(1) == val.labels).mean())
    assert after.accuracy == pytest.approx(acc)
    st = n0.status()
    assert st.validation == after and st.versions == [0, 1]
    # Every step's loss reached the fleet, batched between the throttled events.
    steps = [e for e in events["v0"] if e.kind is EventKind.STEP]
    covered = sorted(e.step - i for e in steps for i in range(len(e.losses or [e.loss])))
    assert covered == list(range(30))

    # A restart on the same data dir splits the samples the same way.
    n0.stop()
    again = node_factory("v0", digits_artifact, artifact=shared_artifact, data_dir=n0.config.data_dir,
                         training=TRAINING)
    s2 = again.status()
    assert (s2.samples_train, s2.samples_val, s2.model_version, s2.versions) == \
        (st.samples_train, st.samples_val, 1, [0, 1])


def test_rollback_right_after_done_waits_for_the_round_to_finish(pair):
    """The fleet sends an automatic rollback the moment every DONE arrived; a node still
    finishing its round (status, bookkeeping) must not refuse it."""
    hub, nodes, events = pair
    threads = []

    def on_event(ev):
        if ev.kind is EventKind.DONE:  # like an MQTT command arriving on another thread now
            cmd = RollbackCommand(rollback_id="quick", nodes=[ev.node_id], to_version=0)
            t = threading.Thread(target=nodes[ev.node_id].handle_command, args=(cmd.model_dump_json(),))
            t.start()
            threads.append(t)

    for n in nodes.values():
        n.add_event_listener(on_event)
    _round(nodes, "quick-1", steps=5)
    for t in threads:
        t.join(30)
    assert len(threads) == 2 and {n.model_version for n in nodes.values()} == {0}


def test_rollback_together_and_bounded_versions(pair):
    hub, nodes, events = pair
    shipped = nodes["v0"].params_sha256
    hashes = {}
    for k in (1, 2, 3):
        _round(nodes, f"rb-{k}", steps=5)
        assert {n.model_version for n in nodes.values()} == {k}
        hashes[k] = nodes["v0"].params_sha256
    assert nodes["v0"].status().versions == [0, 2, 3]  # keep_versions = 2, plus the shipped v0
    _rollback(nodes, 2)
    assert {(n.model_version, n.params_sha256) for n in nodes.values()} == {(2, hashes[2])}
    assert nodes["v1"].status().versions == [0, 2]
    # Version 1 is no longer kept: the node refuses and stays where it is.
    _rollback(nodes, 1)
    assert {n.model_version for n in nodes.values()} == {2}
    _rollback(nodes, 0)
    assert {(n.model_version, n.params_sha256) for n in nodes.values()} == {(0, shipped)}
    # The next round continues from the rolled-back parameters as version 1.
    _round(nodes, "rb-after", steps=5)
    assert {n.model_version for n in nodes.values()} == {1}
    st = nodes["v0"].status()
    assert st.validation.model_version == 1 and st.versions == [0, 1]
