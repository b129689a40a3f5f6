"""The reliable frame layer under the ring: stale, early, foreign and aborted-tag frames."""

from __future__ import annotations

import time

import numpy as np
import pytest

from federation.errors import RoundAborted
from federation.framing import VERSION, FrameKind, Phase, decode, encode
from federation.memory import MemoryHub
from federation.ring import RingAllreduce


def _data(tag: str, sender: str = "x", swarm: str = "default", part: int = 0) -> bytes:
    v = np.ones(4, np.float32)
    return encode(FrameKind.DATA, Phase.REDUCE_SCATTER, swarm=swarm, tag=tag, sender=sender, part=part,
                  nparts=part + 1, count=4, total=4, payload=[v])


def _wait(pred, timeout=30.0) -> bool:
    """Until ``pred()`` (another thread's effect: the pump, the linger thread); True as soon as it
    holds, so the generous default only costs time when the test fails."""
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.005)
    return pred()


def test_foreign_swarm_and_garbage_are_rejected_and_counted() -> None:
    hub = MemoryHub()
    eng = RingAllreduce(hub.transport("a"))
    x = hub.transport("x")
    try:
        x.send("a", _data("t", swarm="other"))
        assert _wait(lambda: eng.stats.rejected == 1) and "swarm" in eng.stats.last_reject
        x.send("a", b"\x00garbage")
        assert _wait(lambda: eng.stats.rejected == 2) and "short" in eng.stats.last_reject
    finally:
        eng.close()


def test_early_buffer_is_bounded_by_tags_and_frames_are_not_acked() -> None:
    hub = MemoryHub()
    eng = RingAllreduce(hub.transport("a"), max_early_tags=2)
    x = hub.transport("x")
    try:
        for tag in ("t1", "t2", "t3"):
            x.send("a", _data(tag))
        x.send("a", _data("t3"))  # duplicate while buffered
        assert _wait(lambda: eng.stats.early == 3 and eng.stats.duplicates == 1)
        assert eng.stats.early_dropped == 1  # t1 evicted for t3
        assert x.recv(0.1) is None  # nothing acknowledged before the call starts
    finally:
        eng.close()


def test_data_for_an_aborted_tag_gets_one_abort_reply() -> None:
    hub = MemoryHub()
    eng = RingAllreduce(hub.transport("a"))
    x = hub.transport("x")
    try:
        with pytest.raises(RoundAborted):
            eng.allreduce(np.ones(4, np.float32), group=["a", "x"], tag="gone", timeout=0.1)
        while x.recv(0.05) is not None:  # the ABORT it broadcast at the deadline
            pass
        x.send("a", _data("gone"))
        x.send("a", _data("gone", part=1))
        # The reply comes from a's pump thread: wait for it (0.2 s was a race on a loaded runner),
        # then 0.2 s of quiet to see that no second one follows.
        first = x.recv(30)
        assert first is not None, "no ABORT reply to data for an aborted tag"
        replies = [decode(first)]
        while (p := x.recv(0.2)) is not None:
            replies.append(decode(p))
        assert [r.kind for r in replies] == [FrameKind.ABORT] and replies[0].tag == "gone"
    finally:
        eng.close()


def test_bad_version_frames_during_a_round_are_counted_and_do_not_stall_it() -> None:
    import struct
    import threading
    import zlib

    hub = MemoryHub()
    a, b = (RingAllreduce(hub.transport(m, max_payload=1024)) for m in "ab")
    x = hub.transport("x")
    bad = bytearray(encode(FrameKind.DATA, Phase.REDUCE_SCATTER, swarm="default", tag="live", sender="b",
                           count=4, total=4000, payload=[np.ones(4, np.float32)]))
    bad[2] = VERSION + 1  # a future format version, with a valid checksum
    struct.pack_into("<I", bad, len(bad) - 4, zlib.crc32(bytes(bad[:-4])))
    stop = threading.Event()

    def spam():
        while not stop.is_set():
            x.send("a", bytes(bad))
            time.sleep(0.001)

    t = threading.Thread(target=spam, daemon=True)
    t.start()
    try:
        v = np.arange(4000, dtype=np.float32)
        out = {}
        tb = threading.Thread(target=lambda: out.setdefault("b", b.allreduce(v, group=["a", "b"], tag="live",
                                                                              op="sum", timeout=10)))
        tb.start()
        out["a"] = a.allreduce(v, group=["a", "b"], tag="live", op="sum", timeout=10)
        tb.join(10)
        assert out["a"].tobytes() == out["b"].tobytes() == (2 * v).tobytes()
        assert a.stats.rejected > 0 and "version" in a.stats.last_reject
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()


