"""The ring over a REAL broker: what only a broker shows (queues, restarts, Last Wills, rogues).

Members run as threads with one MqttLink each, except the member that is SIGKILLed, which is
a separate OS process (``tests/federation/mqtt_member.py``). Results are checked against numpy
and for bit-identity across members.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from federation import framing, topics
from federation.broker import start_embedded, start_mosquitto
from federation.errors import RoundAborted
from federation.membership import Membership, StatusPublisher, status_will
from federation.messages import NodeState, NodeStatus
from federation.ring import RingAllreduce

pytestmark = pytest.mark.mosquitto

ROOT = Path(__file__).resolve().parents[2]


def _vectors(ids, size, seed=0):
    rng = np.random.default_rng(seed)
    return {m: rng.standard_normal(size).astype(np.float32) for m in ids}


def _members(make, broker, ids, *, max_payload=64 * 1024, status=False):
    """One link + ring per member (and optionally a StatusPublisher with the offline Last Will)."""
    rings, pubs = {}, {}
    for m in ids:
        st = NodeStatus(node_id=m, state=NodeState.ONLINE, heartbeat_s=1.0)
        link = make(broker, m, will=status_will(make.swarm, st) if status else None)
        rings[m] = RingAllreduce(link.transport(m, max_payload=max_payload), swarm=link.swarm)
        if status:
            pubs[m] = StatusPublisher(link, st)
    return rings, pubs


def _run(rings, fn):
    """Run ``fn(member, ring)`` in one thread per member; -> {member: result or exception}."""
    out: dict[str, object] = {}

    def go(m):
        try:
            out[m] = fn(m, rings[m])
        except Exception as exc:  # collected and asserted by the test
            out[m] = exc

    threads = [threading.Thread(target=go, args=(m,)) for m in rings]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _assert_allreduce(res, vecs, op="sum", tol=1e-4):
    ref = np.sum([vecs[m].astype(np.float64) for m in sorted(vecs)], axis=0)
    if op == "mean":
        ref /= len(vecs)
    first = res[sorted(res)[0]]
    for m, r in res.items():
        assert isinstance(r, np.ndarray), f"{m}: {r!r}"
        assert np.abs(r - ref).max() <= tol * max(1.0, np.abs(ref).max())
        assert r.tobytes() == first.tobytes(), f"{m} differs from {sorted(res)[0]}"


@pytest.fixture
def make(mqtt_link_factory, swarm_id):
    mqtt_link_factory.swarm = swarm_id
    yield mqtt_link_factory
    # rings are closed with their links (the transport closes; the pump threads are daemons)


def test_allreduce_n4_over_mosquitto_matches_numpy(mosquitto, make):
    ids = ["a", "b", "c", "d"]
    rings, _ = _members(make, mosquitto, ids)
    for i, (size, op) in enumerate([(10_007, "sum"), (3, "mean"), (100_000, "mean")]):
        vecs = _vectors(ids, size, seed=i)
        res = _run(rings, lambda m, r, v=vecs, t=f"r{i}", o=op: r.allreduce(v[m], group=ids, tag=t, op=o,
                                                                           timeout=20))
        _assert_allreduce(res, vecs, op)
    # compressed rounds are still bit-identical across members
    vecs = _vectors(ids, 5000, seed=9)
    res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=ids, tag="c8", op="mean", timeout=20,
                                               compression="int8"))
    assert len({r.tobytes() for r in res.values()}) == 1


def test_large_chunks_are_split_to_fit_the_broker_limit(tmp_path, make):
    # The broker refuses (drops) any PUBLISH over 4 KiB: the round only completes because every
    # chunk is split into parts that fit max_payload and reassembled on the other side.
    limit = 4096
    b = start_mosquitto(workdir=tmp_path, message_size_limit=limit)
    try:
        ids = ["a", "b", "c"]
        rings, _ = _members(make, b, ids, max_payload=limit)
        vecs = _vectors(ids, 30_000)  # 40 KB chunks -> >= 10 parts each
        res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=ids, tag="big", op="sum", timeout=30))
        _assert_allreduce(res, vecs)
        steps = 2 * (len(ids) - 1)
        assert rings["a"].stats.data_frames_sent >= steps * 10
        assert rings["a"].stats.rejected == 0
    finally:
        b.close()


def test_the_test_broker_really_drops_raw_qos1_bursts(fresh_mosquitto, make, swarm_id):
    """Control for the reliability tests below: without the session layer, QoS 1 publishes to a
    slow subscriber are lost once fresh_mosquitto's queue (max_queued_messages=50) overflows.
    (This guarantee used to be tested against the MQTT transport's own flow-control layer,
    removed in favour of the one reliability layer, federation/session.py.)"""
    n, delay = 800, 0.002
    rx = make(fresh_mosquitto, "raw-rx")
    count = [0]
    done = threading.Event()

    def slow(topic, payload):
        time.sleep(delay)  # a slow receiver: the broker's per-client queue fills up
        if payload == b"last":
            done.set()
        else:
            count[0] += 1

    rx.subscribe(topics.allreduce(swarm_id, "raw"), slow, inline=True)
    tx = make(fresh_mosquitto, "raw-tx")
    for _ in range(n):
        tx.publish(topics.allreduce(swarm_id, "raw"), b"y" * 256)
    # A marker published after the burst (retried until it gets through: it may be dropped too).
    while not done.is_set():
        tx.publish(topics.allreduce(swarm_id, "raw"), b"last")
        done.wait(0.5)
    assert count[0] < n, "the test broker did not drop anything: the reliability tests would prove nothing"


def test_burst_far_over_the_broker_queue_completes(fresh_mosquitto, make):
    # fresh_mosquitto has max_queued_messages=50; each member sends ~1000 frames per round.
    # A correct sum proves every frame arrived exactly once (a lost or doubled chunk changes it).
    ids = ["a", "b", "c", "d"]
    rings, _ = _members(make, fresh_mosquitto, ids, max_payload=1024)
    vecs = _vectors(ids, 30_000)
    res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=ids, tag="burst", op="sum", timeout=60))
    _assert_allreduce(res, vecs)
    assert rings["a"].stats.data_frames_sent > 10 * 50  # ten times the broker queue, per member


def _spawn(url, swarm, member, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "tests.federation.mqtt_member", "--url", url, "--swarm", swarm,
           "--id", member]
    return subprocess.Popen([*cmd, *extra], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _expect(proc, word, timeout=20.0):
    """Read the child's stdout until a line starting with ``word`` (bounded by ``timeout``)."""
    result: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith(word):
                result.append(line)
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    assert result, f"member process did not print {word} within {timeout}s"


