"""``[training] isolation = "process"`` (the default): a worker process runs the rounds' steps and
hosts the node's ring (edgenode/trainworker.py). Real TVM digits-mlp, real RingAllreduce whose
frames the nodes relay over the in-memory hub.

* a 3-node round in process mode commits the same parameters on every node, bit-identical to
  the same round computed in-thread;
* a worker killed with SIGKILL mid-round fails the round with a reason naming the kill, the node
  keeps serving, and the next round (on a fresh worker) commits;
* inference answers while the worker is mid-step (frozen with SIGSTOP: the round thread waits on
  it), so serving does not depend on the training process.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np

from edgenode.trainworker import TrainingWorker
from federation.memory import MemoryHub
from federation.messages import EventKind, RoundCommand

IDS = ["p0", "p1", "p2"]


def _swarm(node_factory, digits_artifact, digits_data, isolation):
    hub = MemoryHub()
    x, y = digits_data
    nodes, events = {}, {}
    for k, i in enumerate(IDS):
        n = node_factory(i, digits_artifact, transport=hub.transport(i), data_dir=f"{isolation}-{i}",
                         training={"isolation": isolation, "step_timeout_s": 20.0})
        n.add_samples({"x": x[k:600:3]}, y[k:600:3])
        events[i] = []
        n.add_event_listener(events[i].append)
        nodes[i] = n
    return nodes, events


def _run(nodes, cmd):
    for n in nodes.values():
        n.handle_command(cmd.model_dump_json())
    for n in nodes.values():
        assert n.wait_idle(120), f"{n.node_id} still busy"


def test_process_round_commits_identical_params_bit_equal_to_thread_mode(node_factory, digits_artifact,
                                                                         digits_data):
    shas = {}
    for mode in ("process", "thread"):  # same ids, samples and round id: same batches drawn
        nodes, events = _swarm(node_factory, digits_artifact, digits_data, mode)
        for n in nodes.values():
            assert isinstance(n.training_worker, TrainingWorker) == (mode == "process")
        cmd = RoundCommand(round_id="r-iso", steps=12, lr=0.1, participants=IDS, step_timeout_s=20)
        _run(nodes, cmd)
        done = [e for ev in events.values() for e in ev if e.kind == EventKind.DONE]
        assert len(done) == 3, {i: [(e.kind, e.reason) for e in ev] for i, ev in events.items()}
        got = {n.params_sha256 for n in nodes.values()}
        assert len(got) == 1 and {n.model_version for n in nodes.values()} == {1}
        assert {e.params_sha256 for e in done} == got
        if mode == "process":
            pids = {n.training_worker.pid for n in nodes.values()}
            assert None not in pids and os.getpid() not in pids and len(pids) == 3
        shas[mode] = got.pop()
        for n in nodes.values():
            n.stop()
    assert shas["process"] == shas["thread"]


def test_process_and_thread_compute_the_same_bits(node_factory, digits_artifact, digits_data):
    """One node, one round, same id, same samples: the worker's step is the in-thread step."""
    x, y = digits_data
    got = {}
    for mode in ("process", "thread"):
        n = node_factory("same", digits_artifact, transport=MemoryHub().transport("same"),
                         data_dir=f"{mode}-data", training={"isolation": mode})
        n.add_samples({"x": x[:200]}, y[:200])
        n.start_round(RoundCommand(round_id="r-same", steps=15, lr=0.1, participants=["same"])).join(120)
        assert n.model_version == 1, n.last_error
        got[mode] = n.params_sha256
        n.stop()
    assert got["process"] == got["thread"]


def _watch(node):
    """(events, set at the first STEP, set at DONE/FAILED) for ``node``'s round events."""
    stepping, finished = threading.Event(), threading.Event()
    events = []

    def listen(ev):
        events.append(ev)
        if ev.kind == EventKind.STEP:
            stepping.set()
        if ev.kind in (EventKind.DONE, EventKind.FAILED):
            finished.set()

    node.add_event_listener(listen)
    return events, stepping, finished


def test_sigkill_of_the_worker_fails_the_round_and_the_next_round_commits(node_factory, digits_artifact,
                                                                         digits_data):
    x, y = digits_data
    node = node_factory("k", digits_artifact, transport=MemoryHub().transport("k"))
    node.add_samples({"x": x[:300]}, y[:300])
    worker = node.training_worker
    assert isinstance(worker, TrainingWorker)
    events, stepping, finished = _watch(node)
    sha0 = node.params_sha256
    node.start_round(RoundCommand(round_id="r-kill", steps=100_000, lr=0.1, participants=["k"]))
    assert stepping.wait(120), "no STEP event"
    pid = worker.pid
    assert pid is not None and pid != os.getpid()
    os.kill(pid, signal.SIGKILL)
    assert finished.wait(60) and node.wait_idle(60)
    failed = [e for e in events if e.kind == EventKind.FAILED]
    assert len(failed) == 1, events[-3:]
    assert "training worker" in failed[0].reason and "SIGKILL" in failed[0].reason, failed[0].reason
    # nothing applied, still serving, the state is back to online
    assert node.params_sha256 == sha0 and node.model_version == 0
    assert node.infer({"x": x[:3]})["logits"].shape == (3, 10)
    assert node.state.value == "online"
    # the next round runs on a fresh worker and commits
    finished.clear()
    events.clear()
    node.start_round(RoundCommand(round_id="r-after", steps=5, lr=0.1, participants=["k"]))
    assert finished.wait(120) and node.wait_idle(60)
    assert [e.kind for e in events if e.kind != EventKind.STEP] == [EventKind.DONE], events
    assert node.model_version == 1 and worker.restarts == 1
    assert worker.pid not in (None, pid)