def test_retransmissions_are_bounded_counted_and_fail_with_a_typed_error() -> None:
    from federation.errors import RetriesExhausted
    from federation.session import Endpoint

    hub = MemoryHub()
    ep = Endpoint(hub.transport("a"), retransmit_after=0.01, max_retransmits=3)
    silent = hub.transport("b")  # never acknowledges
    try:
        with pytest.raises(RetriesExhausted) as exc, ep.call("t", ["b"], timeout=30) as c:
            c.queue("b", ("k", 0), lambda: _data("t", sender="a"))
            while True:
                c.wait("b")
        assert isinstance(exc.value, RoundAborted) and exc.value.member == "b" and exc.value.hint
        assert "after 3 retransmissions" in str(exc.value)
        assert ep.stats.retransmits == 3 and ep.stats.retries_exhausted == 1
        # b saw the frame once plus three retransmissions, then the call's ABORT naming it
        kinds = []
        while (buf := silent.recv(0.5)) is not None:
            kinds.append(decode(buf).kind)
        assert kinds == [FrameKind.DATA] * 4 + [FrameKind.ABORT]
    finally:
        ep.close()
        silent.close()


def test_max_retransmits_must_not_be_negative() -> None:
    from federation.session import Endpoint

    with pytest.raises(ValueError, match="max_retransmits"):
        Endpoint(MemoryHub().transport("a"), max_retransmits=-1)


def test_acks_wait_for_company_until_the_drain_or_their_delay() -> None:
    """A ring receives its frames one at a time: their acknowledgements go out as one ACK frame
    when the call drains (not one per frame), and never later than ``ack_delay`` while the
    call keeps waiting."""
    import threading

    from federation.framing import ack_keys
    from federation.session import Endpoint

    hub = MemoryHub()
    ep = Endpoint(hub.transport("a"), retransmit_after=60, ack_delay=30)
    x = hub.transport("x")
    try:
        with ep.call("t", ["x"], timeout=30) as c:
            for part in range(3):  # each frame arrives after the previous one was handled
                x.send("a", _data("t", part=part))
                while (fr := c.wait("x")) is None:
                    pass
                assert fr.part == part
            c.drain()
        acks = [decode(p) for p in iter(lambda: x.recv(0.2), None)]
        assert [f.kind for f in acks] == [FrameKind.ACK] and len(list(ack_keys(acks[0]))) == 3
        assert ep.stats.acks_sent == 1
    finally:
        ep.close()

    ep = Endpoint(hub.transport("b"), retransmit_after=60, ack_delay=0.05)
    y = hub.transport("y")
    try:
        with ep.call("u", ["y"], timeout=30) as c:
            y.send("b", _data("u", sender="y"))
            stop = threading.Event()

            def keep_waiting() -> None:  # for a second frame that does not come
                while not stop.is_set():
                    c.wait("y", raise_on_deadline=False)

            t = threading.Thread(target=keep_waiting, daemon=True)
            t.start()
            ack = y.recv(10)  # well before the call ends
            stop.set()
            c.inbox.put(None)  # wake the waiting thread (what cancel() does) so that it sees stop
            t.join(10)
            assert not t.is_alive()
        assert ack is not None and decode(ack).kind == FrameKind.ACK
    finally:
        ep.close()
    with pytest.raises(ValueError, match="ack_delay"):
        Endpoint(hub.transport("c"), retransmit_after=1, ack_delay=2)


