"""RingAllreduce over the in-memory transport: results against numpy, bit-identical members,
faults (duplicates, reordering, loss, corruption, death), NaN rejection, flow control, bytes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation.errors import RoundAborted, UpdateRejected
from federation.framing import FrameKind, decode, encode_abort
from federation.memory import MemoryHub
from federation.ring import RingAllreduce
from federation.transport import Polled
from tests.federation.ringutil import allreduce_all, assert_identical, close_all, ids, make_ring, run_members

# The two ways an allreduce runs (federation/ring.py): around the ring, or the direct path that
# small F32 vectors take by default. Tests of behaviour both must share run each.
ALGOS = {"ring": {"direct_max_bytes": 0}, "direct": {"direct_max_bytes": 1 << 30}}


def _vecs(members, length, seed):
    rng = np.random.default_rng(seed)
    return {m: rng.standard_normal(length).astype(np.float32) * 10 for m in members}


def _reference(vecs, op):
    s = np.sum(np.stack([v.astype(np.float64) for v in vecs.values()]), axis=0)
    return s / len(vecs) if op == "mean" else s


def _close(result, ref, vecs):
    # float32 summation: each partial sum rounds once per hop.
    scale = np.sum(np.stack([np.abs(v) for v in vecs.values()]), axis=0) if vecs else 0
    tol = len(vecs) * np.finfo(np.float32).eps * (scale + 1e-30)
    if ref.size:
        np.testing.assert_array_less(np.abs(result - ref), tol + 1e-6)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", range(1, 9))
def test_allreduce_matches_numpy_and_is_bit_identical(n: int, algo: str) -> None:
    rng = np.random.default_rng(n)
    # Sizes below n, not divisible by n, multi-part chunks (small max_payload) and a 0-length vector.
    sizes = sorted({0, 1, max(1, n - 1), n, n + 1, 7 * n + 3, int(rng.integers(100, 3000))})
    hub, engines = make_ring(n, max_payload=2048, engine_kw=ALGOS[algo])
    try:
        if n > 1:
            assert engines["m0"].algorithm(n, max(sizes)) == algo
        for i, length in enumerate(sizes):
            for op in ("sum", "mean"):
                vecs = _vecs(engines, length, seed=100 * n + i)
                res = allreduce_all(engines, vecs, tag=f"t{i}-{op}", op=op, timeout=20)
                got = assert_identical(res)
                assert got.shape == (length,) and got.dtype == np.float32
                ref = _reference(vecs, op)
                _close(got, ref, vecs if op == "sum" else {m: v / n for m, v in vecs.items()})
    finally:
        close_all(engines)


def test_group_order_given_by_each_member_does_not_matter() -> None:
    hub, engines = make_ring(4)
    try:
        vecs = _vecs(engines, 1001, 7)
        groups = {m: list(reversed(ids(4))) if i % 2 else ids(4) for i, m in enumerate(engines)}
        res = run_members({m: (lambda m=m: engines[m].allreduce(vecs[m], group=groups[m], tag="g", op="sum",
                                                               timeout=10)) for m in engines})
        got = assert_identical(res)
        _close(got, _reference(vecs, "sum"), vecs)
    finally:
        close_all(engines)


def test_duplicated_and_reordered_messages_count_once() -> None:
    faults = {m: dict(duplicate=0.3, reorder=0.5, reorder_window=0.005, seed=i) for i, m in enumerate(ids(5))}
    hub, engines = make_ring(5, faults=faults, max_payload=1024)
    try:
        for r in range(3):
            vecs = _vecs(engines, 2000 + r, seed=r)
            got = assert_identical(allreduce_all(engines, vecs, tag=f"dup{r}", op="sum", timeout=20))
            _close(got, _reference(vecs, "sum"), vecs)
        assert sum(e.stats.duplicates for e in engines.values()) > 0
        assert sum(e.endpoint.transport.faults.reordered for e in engines.values()) > 0
    finally:
        close_all(engines)


def test_lost_and_corrupted_frames_are_rejected_counted_and_retransmitted() -> None:
    faults = {m: dict(drop=0.05, corrupt=0.05, seed=10 + i) for i, m in enumerate(ids(4))}
    hub, engines = make_ring(4, faults=faults, max_payload=1024, engine_kw=dict(retransmit_after=0.02))
    try:
        for r in range(2):
            vecs = _vecs(engines, 3000, seed=r)
            got = assert_identical(allreduce_all(engines, vecs, tag=f"loss{r}", op="mean", timeout=30))
            _close(got, _reference(vecs, "mean"), {m: v / 4 for m, v in vecs.items()})
        stats = [e.stats for e in engines.values()]
        assert sum(s.rejected for s in stats) > 0 and "checksum" in "".join(s.last_reject for s in stats)
        assert sum(s.retransmits for s in stats) > 0
    finally:
        close_all(engines)


@pytest.mark.parametrize("algo", ALGOS)
def test_nan_update_aborts_every_member_naming_the_sender(algo: str) -> None:
    hub, engines = make_ring(4, engine_kw=ALGOS[algo])
    try:
        vecs = _vecs(engines, 500, 3)
        vecs["m2"][17] = np.nan
        res = allreduce_all(engines, vecs, tag="nan", timeout=5)
        for m in engines:
            err = res[m]
            assert isinstance(err, UpdateRejected), f"{m}: {err!r}"
            assert err.member == "m2" and "m2" in str(err)
            assert res["_elapsed"][m] < 2.0  # told by ABORT, not by the deadline
        # The next round (no NaN) works with the same engines.
        vecs["m2"][17] = 1.0
        got = assert_identical(allreduce_all(engines, vecs, tag="after-nan", op="sum", timeout=5))
        _close(got, _reference(vecs, "sum"), vecs)
    finally:
        close_all(engines)


@pytest.mark.parametrize("algo", ALGOS)
def test_inf_in_forwarded_data_is_blamed_on_its_sender(monkeypatch, algo: str) -> None:
    """A member that skips its own check (buggy or hostile) is caught by its successor (ring) or
    by every member (direct path)."""
    import federation.ring as ring

    hub, engines = make_ring(3, engine_kw=ALGOS[algo])
    real = ring.check_finite
    monkeypatch.setattr(ring, "check_finite", lambda x, *, member, what="update": None
                        if member == "m1" else real(x, member=member, what=what))
    try:
        vecs = _vecs(engines, 300, 4)
        vecs["m1"][5] = np.inf
        res = allreduce_all(engines, vecs, tag="inf", timeout=5)
        for m in engines:
            assert isinstance(res[m], UpdateRejected) and res[m].member == "m1", f"{m}: {res[m]!r}"
    finally:
        close_all(engines)


@pytest.mark.parametrize("algo", ALGOS)
def test_member_dying_mid_round_aborts_survivors_before_the_deadline_then_they_reform(algo: str) -> None:
    n, timeout = 5, 1.0
    faults = {"m2": dict(kill_after=3)}  # m2 dies after its third frame
    hub, engines = make_ring(n, faults=faults, max_payload=1024, engine_kw=ALGOS[algo])
    try:
        vecs = _vecs(engines, 20_000, 5)
        res = allreduce_all(engines, vecs, tag="die", op="sum", timeout=timeout)
        survivors = [m for m in engines if m != "m2"]
        for m in survivors:
            assert isinstance(res[m], RoundAborted), f"{m} returned {res[m]!r}"
            assert res[m].member == "m2", f"{m} blamed {res[m].member}: {res[m]}"
            assert res["_elapsed"][m] < timeout + 0.6
        assert not isinstance(res["m2"], np.ndarray)  # the dead one produced nothing either
        # Next round, ring re-formed from the survivors.
        sub = {m: engines[m] for m in survivors}
        got = assert_identical(allreduce_all(sub, vecs, group=survivors, tag="die-2", op="sum", timeout=10))
        _close(got, _reference({m: vecs[m] for m in survivors}, "sum"), vecs)
    finally:
        close_all(engines)


class _Dies(Polled):
    """A member's transport that sets ``died`` once it is dead (its ``kill_after`` sends done)."""

    def __init__(self, inner) -> None:
        self.inner, self.member_id, self.max_payload = inner, inner.member_id, inner.max_payload
        self.died = threading.Event()

    def send(self, dst, payload):
        self.inner.send(dst, payload)
        if self.inner.dead:
            self.died.set()

    def recv(self, timeout):
        return self.inner.recv(timeout)

    def close(self):
        self.inner.close()


