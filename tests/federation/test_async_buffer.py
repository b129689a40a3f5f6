"""Buffered asynchronous aggregation, the pure rules (federation/asyncbuf.py): the weighted mean
against numpy, and each refusal (stale, replayed, forged, duplicate, non-finite, oversized,
forked) caught by its own check: each test would pass the update if that check were removed."""

from __future__ import annotations

import numpy as np
import pytest

from federation.asyncagg import initial_version
from federation.asyncbuf import (
    Buffer,
    Refusal,
    Refused,
    Update,
    aggregate,
    decode_version,
    encode_update,
    encode_version,
    staleness_weight,
)

L = 64


def _v0():
    return initial_version(np.random.default_rng(0).standard_normal(L).astype(np.float32))


def _upd(member, base, delta=None, samples=10, seed=1):
    if delta is None:
        delta = np.random.default_rng(seed).standard_normal(L).astype(np.float32) * 0.1
    d = delta
    return Update(member, base.version, base.sha256, samples, d)


def _refused(buf, member, payload, why):
    with pytest.raises(Refused) as exc:
        buf.admit(member, payload)
    assert exc.value.why == why, exc.value
    assert buf.refused[why] >= 1


def test_weighted_mean_matches_numpy_and_staleness_discount():
    v0 = _v0()
    v1 = aggregate(v0, [_upd("a", v0, seed=1)])
    ups = [_upd("b", v1, samples=30, seed=2), _upd("c", v0, samples=10, seed=3)]  # c is 1 behind
    v2 = aggregate(v1, ups, outlier_factor=0)
    w = np.array([30 * staleness_weight(0), 10 * staleness_weight(1)])
    ref = v1.params.astype(np.float64) + (w[0] * ups[0].delta + w[1] * ups[1].delta) / w.sum()
    assert v2.version == 2 and np.abs(v2.params - ref).max() < 1e-6
    assert [(c.member, c.staleness) for c in v2.contributions] == [("b", 0), ("c", 1)]
    # deterministic: same inputs in another order give the same bytes
    assert aggregate(v1, ups[::-1], outlier_factor=0).sha256 == v2.sha256
    # and the published form round-trips with its hash checked
    assert decode_version(encode_version(v2), size=L).sha256 == v2.sha256


def test_a_member_claiming_huge_sample_counts_weighs_at_most_twice_the_median():
    """A member holding a valid key claims 2^40 samples to take the whole mean: its count is
    capped at SAMPLES_WEIGHT_CAP x the buffer's median (fails without the cap: weight ~1)."""
    from federation.asyncbuf import SAMPLES_WEIGHT_CAP

    v0 = _v0()
    ups = [_upd("a", v0, samples=10, seed=1), _upd("b", v0, samples=12, seed=2),
           _upd("evil", v0, samples=2**40, seed=3)]
    v1 = aggregate(v0, ups, outlier_factor=0)
    w = {c.member: c.weight for c in v1.contributions}
    assert w["evil"] == SAMPLES_WEIGHT_CAP * 12  # the median claimed count is b's 12
    assert w["evil"] / sum(w.values()) < 0.6
    mean = sum(w[u.member] * u.delta.astype(np.float64) for u in ups) / sum(w.values())
    ref = v0.params.astype(np.float64) + mean
    assert np.abs(v1.params - ref).max() < 1e-6


def test_buffer_advances_after_k_updates():
    v0 = _v0()
    buf = Buffer(v0, buffer=3, max_staleness=2)
    assert buf.admit("a", encode_update(_upd("a", v0, seed=1))) is None
    assert buf.admit("b", encode_update(_upd("b", v0, seed=2))) is None
    v1 = buf.admit("c", encode_update(_upd("c", v0, seed=3)))
    assert v1 is not None and v1.version == 1 and not buf.pending
    assert {c.member for c in v1.contributions} == {"a", "b", "c"}


def test_stale_update_is_refused():
    v0 = _v0()
    buf = Buffer(v0, buffer=1, max_staleness=1)
    buf.admit("a", encode_update(_upd("a", v0)))  # -> v1
    buf.admit("b", encode_update(_upd("b", buf.current)))  # -> v2
    _refused(buf, "c", encode_update(_upd("c", v0)), Refusal.STALE)  # 2 behind, S = 1
    assert buf.current.version == 2