def test_batched_acks_fit_the_transports_message_size() -> None:
    """A drain acknowledging many frames at once splits its ACK into messages the transport
    takes: one over ``max_payload`` was refused (a send error), so the peer's frames waited for
    retransmits (30 s timers doubling: 100 simulated members stalled for minutes)."""
    from federation.framing import ack_keys
    from federation.session import Endpoint

    hub = MemoryHub()
    # a window this wide lets a drain batch every key (as the simulated swarms' sessions do)
    ep = Endpoint(hub.transport("a", max_payload=512), retransmit_after=60, ack_delay=30, max_in_flight=4096)
    x = hub.transport("x")
    n = 200  # 200 keys of 12 bytes: well past one 512-byte message
    try:
        with ep.call("t", ["x"], timeout=30) as c:
            for part in range(n):
                x.send("a", _data("t", part=part))
            got = 0
            while got < n:
                if c.wait("x") is not None:
                    got += 1
            c.drain()
        raw = list(iter(lambda: x.recv(0.2), None))
        assert ep.stats.send_errors == 0
        assert len(raw) > 1 and all(len(p) <= 512 for p in raw)
        keys = [k for p in raw for k in ack_keys(decode(p))]
        assert sorted(k[3] for k in keys) == list(range(n))  # every frame acknowledged once
    finally:
        ep.close()


def test_a_lingering_call_returns_before_its_ack_and_the_endpoint_retransmits_after() -> None:
    """``linger()`` ends the call without waiting for acknowledgements: its unacknowledged frames
    stay with the endpoint, which retransmits them (the first copy was lost here) until the peer
    acknowledges, with no call running; the ACK of a finished call retires them."""
    from federation.framing import encode_ack
    from federation.session import Endpoint

    hub = MemoryHub()
    ep = Endpoint(hub.transport("a"), retransmit_after=0.05)
    x = hub.transport("x")
    try:
        mine = _data("t", sender="a")
        with ep.call("t", ["x"], timeout=30) as c:
            c.queue("x", decode(mine).key, lambda: mine)
            x.send("a", _data("t", sender="x"))
            while c.wait("x") is None:
                pass
            c.linger()
        assert list(ep._linger) == [("x", "t", decode(mine).key)]  # returned with its frame unacknowledged
        first = decode(x.recv(2))
        assert first.kind == FrameKind.DATA  # ... and x's ACK of x's frame: drop both, as if lost
        again = None
        while again is None or again.kind != FrameKind.DATA:
            buf = x.recv(30)
            assert buf is not None, "the lingering frame was not retransmitted"
            again = decode(buf)
        # The linger thread counts the retransmission after its send returned: x can hold the copy
        # before the counter moved.
        assert again.key == first.key and _wait(lambda: ep.stats.retransmits >= 1)  # no call running
        x.send("a", encode_ack(again, sender="x"))
        assert _wait(lambda: not ep._linger)
        n = ep.stats.retransmits
        assert not _wait(lambda: ep.stats.retransmits > n, timeout=0.3)  # acknowledged: no more copies
    finally:
        ep.close()
        x.close()