class _Stalls(Polled):
    """A slow member's transport: its sends wait until ``after`` is set (the dead member is dead),
    then its first frame to each peer goes out and nothing after it arrives during the test (its
    later frames, ACKs and ABORT too: they are later than any grace period); it receives all."""

    def __init__(self, inner, after: threading.Event) -> None:
        self.inner, self.member_id, self.max_payload = inner, inner.member_id, inner.max_payload
        self.after = after
        self.passed: list[str] = []
        self.held = 0

    def send(self, dst, payload):
        assert self.after.wait(30), "the dead member never died"
        if dst in self.passed:
            self.held += 1
        else:
            self.passed.append(dst)
            self.inner.send(dst, payload)

    def recv(self, timeout):
        return self.inner.recv(timeout)

    def close(self):
        self.inner.close()


def test_a_slow_member_still_sending_is_not_blamed_for_a_dead_one() -> None:
    """Direct path (every member needs every peer's row at once). m2 dies after its third frame
    (all three reach m0); m1 is alive but slow: its first frame to each peer arrives after m2
    died, and nothing of it after that (its ABORT neither), so no vote can show it alive. A sixth
    member, m5, played by the test, sends the timeout ABORT that starts the vote and names m1 (as
    a member whose own view is stale would). Every survivor, m1 included, names m2: the peer
    silent longest, not the slow one still sending nor the first in its list.

    Nothing here depends on timing: the order in which frames arrive is fixed by events (m1 sends
    only once m2 is dead; every member sends its whole row to each peer before its first frame to
    m5, and m5's ABORT goes out only once m5 has a frame of every member), and the members' own
    deadlines (30 s) only bound a hang; m2's short one does not matter (it is dead)."""
    group, tag = ids(6), "slow"
    hub = MemoryHub()
    kw = {"max_payload": 1024}
    dies = _Dies(hub.transport("m2", kill_after=3, **kw))
    stalls = _Stalls(hub.transport("m1", **kw), dies.died)
    transports = {"m0": hub.transport("m0", **kw), "m1": stalls, "m2": dies,
                  "m3": hub.transport("m3", **kw), "m4": hub.transport("m4", **kw)}
    engines = {m: RingAllreduce(t, **ALGOS["direct"]) for m, t in transports.items()}
    m5 = hub.transport("m5", **kw)
    try:
        vecs = _vecs(engines, 2_000, 9)  # a row is 4..16 frames: more than m2's 3, within one window
        timeouts = {m: 0.5 if m == "m2" else 30.0 for m in engines}

        def play_m5() -> dict:
            seen: set[str] = set()
            deadline = time.monotonic() + 30
            while not {"m0", "m1", "m3", "m4"} <= seen:
                assert time.monotonic() < deadline, f"m5 heard only {sorted(seen)}"
                buf = m5.recv(0.1)
                if buf is not None:
                    seen.add(decode(buf).sender)
            abort = encode_abort(swarm="default", tag=tag, sender="m5", member="m1",
                                 reason="m5 got nothing from m1 within 30s")
            for m in engines:
                m5.send(m, abort)
            return {}

        fns = {m: (lambda m=m: engines[m].allreduce(vecs[m], group=group, tag=tag, op="sum",
                                                     timeout=timeouts[m])) for m in engines}
        res = run_members({**fns, "m5": play_m5})
        assert res["m5"] == {}, res["m5"]
        for m in ("m0", "m1", "m3", "m4"):
            assert isinstance(res[m], RoundAborted), f"{m} returned {res[m]!r}"
            assert res[m].member == "m2", f"{m} blamed {res[m].member}: {res[m]}"
        # the scenario happened as described: m2's three frames went out, m1 stalled after one each
        assert dies.inner.faults.sent == 4 and stalls.held > 0 and sorted(stalls.passed) == [
            "m0", "m2", "m3", "m4", "m5"]
    finally:
        close_all(engines)
        m5.close()


