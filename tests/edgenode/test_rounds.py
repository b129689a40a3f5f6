"""Training rounds through EdgeNode with the in-memory transport: 3 nodes in one process, real
TVM training module (digits-mlp), real RingAllreduce."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from compiler import load_artifact
from federation.memory import MemoryHub
from federation.messages import EventKind, RoundAbort, RoundCommand, SyncMode

IDS = ["n0", "n1", "n2"]


@pytest.fixture(scope="module")
def shared_artifact(digits_artifact):
    return load_artifact(digits_artifact)


@pytest.fixture
def swarm(node_factory, digits_artifact, shared_artifact, digits_data):
    """Three started nodes on one MemoryHub, each with 300 samples; events collected per node."""
    hub = MemoryHub()
    x, y = digits_data
    nodes, events = {}, {i: [] for i in IDS}
    for k, i in enumerate(IDS):
        n = node_factory(i, digits_artifact, artifact=shared_artifact, transport=hub.transport(i),
                         training={"step_timeout_s": 3.0})
        n.add_samples({"x": x[k:900:3]}, y[k:900:3])
        n.add_event_listener(events[i].append)
        nodes[i] = n
    return hub, nodes, events


def run(nodes, cmd, timeout=120.0):
    for n in nodes.values():
        n.handle_command(cmd.model_dump_json())
    for n in nodes.values():
        assert n.wait_idle(timeout), f"{n.node_id} still busy"


def accuracy(node, x, y) -> float:
    return float((node.infer({"x": x})["logits"].argmax(1) == y).mean())


@pytest.mark.parametrize("sync", [SyncMode.GRADIENT, SyncMode.LOCAL_SGD])
def test_round_agrees_and_learns(swarm, digits_data, sync):
    hub, nodes, events = swarm
    x, y = digits_data
    xt, yt = x[900:], y[900:]
    before = accuracy(nodes["n0"], xt, yt)
    v0 = nodes["n0"].model_version
    cmd = RoundCommand(round_id=f"r-{sync.value}", steps=40 if sync == SyncMode.GRADIENT else 10,
                       lr=0.1, sync=sync, local_steps=4, participants=IDS, step_timeout_s=10)
    run(nodes, cmd)
    done = {i: [e for e in ev if e.kind == EventKind.DONE] for i, ev in events.items()}
    assert all(len(d) == 1 for d in done.values()), events
    shas = {n.params_sha256 for n in nodes.values()}
    assert len(shas) == 1 and {d[0].params_sha256 for d in done.values()} == shas
    assert {n.model_version for n in nodes.values()} == {v0 + 1}
    steps = [e for e in events["n0"] if e.kind == EventKind.STEP]
    assert steps[-1].loss < steps[0].loss * 0.8, [s.loss for s in steps]
    after = accuracy(nodes["n0"], xt, yt)
    assert after > before + 0.2, (before, after)
    # inference on every node uses the committed parameters
    for n in nodes.values():
        ref = nodes["n0"].infer({"x": xt[:5]})["logits"]
        np.testing.assert_array_equal(n.infer({"x": xt[:5]})["logits"], ref)
        assert n.info()["params_sha256"] == n.params_sha256 and n.info()["state"] == "online"
        assert n.metrics.rounds_ok == 1


def test_diverged_params_a_high_version_cannot_impose_itself(swarm):
    hub, nodes, events = swarm
    rng = np.random.default_rng(3)
    odd = nodes["n2"]
    majority = [np.array(p) for p in nodes["n0"].model.snapshot.params]
    new = [rng.standard_normal(p.shape).astype(np.float32) * 0.1 for p in odd.model.snapshot.params]
    odd.model.commit(new, 1_000_000)  # a rogue (or stale) member claiming a huge version
    run(nodes, RoundCommand(round_id="sync", steps=1, lr=1e-6, participants=IDS, step_timeout_s=10))
    assert {n.model_version for n in nodes.values()} == {1}  # the majority's version + 1
    assert len({n.params_sha256 for n in nodes.values()}) == 1
    for a, b in zip(nodes["n2"].model.snapshot.params, majority, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-3)  # n2 was brought back to the majority's
    assert nodes["n0"].last_result.synced_from == "n0"
    # The fleet may name other start parameters (signed start_sha256): then everyone takes them.
    odd.model.commit(new, 7)
    sha = odd.params_sha256
    run(nodes, RoundCommand(round_id="sync2", steps=1, lr=1e-6, participants=IDS, step_timeout_s=10,
                            start_sha256=sha))
    assert {n.model_version for n in nodes.values()} == {8}
    for a, b in zip(nodes["n0"].model.snapshot.params, new, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-3)


def test_dead_member_rolls_back_everywhere(swarm):
    hub, nodes, events = swarm
    before = {i: (n.params_sha256, n.model_version) for i, n in nodes.items()}

    def kill_at_step_3(ev):
        if ev.kind == EventKind.STEP and ev.step >= 3:
            hub.kill("n1")

    nodes["n1"].add_event_listener(kill_at_step_3)
    import edgenode.rounds as node_mod

    old = node_mod._STEP_EVENT_MIN_S
    node_mod._STEP_EVENT_MIN_S = 0.0  # every step emits an event, so the kill lands mid-round
    try:
        t0 = time.monotonic()
        run(nodes, RoundCommand(round_id="doomed", steps=500, lr=0.1, participants=IDS, step_timeout_s=2))
    finally:
        node_mod._STEP_EVENT_MIN_S = old
    assert time.monotonic() - t0 < 30
    for i, n in nodes.items():
        failed = [e for e in events[i] if e.kind == EventKind.FAILED]
        assert failed and failed[0].round_id == "doomed", events[i][-3:]
        assert not [e for e in events[i] if e.kind == EventKind.DONE]
        assert (n.params_sha256, n.model_version) == before[i]  # nothing half-applied
        assert n.metrics.rounds_failed == 1 and n.info()["state"] == "online"
    steps_seen = max(e.step for e in events["n0"] if e.kind == EventKind.STEP)
    assert 3 <= steps_seen < 499


def test_busy_abort_and_malformed_commands(swarm, caplog):
    hub, nodes, events = swarm
    before = {i: n.params_sha256 for i, n in nodes.items()}
    long = RoundCommand(round_id="long", steps=100_000, lr=0.01, participants=IDS, step_timeout_s=20)
    # What each node says of its round at the moment it tells the fleet the round FAILED: the fleet
    # may start the next round on that event, so the node must already be out of this one.
    in_round_at_failed: dict[str, object] = {}
    for i, n in nodes.items():
        n.add_event_listener(lambda e, i=i, n=n: in_round_at_failed.setdefault(i, n.info()["round_id"])
                             if e.kind == EventKind.FAILED and e.round_id == "long" else None)
    for n in nodes.values():
        n.handle_command(long)
    deadline = time.monotonic() + 30
    while not all(n.info()["round_id"] == "long" and n.state.value == "training" for n in nodes.values()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # a second command while busy: FAILED event with a reason, counted, the running round unharmed
    nodes["n0"].handle_command(RoundCommand(round_id="second", steps=1, participants=IDS))
    ev = [e for e in events["n0"] if e.round_id == "second"]
    assert ev and ev[0].kind == EventKind.FAILED and "busy" in ev[0].reason
    # ... and in the node's own log: a refusal the node log did not show was only in the fleet's
    assert any(r.getMessage().startswith("round second refused:") and "busy" in r.getMessage()
               for r in caplog.records), caplog.text
    # malformed commands are rejected and counted, nothing stalls
    future = RoundCommand(round_id="x", steps=1, participants=IDS).model_dump_json().replace('"v":1', '"v":9')
    for bad in (b"{not json", b'{"kind": "round.start", "v": 1}', b'{"kind": "reboot", "v": 1}', future):
        nodes["n0"].handle_command(bad)
    assert nodes["n0"].metrics.commands_rejected == 5
    # the abort reaches only n0 (as if the others missed it): n0 tells its peers through the ring,
    # so everybody stops long before the 20 s step deadline
    t0 = time.monotonic()
    nodes["n0"].handle_command(RoundAbort(round_id="long", reason="operator").model_dump_json())
    for n in nodes.values():
        assert n.wait_idle(20)
    assert time.monotonic() - t0 < 5
    for i, n in nodes.items():
        assert any(e.kind == EventKind.FAILED and e.round_id == "long" for e in events[i])
        assert n.params_sha256 == before[i]
    assert in_round_at_failed == dict.fromkeys(IDS, None)  # a command right after FAILED is not "busy"


def test_infer_during_round_sees_committed_params_only(swarm, digits_data):
    hub, nodes, events = swarm
    x, _ = digits_data
    n0 = nodes["n0"]
    ref_before = n0.infer({"x": x[:4]})["logits"]
    outs, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            outs.append((n0.model_version, n0.infer({"x": x[:4]})["logits"]))

    t = threading.Thread(target=reader)
    t.start()
    run(nodes, RoundCommand(round_id="r1", steps=30, lr=0.1, participants=IDS, step_timeout_s=10))
    stop.set()
    t.join()
    ref_after = n0.infer({"x": x[:4]})["logits"]
    assert not np.array_equal(ref_before, ref_after)
    for _, o in outs:  # every answer is exactly the old or exactly the new model
        assert np.array_equal(o, ref_before) or np.array_equal(o, ref_after)


@pytest.mark.parametrize("bad", [10**9, -(10**12), 10])
def test_stored_labels_out_of_range_fail_the_round_cleanly(swarm, bad):
    """Issue 26 finding 3: labels the HTTP API would refuse, written into a node's store by hand
    (or kept from a model with more classes), must not reach the compiled loss (a segfault at
    1e9, a wrong loss at 10). The node refuses the round with a reason naming the labels, tells
    its peers at once, and keeps serving; nothing is committed anywhere."""
    import sqlite3

    hub, nodes, events = swarm
    odd = nodes["n1"]
    before = {i: (n.params_sha256, n.model_version) for i, n in nodes.items()}
    with sqlite3.connect(odd.store.path) as db:
        db.execute("UPDATE samples SET label = ?", (np.int64(bad).tobytes(),))
    t0 = time.monotonic()
    run(nodes, RoundCommand(round_id="bad-labels", steps=5, lr=0.1, participants=IDS, step_timeout_s=20))
    assert time.monotonic() - t0 < 15  # the peers heard the refusal; they did not wait out the step
    failed = [e for e in events["n1"] if e.kind == EventKind.FAILED]
    assert len(failed) == 1 and "bad labels" in failed[0].reason, events["n1"]
    assert "class ids in [0, 10)" in failed[0].reason and str(bad) in failed[0].reason
    for i, n in nodes.items():
        assert [e for e in events[i] if e.kind == EventKind.FAILED], events[i][-3:]
        assert not [e for e in events[i] if e.kind == EventKind.DONE]
        assert (n.params_sha256, n.model_version) == before[i]
        assert n.info()["state"] == "online"
    assert odd.infer({"x": np.zeros((1, 64), np.float32)})["logits"].shape == (1, 10)


def test_stored_non_finite_inputs_fail_the_round_cleanly(swarm):
    """Inference takes NaN; training never does. A NaN sample written into a node's store by hand
    (the HTTP API refuses it) fails the round at its start, naming it; the peers hear it at once and
    nothing is committed anywhere."""
    import sqlite3

    hub, nodes, events = swarm
    odd = nodes["n1"]
    before = {i: (n.params_sha256, n.model_version) for i, n in nodes.items()}
    with sqlite3.connect(odd.store.path) as db:
        db.execute("UPDATE samples SET data = ?", (np.full(64, np.nan, np.float32).tobytes(),))
    t0 = time.monotonic()
    run(nodes, RoundCommand(round_id="nan-inputs", steps=5, lr=0.1, participants=IDS, step_timeout_s=20))
    assert time.monotonic() - t0 < 15
    failed = [e for e in events["n1"] if e.kind == EventKind.FAILED]
    assert len(failed) == 1 and "inputs contain NaN or Inf" in failed[0].reason, events["n1"]
    for i, n in nodes.items():
        assert not [e for e in events[i] if e.kind == EventKind.DONE]
        assert (n.params_sha256, n.model_version) == before[i]