def test_lingering_frames_end_with_a_peer_abort_or_the_calls_deadline() -> None:
    from federation.framing import encode_abort
    from federation.session import Endpoint

    hub = MemoryHub()
    ep = Endpoint(hub.transport("a"), retransmit_after=0.05)
    x, y = hub.transport("x"), hub.transport("y")
    try:
        with ep.call("t", ["x", "y"], timeout=0.3) as c:
            for p in ("x", "y"):
                c.queue(p, ("k", 0), lambda: _data("t", sender="a"))
                hub_peer = x if p == "x" else y
                hub_peer.send("a", _data("t", sender=p))
            got = 0
            while got < 2:
                got += c.wait(None) is not None
            c.linger()
        assert {k[0] for k in ep._linger} == {"x", "y"}
        x.send("a", encode_abort(swarm="default", tag="t", sender="x", member="x", reason="gave up"))
        assert _wait(lambda: {k[0] for k in ep._linger} == {"y"})  # x aborted the call: nothing to resend
        # y never answers: its frame is dropped once the call's deadline and grace have passed
        # (the linger thread counts the expiry right after it removed the frame: wait for both)
        assert _wait(lambda: not ep._linger and ep.stats.linger_expired >= 1)
        assert ep.stats.linger_expired == 1
    finally:
        ep.close()
        x.close()
        y.close()


def test_a_peers_next_call_acknowledges_the_last_one_so_no_ack_messages_are_needed() -> None:
    """All-to-all calls in a row (a round's steps) need no ACK messages: a peer's DATA of the call
    we are in says it is past our finished ones, so our lingering frames to it count as
    acknowledged (also when that DATA came early, before we started the call); and our own DATA
    of the next call says as much to the peer, so the ACKs we owed it for the last call are never
    sent."""
    from federation.session import Endpoint

    hub = MemoryHub()
    a = Endpoint(hub.transport("a"), retransmit_after=60, ack_delay=30)  # no timer fires here
    x = hub.transport("x")
    try:
        mine_t, mine_u = _data("t", sender="a"), _data("u", sender="a")
        with a.call("t", ["x"], timeout=30) as c:
            c.queue("x", decode(mine_t).key, lambda: mine_t)
            x.send("a", _data("t", sender="x"))
            while c.wait("x") is None:
                pass
            c.linger()
        assert len(a._linger) == 1 and list(a._owed) == [("x", "t")]  # a's row unacked; a owes x an ACK
        assert decode(x.recv(2)).tag == "t"
        x.send("a", _data("u", sender="x"))  # x moved on: its next call's row (early for a)
        assert _wait(lambda: a.stats.early == 1) and len(a._linger) == 1  # an early tag proves nothing yet
        with a.call("u", ["x"], timeout=30) as c:
            assert not a._linger and a.stats.acks_implied == 1  # u started: x's row is u's
            c.queue("x", decode(mine_u).key, lambda: mine_u)
            while c.wait("x") is None:  # x's early row of u
                pass
            c.linger()
        assert a.stats.acks_skipped == 1 and ("x", "t") not in a._owed
        got = [decode(b) for b in iter(lambda: x.recv(0.2), None)]
        assert [(f.kind, f.tag) for f in got] == [(FrameKind.DATA, "u")]  # no ACK for t, ever
        assert a.stats.acks_sent == 0 and a.stats.retransmits == 0
    finally:
        a.close()

    # The ACKs owed to a peer that gets nothing more from us go out ack_delay later.
    b = Endpoint(hub.transport("b"), retransmit_after=60, ack_delay=0.05)
    y = hub.transport("y")
    try:
        t0 = time.monotonic()  # before b handles y's frame: the ACK is due ack_delay after that
        with b.call("t", ["y"], timeout=30) as c:
            y.send("b", _data("t", sender="y"))
            while c.wait("y") is None:
                pass
            c.linger()
        ack = y.recv(30)
        # not at once... (was `y.recv(0.01) is None` here: a test thread descheduled for 50 ms after
        # the call found the correctly delayed ACK already there)
        assert time.monotonic() - t0 >= b.ack_delay
        assert ack is not None and decode(ack).kind == FrameKind.ACK and decode(ack).tag == "t"
        assert b.stats.acks_sent == 1 and not b._owed
    finally:
        b.close()