@pytest.mark.parametrize("algo", ALGOS)
def test_absent_member_is_named_by_every_survivor(algo: str) -> None:
    hub, engines = make_ring(4, engine_kw=ALGOS[algo])
    try:
        present = ["m0", "m1", "m3"]
        vecs = _vecs(engines, 100, 6)
        res = run_members({m: (lambda m=m: engines[m].allreduce(vecs[m], group=ids(4), tag="absent",
                                                               timeout=0.5)) for m in present})
        for m in present:
            assert isinstance(res[m], RoundAborted) and res[m].member == "m2", f"{m}: {res[m]!r}"
            assert res["_elapsed"][m] < 1.1
    finally:
        close_all(engines)


def test_early_frames_of_the_next_tag_are_buffered_and_stale_ones_ignored() -> None:
    hub, engines = make_ring(4)
    try:
        vecs = _vecs(engines, 5000, 8)
        assert_identical(allreduce_all(engines, vecs, tag="a", timeout=10))

        def late(m):
            if m == "m1":  # the others start tag "b" first: wait until their frames reached m1 early
                deadline = time.monotonic() + 10
                while engines["m1"].stats.early == 0 and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert engines["m1"].stats.early > 0
            return engines[m].allreduce(vecs[m], group=ids(4), tag="b", op="sum", timeout=10)

        got = assert_identical(run_members({m: (lambda m=m: late(m)) for m in engines}))
        _close(got, _reference(vecs, "sum"), vecs)
        assert engines["m1"].stats.early > 0
        # A straggling duplicate of an old tag is re-acknowledged and otherwise ignored.
        # (late ACKs and owed ACKs of tag "b" still travel after the calls return: wait until no
        # endpoint holds lingering frames or owed ACKs and m1's counters stand still; the deadline
        # is only for a hang: on a loaded runner 5 s ran out before quiet and the exact count below
        # then saw a late ACK of "b")
        deadline = time.monotonic() + 30
        last = None
        while time.monotonic() < deadline:
            now = (engines["m1"].stats.stale, engines["m1"].stats.acks_sent)
            if now == last and all(not e.endpoint._linger and not e.endpoint._owed for e in engines.values()):
                break
            last = now
            time.sleep(0.05)
        before, acks_before = engines["m1"].stats.stale, engines["m1"].stats.acks_sent
        frame = _first_data_frame(engines["m0"], vecs["m0"], hub)
        engines["m0"].endpoint.transport.send("m1", frame)
        deadline = time.monotonic() + 30  # m1's pump answers; returns as soon as it did
        while engines["m1"].stats.acks_sent == acks_before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engines["m1"].stats.acks_sent == acks_before + 1
        assert engines["m1"].stats.stale >= before + 1
        with pytest.raises(ValueError, match="already used"):
            engines["m1"].allreduce(vecs["m1"], group=ids(4), tag="a", timeout=1)
    finally:
        close_all(engines)