def test_replayed_update_is_refused():
    v0 = _v0()
    buf = Buffer(v0, buffer=1, max_staleness=5)
    payload = encode_update(_upd("a", v0))
    buf.admit("a", payload)  # -> v1, within the staleness bound afterwards
    _refused(buf, "a", payload, Refusal.REPLAYED)
    assert buf.current.version == 1


def test_duplicate_member_in_one_buffer_is_refused():
    v0 = _v0()
    buf = Buffer(v0, buffer=1, max_staleness=5)
    buf.admit("x", encode_update(_upd("x", v0)))  # -> v1
    buf.k = 3
    buf.admit("a", encode_update(_upd("a", v0, seed=1)))  # from v0
    # the same member again, now from v1 (a newer base: not a replay, still a second update)
    _refused(buf, "a", encode_update(_upd("a", buf.current, seed=2)), Refusal.DUPLICATE)
    assert list(buf.pending) == ["a"]


def test_forged_update_is_refused():
    v0 = _v0()
    buf = Buffer(v0, buffer=1, max_staleness=5)
    _refused(buf, "mallory", encode_update(_upd("a", v0)), Refusal.FORGED)  # signed by mallory, names a
    assert buf.current.version == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_update_is_refused(bad):
    v0 = _v0()
    d = np.zeros(L, np.float32)
    d[5] = bad
    buf = Buffer(v0, buffer=1, max_staleness=5)
    _refused(buf, "a", encode_update(_upd("a", v0, delta=d)), Refusal.NON_FINITE)
    assert buf.current.version == 0 and np.isfinite(buf.current.params).all()


def test_oversized_and_malformed_updates_are_refused():
    v0 = _v0()
    buf = Buffer(v0, buffer=1, max_staleness=5)
    _refused(buf, "a", encode_update(_upd("a", v0, delta=np.zeros(L + 1, np.float32))), Refusal.OVERSIZED)
    _refused(buf, "a", b"FU\x01\xff\xff\xff\xff", Refusal.MALFORMED)
    _refused(buf, "a", b"not an update", Refusal.MALFORMED)
    assert buf.current.version == 0


def test_update_from_another_fork_is_refused():
    v0 = _v0()
    buf = Buffer(v0, buffer=1, max_staleness=5)
    other = initial_version(np.zeros(L, np.float32))
    _refused(buf, "a", encode_update(_upd("a", other)), Refusal.FORKED)


def test_outlier_is_left_out_of_the_version():
    v0 = _v0()
    buf = Buffer(v0, buffer=3, max_staleness=5, outlier_factor=10)
    buf.admit("a", encode_update(_upd("a", v0, seed=1)))
    buf.admit("b", encode_update(_upd("b", v0, seed=2)))
    v1 = buf.admit("c", encode_update(_upd("c", v0, delta=np.full(L, 1e3, np.float32))))
    assert v1 is not None and "c" in v1.excluded
    assert np.abs(v1.params - v0.params).max() < 1.0


class _Link:
    """A pub/sub link in memory: what the aggregator publishes, and its subscription's callback."""

    swarm = "s"

    def __init__(self):
        self.published, self.callbacks = [], {}

    def publish(self, topic, payload, *, retain=False, qos=1):
        self.published.append((topic, bytes(payload), retain))

    def subscribe(self, filter, callback, **kw):
        self.callbacks[filter] = callback

        class _Sub:
            def cancel(self):
                pass

        return _Sub()