def test_a_stale_frame_of_a_tag_never_run_does_not_count_as_moving_on() -> None:
    """A DATA frame of a tag this member has not started may be a stale one it never runs (a
    failed round's later step, delivered late after a partition healed): it must not retire our
    frames to its sender, which may still need them."""
    from federation.session import Endpoint

    hub = MemoryHub()
    a = Endpoint(hub.transport("a"), retransmit_after=0.05)
    x = hub.transport("x")
    try:
        mine = _data("t", sender="a")
        with a.call("t", ["x"], timeout=30) as c:
            c.queue("x", decode(mine).key, lambda: mine)
            x.send("a", _data("t", sender="x"))
            while c.wait("x") is None:
                pass
            c.linger()
        x.send("a", _data("old-round/7", sender="x"))  # stale: a never runs that tag
        assert _wait(lambda: a.stats.early == 1)
        assert len(a._linger) == 1 and a.stats.acks_implied == 0
        again = None  # x lost a's row: a keeps retransmitting it until x acknowledges
        while again is None or again.kind != FrameKind.DATA or a.stats.retransmits < 1:
            buf = x.recv(30)
            assert buf is not None, "the lingering frame was not retransmitted"
            again = decode(buf)
        assert again.tag == "t"
    finally:
        a.close()


@pytest.mark.parametrize("first", ["x", "y"])
def test_a_call_starved_past_its_deadline_blames_by_arrival(first: str) -> None:
    """At a deadline the call blames, of the peers it still waits for, the one heard from least
    recently: by when their frames *arrived*, so a call whose thread got the CPU only after its
    deadline (a loaded board: the frames wait in its inbox, unhandled) still names the peer that
    went silent first, not whichever comes first in its list."""
    from federation.session import Endpoint

    hub = MemoryHub()
    ep = Endpoint(hub.transport("a"))
    peers = {p: hub.transport(p) for p in ("x", "y")}
    second = "y" if first == "x" else "x"
    try:
        with pytest.raises(RoundAborted) as err, ep.call("t", ["x", "y"], timeout=0.3) as c:
            peers[first].send("a", _data("t", sender=first))
            assert _wait(lambda: c.inbox.qsize() == 1)  # routed before the second one is sent
            peers[second].send("a", _data("t", sender=second))
            assert _wait(lambda: c.inbox.qsize() == 2)
            assert _wait(lambda: time.monotonic() >= c.deadline, timeout=5)  # the thread wakes late
            c.wait(lambda: ["x", "y"])
        assert err.value.member == first, err.value
    finally:
        ep.close()
        for t in peers.values():
            t.close()


def test_a_peers_abort_of_a_finished_call_fails_the_next_call_of_that_round() -> None:
    """A member that relays the fleet's abort from inside a call its peer already finished (a
    lingering `hello`) sends ABORT for that tag; the peer, between calls, must not then wait for it
    in the round's next call until the deadline. Another round's calls are not touched."""
    from concurrent.futures import ThreadPoolExecutor

    from federation.framing import encode_abort

    hub = MemoryHub()
    a, c = RingAllreduce(hub.transport("a")), RingAllreduce(hub.transport("c"))
    try:
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(e.allreduce, np.ones(4, np.float32), group=["a", "c"], tag="r/hello",
                                timeout=5) for e in (a, c)]
            for f in futs:
                f.result()
        c.close()
        x = hub.transport("c")
        x.send("a", encode_abort(swarm="default", tag="r/hello", sender="c", member=None,
                                 reason="aborted by the fleet: operator"))
        assert _wait(lambda: a.stats.stale >= 1)
        t0 = time.monotonic()
        with pytest.raises(RoundAborted) as err:
            a.allreduce(np.ones(4, np.float32), group=["a", "c"], tag="r/0", timeout=10)
        assert time.monotonic() - t0 < 3, "waited for a peer that had left the round"
        assert "fleet" in str(err.value)
        # the memory is per round: another round's call waits for c as usual (its deadline)
        t0 = time.monotonic()
        with pytest.raises(RoundAborted):
            a.allreduce(np.ones(4, np.float32), group=["a", "c"], tag="q/0", timeout=0.5)
        assert time.monotonic() - t0 >= 0.5
    finally:
        a.close()
        c.close()