def test_inference_answers_while_the_worker_is_mid_step(node_factory, digits_artifact, digits_data):
    import httpx

    from api.node_app import create_node_app
    from api.serving import ServerThread

    x, y = digits_data
    node = node_factory("busy", digits_artifact, transport=MemoryHub().transport("busy"))
    node.add_samples({"x": x[:300]}, y[:300])
    worker = node.training_worker
    assert isinstance(worker, TrainingWorker)
    frozen = threading.Event()
    events = []

    def listen(ev):  # on the round thread: freeze the worker once, between two steps
        events.append(ev)
        if ev.kind == EventKind.STEP and not frozen.is_set():
            os.kill(worker.pid, signal.SIGSTOP)
            frozen.set()

    node.add_event_listener(listen)
    node.start_round(RoundCommand(round_id="r-busy", steps=50, lr=0.1, participants=["busy"]))
    assert frozen.wait(120), "no STEP event"
    try:
        body = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": x[0].tolist()}]}
        with ServerThread(create_node_app(node)) as srv, httpx.Client() as client:
            # The round thread is now blocked on the frozen worker's answer: the round is running.
            assert node.state.value == "training" and node.round_id == "r-busy"
            for _ in range(20):
                r = client.post(f"http://127.0.0.1:{srv.port}/v2/models/{node.model_name}/infer",
                                json=body, timeout=10)
                assert r.status_code == 200, r.text
            want = node.infer({"x": x[:1]})["logits"][0]
            np.testing.assert_allclose(r.json()["outputs"][0]["data"], want, rtol=1e-6)
            assert node.state.value == "training"  # still blocked on the worker: it did the waiting
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert node.wait_idle(120)
    assert [e.kind for e in events if e.kind != EventKind.STEP] == [EventKind.DONE], events[-2:]
    assert node.model_version == 1


def test_abort_stops_a_process_round_within_a_step(node_factory, digits_artifact, digits_data):
    from federation.messages import RoundAbort

    x, y = digits_data
    node = node_factory("ab", digits_artifact, transport=MemoryHub().transport("ab"))
    node.add_samples({"x": x[:300]}, y[:300])
    events, stepping, finished = _watch(node)
    node.start_round(RoundCommand(round_id="r-ab", steps=100_000, lr=0.1, participants=["ab"]))
    assert stepping.wait(120), "no STEP event"
    node.handle_command(RoundAbort(round_id="r-ab", reason="operator").model_dump_json())
    assert finished.wait(30) and node.wait_idle(30)
    failed = [e for e in events if e.kind == EventKind.FAILED]
    assert len(failed) == 1 and "aborted" in failed[0].reason, failed
    steps = [s for e in events if e.kind == EventKind.STEP for s in (e.losses or [])]
    assert len(steps) < 100_000 and node.model_version == 0
    assert node.training_worker.pid is not None  # the same worker serves the next round


def test_a_worker_whose_node_is_gone_exits_at_once_even_mid_collective(node_factory, digits_artifact,
                                                                      digits_data):
    """The node dies (its end of the socket pair closes: SIGKILL, OOM) while its worker waits in a
    collective for a silent peer: the worker exits at once instead of lingering as an orphan until
    the collective's deadline."""
    import socket
    import subprocess

    x, y = digits_data
    hub = MemoryHub()
    ghost = hub.transport("ghost")  # a member that never answers
    node = node_factory("orph", digits_artifact, transport=hub.transport("orph"))
    node.add_samples({"x": x[:300]}, y[:300])
    w = node.training_worker
    w.wait_ready()
    proc = w._proc
    node.start_round(RoundCommand(round_id="r-orph", steps=5, lr=0.1, participants=["ghost", "orph"],
                                  step_timeout_s=120))
    assert ghost.recv(60) is not None  # the worker is inside the round's first collective
    assert proc.poll() is None
    w._sock.shutdown(socket.SHUT_RDWR)  # what the worker sees when its node dies
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        raise AssertionError("the worker outlived its node (waiting for the collective's deadline)") from None
    assert node.wait_idle(30)  # the round failed on the node's side (its worker is gone)
    assert node.model_version == 0


def test_worker_process_runs_at_the_configured_priority(node_factory, digits_artifact):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    idle = node_factory("pi", digits_artifact, transport=MemoryHub().transport("pi"))  # the default
    nice = node_factory("pn", digits_artifact, transport=MemoryHub().transport("pn"),
                        training={"worker_priority": "nice", "nice": 5})
    for node, want_nice, policy in ((idle, 10, os.SCHED_IDLE), (nice, 5, os.SCHED_OTHER)):
        w = node.training_worker
        w.wait_ready()  # the worker set its priority before it loaded the module
        assert os.getpriority(os.PRIO_PROCESS, w.pid) == max(base, want_nice)
        assert os.sched_getscheduler(w.pid) == policy
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the node process itself is untouched


def test_a_python_that_cannot_start_a_worker_trains_in_thread(node_factory, digits_artifact, digits_data,
                                                             tmp_path, monkeypatch):
    """As an emulated aarch64 node under qemu-user (exec of its own Python: ENOEXEC)."""
    import sys

    not_exec = tmp_path / "python3.11"
    not_exec.write_bytes(b"\x7fELF not for this machine")
    not_exec.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(not_exec))
    x, y = digits_data
    node = node_factory("fb", digits_artifact, transport=MemoryHub().transport("fb"))
    assert node.training_worker is None
    node.add_samples({"x": x[:100]}, y[:100])
    node.start_round(RoundCommand(round_id="r-fb", steps=3, lr=0.1, participants=["fb"])).join(60)
    assert node.model_version == 1, node.last_error
