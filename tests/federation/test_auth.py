"""Signed envelopes (federation/auth.py) with real ed25519 keys: every rejection reason."""

from __future__ import annotations

import struct

import pytest

from federation import topics
from federation.auth import (
    MAGIC,
    SIG_SIZE,
    AuthRejected,
    KeyEntry,
    Keyring,
    Reject,
    Role,
    Signer,
    Verifier,
    generate_key,
    swarm_policy,
)

SWARM = "s1"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def swarm(clock):
    keys = {name: generate_key() for name in ("fleet", "node-1", "node-2")}
    entries = [KeyEntry("fleet-k1", "fleet", Role.FLEET, keys["fleet"].public_key()),
               KeyEntry("node-1-k1", "node-1", Role.NODE, keys["node-1"].public_key()),
               KeyEntry("node-2-k1", "node-2", Role.NODE, keys["node-2"].public_key())]
    ring = Keyring(entries, swarm=SWARM)
    signers = {"fleet": Signer("fleet", "fleet-k1", keys["fleet"], clock=clock),
               "node-1": Signer("node-1", "node-1-k1", keys["node-1"], clock=clock),
               "node-2": Signer("node-2", "node-2-k1", keys["node-2"], clock=clock)}
    return ring, signers, keys


def _reject(verifier: Verifier, topic: str, data: bytes) -> Reject:
    with pytest.raises(AuthRejected) as info:
        verifier.verify(topic, data)
    assert verifier.check(topic, data) is None
    return info.value.reason


CMD = topics.command(SWARM)
ST1 = topics.status(SWARM, "node-1")
AR2 = topics.allreduce(SWARM, "node-2")


def test_valid_messages_verify_and_payload_is_intact(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock)
    m = v.verify(CMD, signers["fleet"].sign(CMD, b'{"v":1,"kind":"round.start"}'))
    assert (m.sender, m.role, bytes(m.payload)) == ("fleet", Role.FLEET, b'{"v":1,"kind":"round.start"}')
    frame = bytes(range(256)) * 1000
    m = v.verify(AR2, signers["node-1"].sign(AR2, frame))
    assert m.sender == "node-1" and bytes(m.payload) == frame
    assert v.accepted == 2 and v.rejected_total() == 0


def test_unsigned_and_malformed(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock)
    assert _reject(v, CMD, b'{"v":1,"kind":"round.abort","round_id":"r","reason":"x"}') == Reject.UNSIGNED
    assert _reject(v, AR2, b"FE\x02garbage") == Reject.UNSIGNED
    assert _reject(v, CMD, MAGIC + b"\x01") == Reject.MALFORMED
    good = signers["fleet"].sign(CMD, b"{}")
    assert _reject(v, CMD, good[:30]) == Reject.MALFORMED
    assert _reject(v, CMD, good[:2] + b"\x09" + good[3:]) == Reject.MALFORMED  # version 9
    assert v.counts[Reject.UNSIGNED] == 4 and v.counts[Reject.MALFORMED] == 6


def test_wrong_topic_signature_is_bound_to_its_topic(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock)
    msg = signers["node-1"].sign(topics.status(SWARM, "node-1"), b'{"state":"offline"}')
    assert _reject(v, topics.status(SWARM, "node-2"), msg) == Reject.WRONG_TOPIC
    frame = signers["node-1"].sign(AR2, b"frame")
    assert _reject(v, topics.allreduce(SWARM, "node-3"), frame) == Reject.WRONG_TOPIC
    # Rewriting the signed topic inside the envelope breaks the signature.
    tampered = msg.replace(b"status/node-1", b"status/node-2")
    assert _reject(v, topics.status(SWARM, "node-2"), tampered) == Reject.BAD_SIGNATURE


def test_unknown_and_revoked_keys(swarm, clock):
    ring, signers, _ = swarm
    rogue = Signer("node-9", "node-9-k1", generate_key(), clock=clock)
    v = Verifier(ring, clock=clock)
    assert _reject(v, AR2, rogue.sign(AR2, b"x")) == Reject.UNKNOWN_KEY
    # A key of node-2 presented as node-1's (sender/key mismatch)
    _, _, keys = swarm
    impostor = Signer("node-1", "node-2-k1", keys["node-2"], clock=clock)
    assert _reject(v, AR2, impostor.sign(AR2, b"x")) == Reject.UNKNOWN_KEY
    ring.revoke("node-1-k1")
    assert _reject(v, AR2, signers["node-1"].sign(AR2, b"x")) == Reject.UNKNOWN_KEY


