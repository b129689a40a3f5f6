"""Commit is all-or-nothing (issue 12): a member that cannot stage the new parameters (write
failure) or whose result is non-finite votes no, and no member commits; a leftover staged file of
an interrupted commit is discarded at restart. Three real nodes, in-memory ring, TVM training."""

from __future__ import annotations

import numpy as np
import pytest

from compiler import load_artifact
from federation.memory import MemoryHub
from federation.messages import EventKind, RoundAbort, RoundCommand, SyncMode

IDS = ["n0", "n1", "n2"]


@pytest.fixture
def swarm(node_factory, digits_artifact, digits_data):
    art = load_artifact(digits_artifact)
    hub = MemoryHub()
    x, y = digits_data
    nodes, events = {}, {i: [] for i in IDS}
    for k, i in enumerate(IDS):
        n = node_factory(i, digits_artifact, artifact=art, transport=hub.transport(i),
                         training={"step_timeout_s": 3.0})
        n.add_samples({"x": x[k:600:3]}, y[k:600:3])
        n.add_event_listener(events[i].append)
        nodes[i] = n
    return nodes, events


def _run(nodes, cmd):
    for n in nodes.values():
        n.handle_command(cmd.model_dump_json())
    for n in nodes.values():
        assert n.wait_idle(60)


def _state(nodes):
    return {i: (n.params_sha256, n.model_version) for i, n in nodes.items()}


def test_a_write_failure_on_one_member_commits_nowhere(swarm, monkeypatch):
    nodes, events = swarm
    before = _state(nodes)
    bad = nodes["n1"].model

    def disk_full(params, version):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bad, "prepare", disk_full)
    _run(nodes, RoundCommand(round_id="r-disk", steps=5, lr=0.1, participants=IDS, step_timeout_s=10))
    assert _state(nodes) == before  # nothing half-applied: n0 and n2 did not commit either
    for i in IDS:
        failed = [e for e in events[i] if e.kind == EventKind.FAILED]
        assert failed and "n1 voted no" in failed[0].reason, events[i][-2:]
        assert not nodes[i].model.prepared_path.exists()
    assert "No space left" in [e for e in events["n1"] if e.kind == EventKind.FAILED][0].reason
    # the swarm recovers: the next round commits everywhere
    monkeypatch.undo()
    _run(nodes, RoundCommand(round_id="r-ok", steps=5, lr=0.1, participants=IDS, step_timeout_s=10))
    assert {n.model_version for n in nodes.values()} == {1}
    assert len({n.params_sha256 for n in nodes.values()}) == 1


def test_non_finite_result_votes_no(swarm, monkeypatch):
    nodes, events = swarm
    before = _state(nodes)
    from federation import phases

    real_agree = phases.agree

    def poisoned(ctx, params, start):
        params, synced = real_agree(ctx, params, start)
        if ctx.node_id == "n2":
            params = params.copy()
            params[0] = np.nan
        return params, synced

    monkeypatch.setattr(phases, "agree", poisoned)
    _run(nodes, RoundCommand(round_id="r-nan", steps=3, lr=0.1, participants=IDS, step_timeout_s=10))
    assert _state(nodes) == before
    reason = [e for e in events["n2"] if e.kind == EventKind.FAILED][0].reason
    assert "non-finite" in reason and "n2 voted no" in reason
    # every member's FAILED event names n2 as the cause (the fleet counts such names)
    assert {i: [e.member for e in events[i] if e.kind == EventKind.FAILED] for i in IDS} == \
        {i: ["n2"] for i in IDS}


def test_everyone_voting_no_names_no_member(swarm, monkeypatch):
    """A result every member refuses (e.g. the combined update diverged) blames nobody: naming the
    first member in ring order would get an honest node left out by the fleet."""
    nodes, events = swarm
    from federation import phases

    real_agree = phases.agree

    def poisoned(ctx, params, start):
        params, synced = real_agree(ctx, params, start)
        params = params.copy()
        params[0] = np.nan
        return params, synced

    monkeypatch.setattr(phases, "agree", poisoned)
    _run(nodes, RoundCommand(round_id="r-all-no", steps=2, lr=0.1, participants=IDS, step_timeout_s=10))
    failed = {i: [e for e in events[i] if e.kind == EventKind.FAILED and e.round_id == "r-all-no"]
              for i in IDS}
    assert all(len(f) == 1 and "voted no" in f[0].reason and f[0].member is None
               for f in failed.values()), failed


def test_leftover_staged_params_are_discarded_at_restart(tmp_path, digits_artifact):
    from edgenode.model import ModelHolder

    art = load_artifact(digits_artifact)
    holder = ModelHolder(art, tmp_path)
    staged = holder.prepare([np.array(p) * 2 for p in art.params], 1)
    assert holder.prepared_path.exists() and holder.version == 0 and staged.version == 1
    again = ModelHolder(art, tmp_path)  # the node died between prepare and commit
    assert again.version == 0 and not again.prepared_path.exists()


def test_abort_frees_a_node_mid_local_steps_within_one_step(swarm):
    nodes, events = swarm
    import time

    # The most work a command may ask for (1000 x 1000 local steps): minutes without an abort.
    cmd = RoundCommand(round_id="r-long", steps=1000, lr=0.01, sync=SyncMode.LOCAL_SGD, local_steps=1000,
                       participants=IDS, step_timeout_s=300)
    for n in nodes.values():
        n.handle_command(cmd.model_dump_json())
    deadline = time.monotonic() + 30
    while any(n.status().state != "training" for n in nodes.values()):  # every node, not only n0
        assert time.monotonic() < deadline, "the round never started everywhere"
        time.sleep(0.01)
    time.sleep(0.3)  # inside the first step's 1000 local updates
    t0 = time.monotonic()
    for n in nodes.values():
        n.handle_command(RoundAbort(round_id="r-long", reason="operator").model_dump_json())
    for n in nodes.values():
        assert n.wait_idle(10), "abort did not free the node"
    assert time.monotonic() - t0 < 5
    for i in IDS:
        assert [e for e in events[i] if e.kind == EventKind.FAILED], events[i][-2:]


def test_abort_frees_nodes_waiting_for_a_ghost_participant(swarm):
    """A command naming a participant that never comes (and the longest step timeout allowed)
    used to keep the nodes "training" until the deadline; the fleet's abort now frees them."""
    import time

    nodes, events = swarm
    cmd = RoundCommand(round_id="r-ghost", steps=5, lr=0.1, participants=[*IDS, "ghost"], step_timeout_s=300)
    for n in nodes.values():
        n.handle_command(cmd.model_dump_json())
    while any(n.status().state != "training" for n in nodes.values()):
        time.sleep(0.01)
    time.sleep(0.5)  # everyone is blocked in the hello, waiting for the ghost
    assert all(not n.wait_idle(0) for n in nodes.values())
    t0 = time.monotonic()
    for n in nodes.values():
        n.handle_command(RoundAbort(round_id="r-ghost", reason="operator").model_dump_json())
    for n in nodes.values():
        assert n.wait_idle(10), "abort did not free the node"
    assert time.monotonic() - t0 < 5
    for i in IDS:
        failed = [e for e in events[i] if e.kind == EventKind.FAILED]
        assert failed and failed[0].round_id == "r-ghost", events[i][-2:]
        assert nodes[i].status().state == "online" and nodes[i].model_version == 0
