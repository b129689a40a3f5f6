"""The ring over real Mosquitto with signed frames (federation/signed.py): forged DATA frames
claiming another member as sender, forged ABORTs and replayed frames are dropped and counted,
and the allreduce result is still exactly the members' sum (issue 12)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from federation import framing, topics
from federation.auth import KeyEntry, Keyring, Reject, Role, Signer, generate_key
from federation.ring import RingAllreduce
from federation.signed import Identity

pytestmark = pytest.mark.mosquitto

IDS = ["a", "b", "c"]


@pytest.fixture(params=["ed25519", "pairwise-mac"])
def swarm(request, mosquitto, mqtt_link_factory, swarm_id):
    keys = {m: generate_key() for m in IDS}
    dh = {m: X25519PrivateKey.generate() for m in IDS} if request.param == "pairwise-mac" else {}
    ring = Keyring([KeyEntry(f"{m}-k1", m, Role.NODE, keys[m].public_key(),
                             dh[m].public_key() if dh else None) for m in IDS], swarm=swarm_id)
    links, rings = {}, {}
    for m in IDS:
        ident = Identity(Signer(m, f"{m}-k1", keys[m]), ring, dh.get(m))
        links[m] = ident.link(mqtt_link_factory(mosquitto, m))
        assert (links[m].ring_mac is not None) == bool(dh)
        rings[m] = RingAllreduce(links[m].transport(m, max_payload=16 * 1024), swarm=swarm_id)
        # Every delivered frame is authenticated: no CRC check; MAC'd frames carry no CRC and are
        # built with room for the MAC trailer (sealed in place, ringmac v3).
        ep = rings[m].endpoint
        assert not ep.check_crc and ep.frame_kw["crc"] == (not dh) and (ep.frame_kw["room"] > 0) == bool(dh)
    return links, rings, keys, mqtt_link_factory(mosquitto, "attacker")


def _run(rings, vecs, tag):
    out = {}

    def go(m):
        try:
            out[m] = rings[m].allreduce(vecs[m], group=IDS, tag=tag, op="sum", timeout=20)
        except Exception as exc:  # asserted below
            out[m] = exc

    threads = [threading.Thread(target=go, args=(m,)) for m in IDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _check(out, vecs):
    ref = np.sum([vecs[m].astype(np.float64) for m in IDS], axis=0)
    for m in IDS:
        assert isinstance(out[m], np.ndarray), f"{m}: {out[m]!r}"
        assert np.abs(out[m] - ref).max() < 1e-3
    assert len({out[m].tobytes() for m in IDS}) == 1


def test_signed_ring_drops_forged_frames_and_aborts(swarm, swarm_id):
    links, rings, keys, attacker = swarm
    rng = np.random.default_rng(0)
    vecs = {m: rng.standard_normal(20_000).astype(np.float32) for m in IDS}
    # Capture genuine signed frames of a first round for a replay later.
    captured: list[bytes] = []
    got_capture = threading.Event()
    attacker.subscribe(topics.allreduce(swarm_id, "a"),
                       lambda t, p: (captured.append(bytes(p)), got_capture.set()))
    _check(_run(rings, vecs, "r0"), vecs)
    assert got_capture.wait(10), "the attacker saw none of a's frames"  # its own delivery thread

    evil = np.full(4096, 1e30, dtype=np.float32).tobytes()
    forged = [framing.encode(framing.FrameKind.DATA, framing.Phase.REDUCE_SCATTER, swarm=swarm_id, tag="r1",
                             sender="c", step=s, chunk=c, count=1024, total=20_000, offset=0,
                             payload=[evil[:4096]]) for s in range(2) for c in range(3)]
    abort = framing.encode_abort(swarm=swarm_id, tag="r1", sender="c", member="b", reason="forged")
    # b is compromised: it signs frames that claim to come from c (impersonation).
    compromised = Signer("b", "b-k1", keys["b"])
    stop = threading.Event()

    def spam():
        ta = topics.allreduce(swarm_id, "a")
        while not stop.is_set():
            for f in forged:
                attacker.publish(ta, f)  # unsigned
            attacker.publish(ta, abort)  # unsigned ABORT
            attacker.publish(ta, compromised.sign(ta, abort))  # signed by b, header says c
            attacker.publish(ta, compromised.sign(ta, forged[0]))
            for old in captured[:3]:
                attacker.publish(ta, old)  # replayed genuine frames of round r0
            stop.wait(0.01)

    t = threading.Thread(target=spam)
    t.start()
    try:
        vecs = {m: rng.standard_normal(20_000).astype(np.float32) for m in IDS}
        out = _run(rings, vecs, "r1")
    finally:
        stop.set()
        t.join()
    _check(out, vecs)
    counts = links["a"].rejected
    # The round may end before a's link has read the last spam the attacker published.
    deadline = time.monotonic() + 10
    while counts[Reject.REPLAYED] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counts[Reject.UNSIGNED] >= len(forged) + 1
    assert counts[Reject.WRONG_ROLE] >= 2
    assert counts[Reject.REPLAYED] >= 1