def test_bad_signature_forged_with_another_key(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock)
    # An attacker claims to be the fleet (right key id) but signs with its own key.
    forger = Signer("fleet", "fleet-k1", generate_key(), clock=clock)
    assert _reject(v, CMD, forger.sign(CMD, b'{"lr":1e30}')) == Reject.BAD_SIGNATURE
    good = bytearray(signers["fleet"].sign(CMD, b'{"lr":0.1}'))
    good[-3:] = b"1e9"  # payload changed after signing
    assert _reject(v, CMD, bytes(good)) == Reject.BAD_SIGNATURE
    good = bytearray(signers["fleet"].sign(CMD, b'{"lr":0.1}'))
    sig_at = len(good) - len(b'{"lr":0.1}') - SIG_SIZE
    good[sig_at] ^= 1
    assert _reject(v, CMD, bytes(good)) == Reject.BAD_SIGNATURE


def test_wrong_role_only_fleet_commands_and_own_topics(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock)
    assert _reject(v, CMD, signers["node-1"].sign(CMD, b"{}")) == Reject.WRONG_ROLE
    st2 = topics.status(SWARM, "node-2")
    assert _reject(v, st2, signers["node-1"].sign(st2, b"{}")) == Reject.WRONG_ROLE
    ev2 = topics.round_events(SWARM, "r1", "node-2")
    assert _reject(v, ev2, signers["node-1"].sign(ev2, b"{}")) == Reject.WRONG_ROLE
    assert _reject(v, AR2, signers["fleet"].sign(AR2, b"frame")) == Reject.WRONG_ROLE
    ar1 = topics.allreduce(SWARM, "node-1")
    assert _reject(v, ar1, signers["node-1"].sign(ar1, b"frame")) == Reject.WRONG_ROLE  # to itself
    odd = f"fractal/v1/{SWARM}/elsewhere"
    assert _reject(v, odd, signers["fleet"].sign(odd, b"{}")) == Reject.WRONG_ROLE
    ev1 = topics.round_events(SWARM, "r1", "node-1")
    assert v.check(ev1, signers["node-1"].sign(ev1, b"{}")) is not None


def test_replayed_messages(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock)
    msg = signers["fleet"].sign(CMD, b'{"kind":"round.abort"}')
    assert v.check(CMD, msg) is not None
    assert _reject(v, CMD, msg) == Reject.REPLAYED
    # Out-of-order but fresh messages are fine (the broker may reorder across topics).
    a = signers["node-1"].sign(AR2, b"a")
    b = signers["node-1"].sign(ST1, b"b")
    assert v.check(ST1, b) is not None and v.check(AR2, a) is not None
    assert _reject(v, AR2, a) == Reject.REPLAYED


def test_replay_window_is_bounded(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock, window=8)
    msgs = [signers["node-1"].sign(AR2, b"%d" % i) for i in range(20)]
    for m in msgs:
        assert v.check(AR2, m) is not None
    w = v._windows["node-1"]
    assert len(w.seen) <= 8
    for m in msgs:  # every one of them, evicted or not, is refused
        assert _reject(v, AR2, m) == Reject.REPLAYED


def test_stale_and_future_messages(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock, max_age_s=60, max_skew_s=30)
    old = signers["fleet"].sign(CMD, b"{}")
    clock.t += 61
    assert _reject(v, CMD, old) == Reject.STALE
    clock.t += 100
    future = signers["fleet"].sign(CMD, b"{}")
    clock.t -= 40
    assert _reject(v, CMD, future) == Reject.STALE