def _first_data_frame(engine, vec, hub) -> bytes:
    from federation.framing import Phase, encode

    return encode(FrameKind.DATA, Phase.REDUCE_SCATTER, swarm="default", tag="a", sender=engine.member_id,
                  count=3, total=vec.size, payload=[vec[:3]])


class _Recorder(Polled):
    """Wraps a (polled) transport and records decoded outgoing frames (for flow-control checks);
    sets ``retransmitted`` when a DATA frame goes out a second time."""

    def __init__(self, inner) -> None:
        self.inner, self.member_id, self.max_payload = inner, inner.member_id, inner.max_payload
        self.sent: list[tuple[float, str, object]] = []
        self.retransmitted = threading.Event()
        self.keys_before_retransmit: set | None = None

    def send(self, dst, payload):
        fr = decode(payload)
        if fr.kind == FrameKind.DATA and not self.retransmitted.is_set():
            keys = {f.key for _, _, f in self.sent if f.kind == FrameKind.DATA}
            if fr.key in keys:
                self.keys_before_retransmit = keys
                self.retransmitted.set()
        self.sent.append((time.monotonic(), dst, fr))
        self.inner.send(dst, payload)

    def recv(self, timeout):
        return self.inner.recv(timeout)

    def close(self):
        self.inner.close()