def test_aggregator_resumes_its_version_after_a_restart(tmp_path):
    from federation import topics
    from federation.asyncagg import Aggregator, FileVersionStore

    v0, state = _v0(), tmp_path / "fleet.async-version"
    link = _Link()
    agg = Aggregator(link, v0, buffer=1, max_staleness=2, refresh_s=0, store=FileVersionStore(state)).start()
    deliver = link.callbacks[topics.async_updates_all("s")]
    deliver(topics.async_update("s", "a"), encode_update(_upd("a", v0)))
    deliver(topics.async_update("s", "junk"), b"junk")  # refused, counted, nothing raised
    assert agg.current.version == 1 and agg.status()["refused"] == {"malformed": 1}
    assert link.published[-1][0] == topics.async_version("s") and link.published[-1][2]  # retained
    v1 = agg.current
    agg.close()
    # a restarted fleet starts from its version 1, not from version 0 (which every node is past)
    link2 = _Link()
    agg2 = Aggregator(link2, v0, buffer=1, max_staleness=2, refresh_s=0,
                      store=FileVersionStore(state)).start()
    assert agg2.current.sha256 == v1.sha256 and agg2.current.version == 1
    assert decode_version(link2.published[0][1]).version == 1
    deliver2 = link2.callbacks[topics.async_updates_all("s")]
    deliver2(topics.async_update("s", "b"), encode_update(_upd("b", v1)))
    assert agg2.current.version == 2


def test_update_from_a_future_version_is_refused():
    v0 = _v0()
    buf = Buffer(v0, buffer=1, max_staleness=5)
    ahead = aggregate(v0, [_upd("x", v0)])  # a version 1 the aggregator never made
    _refused(buf, "a", encode_update(_upd("a", ahead)), Refusal.FUTURE)
    assert buf.current.version == 0


def test_aggregator_refuses_a_model_too_large_for_one_message():
    from federation.asyncagg import Aggregator
    from federation.errors import FederationError

    with pytest.raises(FederationError, match="does not fit"):
        Aggregator(_Link(), initial_version(np.zeros(600_000, np.float32)), buffer=2, max_staleness=2)


def test_a_resent_update_is_a_no_op_and_survives_a_lost_buffer():
    v0 = _v0()
    buf = Buffer(v0, buffer=2, max_staleness=5)
    a = encode_update(_upd("a", v0, seed=1))
    assert buf.admit("a", a) is None
    assert buf.admit("a", a) is None and not buf.refused  # the same update again: nothing new
    # the aggregator restarts (its buffer lost); a's resend and b's update make version 1
    buf = Buffer(v0, buffer=2, max_staleness=5)
    assert buf.admit("a", a) is None
    assert buf.admit("b", encode_update(_upd("b", v0, seed=2))).version == 1


def test_a_closed_aggregator_makes_no_version_from_what_the_link_still_delivers():
    """The MQTT subscription hands updates to the aggregator on its own worker, which may still
    hold some when close() is called (the fleet lost the lead or stops). close() returns only
    after an update being taken is stored and published, and any later one makes nothing:
    otherwise the fleet's last version (the one a new leader resumes from, the one the nodes
    settle on) would move after close, and a demoted process could publish a second version of
    one number (PROTOCOL.md sections 12 and 13)."""
    import threading

    from federation import topics
    from federation.asyncagg import Aggregator

    class _SlowStore:
        def __init__(self):
            self.saved, self.saving, self.release = [], threading.Event(), threading.Event()

        def load(self):
            return None

        def save(self, data):
            self.saving.set()
            assert self.release.wait(30)
            self.saved.append(data)

    v0, link, store = _v0(), _Link(), _SlowStore()
    agg = Aggregator(link, v0, buffer=1, max_staleness=2, refresh_s=0, store=store).start()
    deliver = link.callbacks[topics.async_updates_all("s")]
    update = (topics.async_update("s", "a"), encode_update(_upd("a", v0)))
    taking = threading.Thread(target=deliver, args=update)
    taking.start()
    assert store.saving.wait(30)  # version 1 is being stored (under the aggregator's lock)
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (agg.close(), closed.set()))
    closer.start()
    assert not closed.wait(0.2)  # close() waits for the update being taken
    store.release.set()
    closer.join(30)
    taking.join(30)
    assert closed.is_set() and agg.current.version == 1 and len(store.saved) == 1
    published = len(link.published)
    assert decode_version(link.published[-1][1]).version == 1
    # an update the subscription still had queued arrives after close(): nothing changes
    deliver(topics.async_update("s", "b"), encode_update(_upd("b", agg.current, seed=2)))
    assert agg.current.version == 1 and len(store.saved) == 1 and len(link.published) == published