def test_last_will_exempt_from_age_but_not_replayable(swarm, clock):
    ring, signers, keys = swarm
    v = Verifier(ring, clock=clock)
    will = signers["node-1"].sign(ST1, b'{"state":"offline"}', will=True)
    assert v.check(ST1, signers["node-1"].sign(ST1, b'{"state":"online"}')) is not None
    clock.t += 3600  # connection dies an hour later: the broker publishes the will
    assert v.check(ST1, will) is not None
    assert _reject(v, ST1, will) == Reject.REPLAYED
    # A restarted node-1 (new instance, new epoch) is live; the old will must not kill it.
    restarted = Signer("node-1", "node-1-k1", keys["node-1"], clock=clock)
    assert v.check(ST1, restarted.sign(ST1, b'{"state":"online"}')) is not None
    assert _reject(v, ST1, will) == Reject.REPLAYED
    # A fresh observer (no state) accepts a retained will once.
    fresh = Verifier(ring, clock=clock)
    assert fresh.check(ST1, will) is not None


def test_counters_per_reason(swarm, clock):
    ring, signers, _ = swarm
    v = Verifier(ring, clock=clock)
    v.check(CMD, b"{}")
    v.check(CMD, signers["node-1"].sign(CMD, b"{}"))
    v.check(CMD, signers["node-1"].sign(CMD, b"{}"))
    assert v.counts == {Reject.UNSIGNED: 1, Reject.WRONG_ROLE: 2}


def test_keyring_round_trip_and_errors(swarm, tmp_path):
    ring, signers, _ = swarm
    ring.revoke("node-2-k1")
    path = tmp_path / "keyring.json"
    path.write_text(ring.to_json())
    again = Keyring.load(path)
    assert again.swarm == SWARM and again.members() == {"node-1"}
    assert again.get("node-2-k1") is None and again.get("fleet-k1").role == Role.FLEET
    with pytest.raises(Exception, match="malformed keyring"):
        Keyring.from_json('{"v":1,"keys":[{"key_id":"a"}]}')
    with pytest.raises(Exception, match="version"):
        Keyring.from_json('{"v":2,"keys":[]}')


def test_policy_table():
    assert swarm_policy(CMD, "fleet", Role.FLEET)
    assert not swarm_policy(CMD, "node-1", Role.NODE)
    assert swarm_policy(ST1, "node-1", Role.NODE)
    assert not swarm_policy(ST1, "fleet", Role.FLEET)
    assert swarm_policy(topics.ack(SWARM, "node-2"), "node-1", Role.NODE)
    assert not swarm_policy("other/v1/x/cmd", "fleet", Role.FLEET)
    # async rounds: a node publishes only its own updates; only the fleet publishes versions
    assert swarm_policy(topics.async_update(SWARM, "node-1"), "node-1", Role.NODE)
    assert not swarm_policy(topics.async_update(SWARM, "node-1"), "node-2", Role.NODE)
    assert not swarm_policy(topics.async_update(SWARM, "node-1"), "fleet", Role.FLEET)
    assert swarm_policy(topics.async_version(SWARM), "fleet", Role.FLEET)
    assert not swarm_policy(topics.async_version(SWARM), "node-1", Role.NODE)


def test_envelope_header_layout(swarm):
    _, signers, _ = swarm
    env = signers["node-1"].sign(AR2, b"payload")
    magic, version, flags, seq, epoch, slen, klen, tlen = struct.unpack_from("<2sBBQQBBH", env)
    assert (magic, version, flags, slen, klen, tlen) == (b"FS", 1, 0, 6, 9, len(AR2))
    assert env.endswith(b"payload") and len(env) == 24 + 6 + 9 + len(AR2) + 64 + 7


# --- pairwise ring MACs (federation/ringmac.py) ------------------------------------------------

@pytest.fixture(params=["openssl-context", "cryptography"])
def mac_backend(request, monkeypatch):
    """Ring MAC tests run on both GMAC implementations (federation/_gmac.c and the fallback)."""
    from federation import ringmac

    if request.param == "cryptography":
        monkeypatch.setattr(ringmac, "_MAC", ringmac._AesGcmMac)
        monkeypatch.setattr(ringmac, "_SEAL_FRAME", ringmac._py_seal_frame)
        monkeypatch.setattr(ringmac, "_OPEN_FRAME", ringmac._py_open_frame)
    return request.param