def test_in_flight_frames_per_peer_are_bounded_by_the_window() -> None:
    hub = MemoryHub()
    rec = _Recorder(hub.transport("m0", max_payload=1024))
    a = RingAllreduce(rec, max_in_flight=4, retransmit_after=0.2)
    t1 = hub.transport("m1", max_payload=1024)  # nobody reads it yet: a's frames stay unacknowledged
    engines = [a]
    try:
        x = np.ones(50_000, np.float32)

        def late_b():
            # b joins only once a retransmitted: by then a had every chance to send more than
            # its window if flow control were broken. a's frames wait in t1's inbox meanwhile.
            assert rec.retransmitted.wait(10)
            b = RingAllreduce(t1)
            engines.append(b)
            return b.allreduce(x, group=["m0", "m1"], tag="w", op="sum", timeout=10)

        res = run_members({"m0": lambda: a.allreduce(x, group=["m0", "m1"], tag="w", op="sum", timeout=10),
                           "m1": late_b})
        got = assert_identical(res)
        assert np.array_equal(got, np.full(50_000, 2, np.float32))
        assert rec.keys_before_retransmit is not None and len(rec.keys_before_retransmit) == 4
    finally:
        for e in engines:
            e.close()


def test_bytes_sent_per_member_within_5_percent_of_ideal() -> None:
    n, length = 4, 1_000_000
    hub, engines = make_ring(n)
    try:
        vecs = _vecs(engines, length, 9)
        assert_identical(allreduce_all(engines, vecs, tag="bytes", timeout=30))
        ideal = 2 * (n - 1) / n * length * 4
        for m, e in engines.items():
            assert ideal <= e.stats.bytes_sent <= 1.05 * ideal, (m, e.stats.bytes_sent, ideal)
            assert e.stats.retransmits == 0
    finally:
        close_all(engines)


def test_clip_norm_limits_each_members_contribution() -> None:
    hub, engines = make_ring(3)
    try:
        vecs = {"m0": np.full(100, 10, np.float32), "m1": np.full(100, 0.01, np.float32),
                "m2": np.zeros(100, np.float32)}
        got = assert_identical(allreduce_all(engines, vecs, tag="clip", op="sum", clip_norm=1.0, timeout=5))
        expected = vecs["m0"] / np.linalg.norm(vecs["m0"]) + vecs["m1"]  # m1 is within the norm, unchanged
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        assert vecs["m0"][0] == 10  # the caller's array is untouched
    finally:
        close_all(engines)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_broadcast_delivers_the_roots_bytes(n: int) -> None:
    hub, engines = make_ring(n, max_payload=1024)
    try:
        for i, length in enumerate([0, 1, 2000]):
            root = ids(n)[i % n]
            x = np.random.default_rng(i).standard_normal(length).astype(np.float32)
            res = run_members({m: (lambda m=m, x=x, root=root, tag=f"b{i}": engines[m].broadcast(
                x if m == root else None, root=root, group=ids(n), tag=tag, timeout=10)) for m in engines})
            got = assert_identical(res)
            assert got.tobytes() == x.tobytes()
    finally:
        close_all(engines)


def test_bad_arguments_are_clear_errors() -> None:
    hub, engines = make_ring(2)
    e = engines["m0"]
    try:
        with pytest.raises(ValueError, match="1-D"):
            e.allreduce(np.zeros((2, 2), np.float32), group=ids(2), tag="x", timeout=1)
        with pytest.raises(ValueError, match="not in the group"):
            e.allreduce(np.zeros(2, np.float32), group=["m1", "m5"], tag="x", timeout=1)
        with pytest.raises(ValueError, match="duplicate"):
            e.allreduce(np.zeros(2, np.float32), group=["m0", "m0"], tag="x", timeout=1)
        with pytest.raises(ValueError):
            e.allreduce(np.zeros(2, np.float32), group=ids(2), tag="x", op="max", timeout=1)
        with pytest.raises(ValueError, match="compression"):
            e.allreduce(np.zeros(2, np.float32), group=ids(2), tag="x", compression="zip", timeout=1)
        with pytest.raises(ValueError, match="root"):
            e.broadcast(None, root="m0", group=ids(2), tag="x", timeout=1)
    finally:
        close_all(engines)