def test_killed_member_aborts_round_and_ring_reforms(mosquitto, make, swarm_id):
    survivors = ["a", "b", "c"]
    rings, pubs = _members(make, mosquitto, survivors, status=True)
    observer = Membership(make(mosquitto, "observer"))
    size, timeout = 2_000_000, 4.0
    victim = _spawn(mosquitto.url, swarm_id, "d", "--mode", "ring", "--group", "a,b,c,d", "--tag", "r1",
                    "--size", str(size), "--seed", "3", "--timeout", str(timeout))
    try:
        _expect(victim, "READY")
        assert observer.wait_for(lambda live: set(live) == {"a", "b", "c", "d"}, 10)
        vecs = _vectors(survivors, size)
        started = time.monotonic()
        killer = threading.Thread(target=lambda: (_expect(victim, "SENT"),
                                                  os.kill(victim.pid, signal.SIGKILL)))
        killer.start()
        res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=sorted(["a", "b", "c", "d"]), tag="r1",
                                                   op="sum", timeout=timeout))
        elapsed = time.monotonic() - started
        killer.join(30)
        assert victim.wait(10) == -signal.SIGKILL
        for m, r in res.items():
            assert isinstance(r, RoundAborted), f"{m} did not abort: {r!r}"
        assert elapsed < timeout + 3.0
        # the Last Will marks the victim offline (retained, so late observers see it too)
        assert observer.wait_for(lambda live: "d" not in live, 10)
        assert observer.all()["d"].state == NodeState.OFFLINE
        # the next round re-forms from the live members and succeeds
        group = sorted(observer.live())
        assert group == survivors
        res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=group, tag="r2", op="sum", timeout=20))
        _assert_allreduce(res, vecs)
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait(10)
        for p in pubs.values():
            p.stop(offline=False)


def test_broker_restart_mid_round(fresh_mosquitto, make):
    ids = ["a", "b", "c"]
    rings, _ = _members(make, fresh_mosquitto, ids)
    size, timeout = 2_000_000, 20.0
    vecs = _vectors(ids, size)
    # Crash the broker as soon as member "a" put its first frame on the wire: provably mid-round.
    first_send = threading.Event()
    transport = rings["a"].endpoint.transport
    send = transport.send
    transport.send = lambda dst, payload: (send(dst, payload), first_send.set())
    restarter = threading.Thread(target=lambda: first_send.wait(30) and fresh_mosquitto.restart(hard=True))
    started = time.monotonic()
    restarter.start()
    res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=ids, tag="r1", op="sum", timeout=timeout))
    restarter.join()
    assert time.monotonic() - started < timeout + 3.0
    assert all(r.endpoint.transport.link.disconnects >= 1 for r in rings.values()), "restart came too late"
    done = {m: r for m, r in res.items() if isinstance(r, np.ndarray)}
    for m, r in res.items():
        assert isinstance(r, np.ndarray | RoundAborted), f"{m}: {r!r}"
    if done:  # whoever completed holds the right, identical result
        _assert_allreduce(done, vecs)
    for r in rings.values():
        assert r.endpoint.transport.link.wait_connected(10)
    res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=ids, tag="r2", op="sum", timeout=20))
    _assert_allreduce(res, vecs)