def _mac_swarm(clock):
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from federation.ringmac import RingMac

    ids = ["a", "b", "c"]
    ed = {m: generate_key() for m in ids}
    dh = {m: X25519PrivateKey.generate() for m in ids}
    ring = Keyring([KeyEntry(f"{m}-k", m, Role.NODE, ed[m].public_key(), dh[m].public_key()) for m in ids])
    macs = {m: RingMac(Signer(m, f"{m}-k", ed[m], clock=clock), dh[m], Verifier(ring, clock=clock), SWARM)
            for m in ids}
    return ring, macs, dh


def _mac_reject(mac, topic, data) -> Reject:
    with pytest.raises(AuthRejected) as info:
        mac.open(topic, data)
    return info.value.reason


def test_ring_mac_round_trip_and_rejections(clock, mac_backend):
    from federation.ringmac import RingMac

    ring, m, dh = _mac_swarm(clock)
    to_b = topics.allreduce(SWARM, "b")
    env = m["a"].seal(to_b, b"frame bytes")
    sender, payload = m["b"].open(to_b, env)
    assert (sender, bytes(payload)) == ("a", b"frame bytes")
    assert _mac_reject(m["b"], to_b, env) == Reject.REPLAYED
    assert _mac_reject(m["b"], to_b, b"FE plain frame") == Reject.UNSIGNED
    assert _mac_reject(m["c"], topics.allreduce(SWARM, "c"), m["a"].seal(to_b, b"x")) == Reject.WRONG_TOPIC
    tampered = bytearray(m["a"].seal(to_b, b"frame bytes"))
    tampered[-1] ^= 1
    assert _mac_reject(m["b"], to_b, bytes(tampered)) == Reject.BAD_SIGNATURE
    # c is a member but cannot forge a frame from a to b: it does not know K_ab.
    forger = RingMac(Signer("a", "a-k", generate_key(), clock=clock), dh["c"],
                     Verifier(ring, clock=clock), SWARM)
    assert _mac_reject(m["b"], to_b, forger.seal(to_b, b"evil")) == Reject.BAD_SIGNATURE
    # a frame for c read by b (wrong inbox) is refused
    to_c = topics.allreduce(SWARM, "c")
    assert _mac_reject(m["b"], to_c, m["a"].seal(to_c, b"x")) == Reject.WRONG_ROLE
    old = m["a"].seal(to_b, b"old")
    clock.t += 120
    assert _mac_reject(m["b"], to_b, old) == Reject.STALE
    fresh = m["a"].seal(to_b, b"after revocation")
    ring.revoke("a-k")
    m["b"].forget()  # the keyring changed: drop cached pair keys
    assert _mac_reject(m["b"], to_b, fresh) == Reject.UNKNOWN_KEY
    counts = m["b"].verifier.counts
    assert counts[Reject.BAD_SIGNATURE] == 2 and counts[Reject.UNSIGNED] == 1 and counts[Reject.STALE] == 1


def test_ring_mac_v3_trailer_every_byte_is_covered(clock, mac_backend):
    """Version 3 is a trailer after the frame; flipping any bit of the frame, the pad, the ids,
    the seq/epoch footer or the tag is refused, and older versions are MALFORMED."""
    from federation import framing
    from federation.ringmac import TAG, VERSION, room_for

    _, m, _ = _mac_swarm(clock)
    to_b = topics.allreduce(SWARM, "b")
    room = room_for("a", topics.allreduce(SWARM, ""))
    frame = framing.encode(framing.FrameKind.DATA, framing.Phase.REDUCE_SCATTER, swarm=SWARM, tag="t",
                           sender="a", count=2, total=2, payload=[b"\x00" * 8], crc=False, room=room)
    assert isinstance(frame, bytearray) and bytes(frame[-room:]) == bytes(room)
    body = len(frame) - room
    env = bytes(m["a"].seal_into(to_b, frame, room))
    assert len(env) == body + room  # sealed in place: no new bytes, the room holds pad + trailer
    (seq, epoch, slen, tlen, pad, version, magic) = struct.unpack_from("<QQBHHB2s", env, len(env) - TAG - 24)
    assert (slen, tlen, version, magic) == (1, len(to_b), VERSION, b"FM") and pad == room - 1 - len(to_b) - 40
    for i in [0, 5, body - 1, body, body + pad, len(env) - TAG - 24, len(env) - TAG - 3, len(env) - 1]:
        bad = bytearray(env)
        bad[i] ^= 0x01
        assert _mac_reject(m["b"], to_b, bytes(bad)) != Reject.REPLAYED, i  # refused, never accepted
    sender, payload = m["b"].open(to_b, env)
    assert sender == "a" and bytes(payload) == bytes(frame[:body])
    # The frame's CRC is 0 (the MAC covers it): checked, it fails; on an authenticated link it is not.
    with pytest.raises(framing.FrameError):
        framing.decode(payload)
    assert framing.decode(payload, check_crc=False).payload.tobytes() == b"\x00" * 8
    for old in (1, 2):  # older envelope versions
        bad = bytearray(env)
        bad[len(env) - TAG - 3] = old
        assert _mac_reject(m["b"], to_b, bytes(bad)) == Reject.MALFORMED