@pytest.mark.slow
def test_ten_million_floats_over_eight_members_is_fast() -> None:
    n, length = 8, 10_000_000
    hub, engines = make_ring(n)
    try:
        base = np.random.default_rng(0).standard_normal(length).astype(np.float32)
        vecs = {m: base for m in engines}  # one shared input keeps the test's memory ~0.7 GB
        t0 = time.monotonic()
        got = assert_identical(allreduce_all(engines, vecs, tag="big", op="sum", timeout=120))
        seconds = time.monotonic() - t0
        np.testing.assert_allclose(got, base * 8, rtol=1e-5, atol=1e-4)
        print(f"10M floats over 8 members: {seconds:.1f} s")  # ~2-3 s idle; timings never gate
    finally:
        close_all(engines)


@pytest.mark.parametrize("algo", ALGOS)
def test_chaos_all_faults_at_once_every_codec_and_broadcast(algo: str) -> None:
    faults = {m: dict(drop=0.03, duplicate=0.1, reorder=0.3, reorder_window=0.005, corrupt=0.03, seed=40 + i)
              for i, m in enumerate(ids(6))}
    hub, engines = make_ring(6, faults=faults, max_payload=1024,
                             engine_kw=dict(retransmit_after=0.02, **ALGOS[algo]))
    try:
        rng = np.random.default_rng(11)
        for i, codec in enumerate(["none", "fp16", "int8", "topk"]):
            vecs = {m: rng.standard_normal(1500 + i).astype(np.float32) for m in engines}
            got = assert_identical(allreduce_all(engines, vecs, tag=f"chaos{i}", op="mean", compression=codec,
                                                 timeout=30))
            if codec == "none":
                _close(got, _reference(vecs, "mean"), {m: v / 6 for m, v in vecs.items()})
        x = rng.standard_normal(3000).astype(np.float32)
        res = run_members({m: (lambda m=m: engines[m].broadcast(x if m == "m3" else None, root="m3",
                                                                group=ids(6), tag="chaos-b", timeout=30))
                           for m in engines})
        assert assert_identical(res).tobytes() == x.tobytes()
        stats = [e.stats for e in engines.values()]
        assert all(s.send_errors == 0 for s in stats)
        assert sum(s.duplicates for s in stats) and sum(s.rejected for s in stats) and sum(s.retransmits
                                                                                           for s in stats)
    finally:
        close_all(engines)


def test_mismatched_vector_lengths_abort_the_round() -> None:
    hub, engines = make_ring(3)
    try:
        vecs = {"m0": np.ones(10, np.float32), "m1": np.ones(10, np.float32), "m2": np.ones(11, np.float32)}
        res = allreduce_all(engines, vecs, tag="len", timeout=3)
        assert all(isinstance(res[m], RoundAborted) for m in engines)
        assert any("m2" in str(res[m]) for m in engines)
    finally:
        close_all(engines)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 6), length=st.integers(0, 600), payload=st.sampled_from([1024, 1500, 4096]),
       codec=st.sampled_from(["none", "fp16", "int8", "topk"]), op=st.sampled_from(["sum", "mean"]),
       algo=st.sampled_from(sorted(ALGOS)))
def test_property_any_shape_any_codec_is_bit_identical(n, length, payload, codec, op, algo) -> None:
    hub, engines = make_ring(n, max_payload=payload, engine_kw=ALGOS[algo])
    try:
        vecs = _vecs(engines, length, seed=length)
        got = assert_identical(allreduce_all(engines, vecs, tag="p", op=op, compression=codec, timeout=20))
        if codec == "none":
            _close(got, _reference(vecs, op), vecs if op == "sum" else {m: v / n for m, v in vecs.items()})
    finally:
        close_all(engines)