def test_rogue_frames_and_statuses_are_rejected_and_counted(mosquitto, make, swarm_id):
    ids = ["a", "b", "c"]
    rings, pubs = _members(make, mosquitto, ids, status=True)
    observer = Membership(make(mosquitto, "observer"))
    rogue = make(mosquitto, "rogue")
    assert observer.wait_for(lambda live: set(live) == set(ids), 30)
    good = framing.encode(framing.FrameKind.DATA, framing.Phase.REDUCE_SCATTER, swarm=swarm_id, tag="r1",
                          sender="c", count=1, total=1, payload=[b"\0\0\0\0"])
    bad_version = good[:2] + b"\x09" + good[3:]
    bad_crc = good[:-1] + bytes([good[-1] ^ 0xFF])
    other_swarm = framing.encode(framing.FrameKind.DATA, framing.Phase.REDUCE_SCATTER, swarm="elsewhere",
                                 tag="r1", sender="c", count=1, total=1, payload=[b"\0\0\0\0"])
    frames = [b"", b"garbage", bad_version, bad_crc, other_swarm]
    statuses = [b"not json", b'{"kind": "status", "node_id": "x", "state": "online"}',  # unversioned
                b'{"v": 2, "kind": "status", "node_id": "y", "state": "online"}',
                NodeStatus(node_id="someone-else", state=NodeState.ONLINE).model_dump_json().encode()]
    vecs = _vectors(ids, 50_000)

    def rogue_spam():
        for _ in range(3):
            for f in frames:
                rogue.publish(topics.allreduce(swarm_id, "a"), f)
            time.sleep(0.02)
        for i, s in enumerate(statuses):
            rogue.publish(topics.status(swarm_id, f"z{i}"), s)

    spam = threading.Thread(target=rogue_spam)
    spam.start()
    res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=ids, tag="r1", op="sum", timeout=20))
    spam.join()
    _assert_allreduce(res, vecs)
    # The rogue's frames reach a's pump and its statuses the observer's worker on their own
    # threads, unordered with the round: poll (returns as soon as all are counted).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (rings["a"].stats.rejected < 3 * len(frames)
                                           or observer.rejected < len(statuses)):
        time.sleep(0.05)
    assert rings["a"].stats.rejected >= 3 * len(frames)
    assert observer.rejected >= len(statuses)
    assert set(observer.live()) == set(ids)
    for p in pubs.values():
        p.stop(offline=False)


def _sha(v: np.ndarray) -> str:
    return hashlib.sha256(v.tobytes()).hexdigest()


def test_member_joining_between_rounds_gets_params_first(mosquitto, make):
    ids = ["a", "b", "c"]
    rings, pubs = _members(make, mosquitto, ids, status=True)
    observer = Membership(make(mosquitto, "observer"))
    assert observer.wait_for(lambda live: set(live) == set(ids), 30)
    size = 20_000
    params = {m: np.linspace(0, 1, size, dtype=np.float32) for m in ids}
    version = dict.fromkeys(ids, 0)
    grads = _vectors(ids, size, seed=1)

    def train_round(m, r, group, tag):
        if len(group) > len(ids):  # someone joined: hand the newest params around first
            root = min(group, key=lambda n: (-observer.live()[n].model_version, n))
            params[m] = r.broadcast(params[m] if m == root else None, root=root, group=group,
                                    tag=f"{tag}/params", timeout=20)
        g = r.allreduce(grads.get(m, np.zeros(size, np.float32)), group=group, tag=f"{tag}/0",
                        op="mean", timeout=20)
        params[m] = params[m] - np.float32(0.1) * g
        version[m] += 1
        pubs[m].update(model_version=version[m], params_sha256=_sha(params[m]))
        return params[m]

    res = _run(rings, lambda m, r: train_round(m, r, ids, "r1"))
    assert len({_sha(v) for v in res.values()}) == 1
    # "d" joins with other parameters and version 0: admitted at the next round boundary
    new_rings, new_pubs = _members(make, mosquitto, ["d"], status=True)
    rings.update(new_rings)
    pubs.update(new_pubs)
    params["d"] = np.full(size, 7.0, np.float32)
    version["d"] = 0
    assert observer.wait_for(lambda live: set(live) == {"a", "b", "c", "d"}
                             and live["a"].model_version == 1, 10)
    group = sorted(observer.live())
    before = _sha(params["a"])
    res = _run(rings, lambda m, r: train_round(m, r, group, "r2"))
    assert len({_sha(v) for v in res.values()}) == 1  # bit-identical on all four, "d" included
    assert before != _sha(res["d"])
    for p in pubs.values():
        p.stop(offline=False)


def test_embedded_amqtt_broker_smoke(make):
    b = start_embedded()
    try:
        ids = ["a", "b"]
        rings, _ = _members(make, b, ids)
        vecs = _vectors(ids, 10_000)
        res = _run(rings, lambda m, r: r.allreduce(vecs[m], group=ids, tag="r1", op="sum", timeout=20))
        _assert_allreduce(res, vecs)
        for r in rings.values():
            r.endpoint.transport.link.close()
    finally:
        b.stop()