def test_ring_mac_seal_into_never_changes_a_buffer_handed_on(clock, mac_backend):
    """A retransmission (or an ABORT to several peers) re-seals a copy: the first envelope, which
    the MQTT client may still hold for a resend, stays valid; the copy has a fresh seq."""
    from federation.ringmac import room_for

    _, m, _ = _mac_swarm(clock)
    to_b, to_c = topics.allreduce(SWARM, "b"), topics.allreduce(SWARM, "c")
    room = room_for("a", topics.allreduce(SWARM, ""))
    frame = bytearray(b"FE frame bytes") + bytearray(room)
    first = m["a"].seal_into(to_b, frame, room)
    snapshot = bytes(first)
    again = m["a"].seal_into(to_b, first, room)
    other = m["a"].seal_into(to_c, first, room)
    assert again is not first and other is not first and bytes(first) == snapshot
    assert m["b"].open(to_b, snapshot)[1].tobytes() == b"FE frame bytes"
    assert m["b"].open(to_b, bytes(again))[1].tobytes() == b"FE frame bytes"  # fresh seq: not a replay
    assert m["c"].open(to_c, bytes(other))[1].tobytes() == b"FE frame bytes"
    assert _mac_reject(m["b"], to_b, snapshot) == Reject.REPLAYED
    # A sealed frame for b is no frame for c, not even with c's own room re-sealed by c.
    assert _mac_reject(m["c"], to_c, snapshot) == Reject.WRONG_TOPIC
    # Too little room: sealed into a new buffer, same format.
    env = m["a"].seal_into(to_b, bytearray(b"FE x") + bytearray(8), 8)
    assert m["b"].open(to_b, bytes(env))[1].tobytes() == b"FE x"