def test_small_vectors_take_the_direct_path_one_hop_same_result() -> None:
    from federation.ring import DIRECT_MAX_BYTES

    n, length = 4, 4810
    hub, engines = make_ring(n)
    _, ring_engines = make_ring(n, engine_kw=ALGOS["ring"])
    try:
        e = engines["m0"]
        assert e.algorithm(n, length) == "direct"
        assert e.algorithm(n, DIRECT_MAX_BYTES // (4 * (n - 1)) + 1) == "ring"  # over the threshold
        assert e.algorithm(n, length, "fp16") == "ring" and e.algorithm(1, length) == "ring"
        assert ring_engines["m0"].algorithm(n, length) == "ring"
        vecs = _vecs(engines, length, 12)
        direct = assert_identical(allreduce_all(engines, vecs, tag="d", op="mean", timeout=10))
        ring = assert_identical(allreduce_all(ring_engines, vecs, tag="r", op="mean", timeout=10))
        _close(direct, _reference(vecs, "mean"), {m: v / n for m, v in vecs.items()})
        np.testing.assert_allclose(direct, ring, rtol=1e-5, atol=1e-5)
        for m in engines:  # one frame to each peer instead of 2 (n - 1) around the ring
            assert engines[m].stats.data_frames_sent == n - 1
            assert ring_engines[m].stats.data_frames_sent == 2 * (n - 1)
        # A call can insist on the ring (the commit's vote does): same result, ring frames.
        forced = assert_identical(allreduce_all(engines, vecs, tag="f", op="mean", timeout=10,
                                                algorithm="ring"))
        assert forced.tobytes() == ring.tobytes()
        assert all(e.stats.data_frames_sent == (n - 1) + 2 * (n - 1) for e in engines.values())
        for bad, match in (({"algorithm": "tree"}, "unknown algorithm"),
                           ({"algorithm": "direct", "compression": "fp16"}, "float32 only")):
            with pytest.raises(ValueError, match=match):
                e.allreduce(vecs["m0"], group=ids(n), tag="bad", **bad)
    finally:
        close_all(engines)
        close_all(ring_engines)
    with pytest.raises(ValueError, match="direct_max_bytes"):
        RingAllreduce(MemoryHub().transport("x"), direct_max_bytes=-1)


def test_members_disagreeing_on_the_path_abort_instead_of_hanging() -> None:
    """A member configured differently (another release) breaks the schedule: every member
    aborts well before the deadline instead of waiting for frames that never come."""
    hub = MemoryHub()
    engines = {m: RingAllreduce(hub.transport(m), **ALGOS["ring" if m == "m1" else "direct"])
               for m in ids(3)}
    try:
        res = allreduce_all(engines, _vecs(engines, 100, 13), tag="mixed", timeout=5)
        for m in engines:
            assert isinstance(res[m], RoundAborted), f"{m}: {res[m]!r}"
            assert res["_elapsed"][m] < 4.0
    finally:
        close_all(engines)


@pytest.mark.parametrize("linger", [True, False])
def test_a_direct_call_returns_before_the_acks_of_its_rows_unless_told_to_drain(linger):
    """Every 0.3 s message latency: a lingering direct allreduce returns when the rows are in
    (its own rows' ACKs are a hop behind, left to the session); ``linger=False`` waits for them."""
    hub = MemoryHub()
    names = ["a", "b", "c"]
    rings = {m: RingAllreduce(hub.transport(m, delay=0.3), swarm="s", linger=linger) for m in names}
    vecs = _vecs(rings, 100, 3)
    pending: dict[str, int] = {}

    def member(m):
        res = rings[m].allreduce(vecs[m], group=names, tag="t", timeout=30)
        pending[m] = len(rings[m].endpoint._linger)  # right when the call returned
        return res

    out = run_members({m: (lambda m=m: member(m)) for m in names})
    try:
        assert_identical(out)
        assert pending == {m: 2 if linger else 0 for m in names}, pending  # one frame per peer
        deadline = time.monotonic() + 10
        while any(r.endpoint._linger for r in rings.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(r.endpoint._linger for r in rings.values())  # the ACKs retired them
        assert all(r.endpoint.stats.retransmits == 0 for r in rings.values())
    finally:
        close_all(rings)


@pytest.mark.parametrize("linger", [True, False])
def test_direct_calls_in_a_row_acknowledge_each_other(linger):
    """A round's steps (direct allreduces in a row) send almost no ACK messages: each member's
    next row acknowledges the last call for its peers (session: a peer that moved on). Without
    linger every row is ACKed. Either way nothing is retransmitted and every frame is retired."""
    hub = MemoryHub()
    names = ["a", "b", "c"]
    rings = {m: RingAllreduce(hub.transport(m), swarm="s", linger=linger) for m in names}
    vecs = _vecs(rings, 500, 4)
    calls = 20

    def member(m):
        return [rings[m].allreduce(vecs[m] * (i + 1), group=names, tag=f"t{i}", timeout=30)
                for i in range(calls)]

    out = run_members({m: (lambda m=m: member(m)) for m in names})
    try:
        for i in range(calls):
            assert_identical({m: out[m][i] for m in names})  # type: ignore[index]
        deadline = time.monotonic() + 10
        busy = lambda: any(r.endpoint._linger or r.endpoint._owed for r in rings.values())  # noqa: E731
        while busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = [r.endpoint.stats for r in rings.values()]
        assert not any(r.endpoint._linger for r in rings.values())
        assert all(s.data_frames_sent == 2 * calls and s.retransmits == 0 and s.linger_expired == 0
                   for s in stats)
        acks = sum(s.acks_sent for s in stats)
        if linger:  # the last call's, plus any owed ACK a descheduled member's timer sent first
            assert acks < 0.25 * 2 * calls * len(names), [s.snapshot() for s in stats]
            assert sum(s.acks_implied for s in stats) + acks >= 2 * calls * len(names) - 2 * len(names)
        else:
            assert acks >= 2 * calls * len(names) - sum(s.acks_implied for s in stats)
    finally:
        close_all(rings)


@pytest.mark.parametrize("codec", ["int8", "topk", "fp16"])
def test_coded_exchange_same_decoded_rows_everywhere_with_error_feedback(codec):
    """``exchange(compression=...)``: each row is encoded once (error feedback for int8/top-k),
    every member, the sender included, gets the same decoded rows; what a codec dropped in one
    call goes out in the next; a non-finite row arrives non-finite (int8 would zero it)."""
    from federation import compression as comp

    n, size = 3, 1000
    _, engines = make_ring(n, max_payload=2048)  # several parts per row
    rng = np.random.default_rng(5)
    sent = {m: [rng.standard_normal(size).astype(np.float32) for _ in range(2)] for m in ids(n)}
    got: dict[str, list[np.ndarray]] = {m: [] for m in ids(n)}

    def member(m):
        def run():
            for call, x in enumerate(sent[m]):
                got[m].append(engines[m].exchange(x, group=ids(n), tag=f"x{call}", timeout=10,
                                                  compression=codec))
            return engines[m].feedback_residual
        return run

    res = run_members({m: member(m) for m in ids(n)})
    for call in range(2):
        assert len({got[m][call].tobytes() for m in ids(n)}) == 1, f"call {call}: rows differ"
    rows = got["m0"]
    for j, m in enumerate(ids(n)):
        residual = res[m]
        if codec == "fp16":  # no error feedback: each row is the fp16 rounding of what was sent
            assert residual is None
            np.testing.assert_allclose(rows[0][j], sent[m][0], rtol=1e-3, atol=1e-3)
            continue
        # error feedback: decoded rows + what is still owed = everything sent (up to rounding)
        np.testing.assert_allclose(rows[0][j] + rows[1][j] + residual, sent[m][0] + sent[m][1],
                                   rtol=1e-5, atol=1e-5)
        assert not np.allclose(rows[0][j], sent[m][0], atol=1e-6)  # the codec did drop something

    bad = np.full(size, np.inf, np.float32)
    out = run_members({m: (lambda m=m: engines[m].exchange(bad if m == "m1" else sent[m][0], group=ids(n),
                                                          tag="nan", timeout=10, compression=codec))
                       for m in ids(n)})
    for m in ids(n):
        assert not np.isfinite(out[m][1]).all() and np.isfinite(out[m][0]).all(), m
    nan8 = comp.join_pieces(comp.encode_nonfinite(comp.Codec.INT8, 4))
    assert np.isnan(comp.decode(comp.Codec.INT8, nan8, 4)).all()
    close_all(engines)