@pytest.mark.parametrize("size", [100, 19_000, 32 * 1024 - 400, 32 * 1024 + 1, 200_000])
def test_ring_mac_sizes_on_both_sides_of_the_fast_hash_threshold(clock, mac_backend, size):
    """Frames up to ringmac._SMALL take the backend's MAC, longer ones AESGCM: same envelope,
    so either side may use either; a changed byte anywhere is refused, a replay too."""
    import os

    from federation import framing, ringmac
    from federation.ringmac import room_for

    ring, m, dh = _mac_swarm(clock)
    to_b = topics.allreduce(SWARM, "b")
    room = room_for("a", topics.allreduce(SWARM, ""))
    body = os.urandom(size)
    frame = framing.encode(framing.FrameKind.DATA, framing.Phase.EXCHANGE, swarm=SWARM, tag="t", sender="a",
                           count=len(body), total=len(body), payload=[body], crc=False, room=room)
    env = bytes(m["a"].seal_into(to_b, bytearray(frame), room))
    sender, payload = m["b"].open(to_b, env)
    assert sender == "a" and bytes(payload) == bytes(frame[:len(frame) - room])
    assert _mac_reject(m["b"], to_b, env) == Reject.REPLAYED
    for at in (0, 50, len(env) // 2, len(env) - 41, len(env) - 1):
        bad = bytearray(m["a"].seal_into(to_b, bytearray(frame), room))
        bad[at] ^= 0x04
        assert _mac_reject(m["b"], to_b, bytes(bad)) in (Reject.BAD_SIGNATURE, Reject.MALFORMED,
                                                          Reject.UNSIGNED, Reject.WRONG_TOPIC)
    # The other backend on the receiving side reads the same envelope.
    other = (ringmac._AesGcmMac, ringmac._py_seal_frame, ringmac._py_open_frame) \
        if mac_backend == "openssl-context" else (ringmac._backend()[:3])
    saved = ringmac._MAC, ringmac._SEAL_FRAME, ringmac._OPEN_FRAME
    ringmac._MAC, ringmac._SEAL_FRAME, ringmac._OPEN_FRAME = other
    try:
        reader = ringmac.RingMac(Signer("b", "b-k", generate_key(), clock=clock), dh["b"],
                                 Verifier(ring, clock=clock), SWARM)
    finally:
        ringmac._MAC, ringmac._SEAL_FRAME, ringmac._OPEN_FRAME = saved
    env2 = bytes(m["a"].seal_into(to_b, bytearray(frame), room))
    assert bytes(reader.open(to_b, env2)[1]) == bytes(frame[:len(frame) - room])


def test_admit_in_order_fast_path_keeps_the_replay_window(clock):
    """In-order seqs take admit()'s fast path; out-of-order ones, replays, stale ones and a
    full window still get the full checks."""
    v = Verifier(Keyring([]), clock=clock, window=4)
    t0 = int(clock.t * 1e6)
    for seq in (t0 + 10, t0 + 20, t0 + 30):
        v.admit("a", seq, 1)
    v.admit("a", t0 + 15, 1)  # late but unseen: accepted (slow path)
    for seq in (t0 + 20, t0 + 15):
        with pytest.raises(AuthRejected) as info:
            v.admit("a", seq, 1)
        assert info.value.reason == Reject.REPLAYED
    v.admit("a", t0 + 40, 1)  # window full (4 entries): slow path evicts and raises the floor
    with pytest.raises(AuthRejected) as info:
        v.admit("a", t0 + 5, 1)  # below the floor now
    assert info.value.reason == Reject.REPLAYED
    clock.t += 61  # everything seen so far is older than max_age
    with pytest.raises(AuthRejected) as info:
        v.admit("a", t0 + 50, 1)
    assert info.value.reason == Reject.STALE
    v.admit("a", int(clock.t * 1e6), 1)  # fresh, in order: the old seqs are evicted
    assert list(v._windows["a"].seen) == [int(clock.t * 1e6)]
    assert v.accepted == 6 and v.counts[Reject.REPLAYED] == 3 and v.counts[Reject.STALE] == 1


def test_ring_mac_frame_naming_another_sender_is_refused_cold_and_warm(clock, mac_backend):
    """A member MACs a ring frame whose header names another member: refused as WRONG_ROLE
    whether it is the first frame of its (sender, topic) combination (full path) or one after a
    valid frame (fast path), and whatever buffer type it arrives in; valid frames still pass."""
    from federation import framing

    _, m, _ = _mac_swarm(clock)
    to_b = topics.allreduce(SWARM, "b")

    def frame(named: str) -> bytes:
        return framing.encode(framing.FrameKind.DATA, framing.Phase.REDUCE_SCATTER, swarm=SWARM, tag="t",
                              sender=named, count=1, total=1, payload=[b"\x00" * 4], crc=False)

    assert _mac_reject(m["b"], to_b, bytes(m["a"].seal(to_b, frame("c")))) == Reject.WRONG_ROLE  # cold
    sender, payload = m["b"].open(to_b, bytes(m["a"].seal(to_b, frame("a"))))
    assert sender == "a" and framing.decode(payload, check_crc=False).sender == "a"
    for wrap in (bytes, bytearray, memoryview):  # warm: bytes take the fast path, the rest the full one
        assert _mac_reject(m["b"], to_b, wrap(m["a"].seal(to_b, frame("c")))) == Reject.WRONG_ROLE
        assert m["b"].open(to_b, wrap(m["a"].seal(to_b, frame("a"))))[0] == "a"
    assert m["b"].verifier.counts[Reject.WRONG_ROLE] == 4
