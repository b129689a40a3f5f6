"""Asynchronous rounds over real Mosquitto with real member processes (issue 28 item 4): members
join at different times, the version advances, every member that commits the last version holds
the same bytes as the aggregator; a captured update replayed on the wire, an update signed by
another member and an unsigned one are dropped by the signature layer without stalling anything."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from deploy.keys import provision
from federation import topics
from federation.asyncagg import Aggregator, initial_version
from federation.asyncbuf import Update, encode_update
from federation.auth import Reject
from federation.signed import load_identity

pytestmark = pytest.mark.mosquitto

L = 5000
MEMBERS = ["a", "b", "c", "d"]


def _spawn(mosquitto, swarm_id, keys, member, seed, updates, until):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.federation.async_member", "--url", mosquitto.url, "--swarm", swarm_id,
         "--id", member, "--keys", str(keys), "--size", str(L), "--updates", str(updates),
         "--until", str(until), "--seed", str(seed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_async_members_join_late_and_commit_identical_versions(mosquitto, mqtt_link_factory, swarm_id,
                                                                tmp_path):
    keys = tmp_path / "keys"
    provision(keys, swarm_id, MEMBERS)
    fleet = load_identity(keys / "keys" / "fleet.key", keys / "keyring.json")
    flink = fleet.link(mqtt_link_factory(mosquitto, "fleet"))
    v0 = initial_version(np.zeros(L, np.float32))
    versions: list[int] = []
    reached = threading.Condition()

    def on_version(v):
        with reached:
            versions.append(v.version)
            reached.notify_all()

    agg = Aggregator(flink, v0, buffer=2, max_staleness=2, on_version=on_version).start()

    # The attacker captures a's genuine signed update on the wire.
    captured: list[bytes] = []
    got_capture = threading.Event()

    def capture(_topic, payload):
        captured.append(bytes(payload))
        got_capture.set()

    attacker = mqtt_link_factory(mosquitto, "attacker")
    attacker.subscribe(topics.async_update(swarm_id, "a"), capture)

    # 4 members x 2 updates, K = 2: exactly 4 versions. a and b are online first ...
    procs = {m: _spawn(mosquitto, swarm_id, keys, m, i, 2, 4) for i, m in enumerate(MEMBERS[:2])}
    with reached:
        assert reached.wait_for(lambda: versions, timeout=60), "no version 1"
    # ... c and d come online only after version 1 exists.
    procs |= {m: _spawn(mosquitto, swarm_id, keys, m, i + 2, 2, 4) for i, m in enumerate(MEMBERS[2:])}

    # Attacks while the swarm runs: replay a's captured update, sign an update for a with b's key
    # (b's key is valid, the topic is a's), publish an unsigned one.
    # The attacker's copy travels to another client on its own thread: version 1 can exist first.
    assert got_capture.wait(30), "the attacker never saw a's update"
    attacker.publish(topics.async_update(swarm_id, "a"), captured[0])
    b_key = load_identity(keys / "keys" / "b.key", keys / "keyring.json")
    b = b_key.link(mqtt_link_factory(mosquitto, "b-evil"))
    forged = encode_update(Update("a", 0, v0.sha256, 10, np.full(L, 1e3, np.float32)))
    b.publish(topics.async_update(swarm_id, "a"), forged)
    attacker.publish(topics.async_update(swarm_id, "c"), forged)

    out = {}
    for m, p in procs.items():
        stdout, stderr = p.communicate(timeout=90)
        assert p.returncode == 0, f"{m}: {stderr[-2000:]}"
        out[m] = [ln for ln in stdout.splitlines() if ln.startswith("COMMITTED")][-1].split()
    with reached:
        assert reached.wait_for(lambda: len(versions) >= 4, timeout=10)
    agg.close()

    final = agg.current
    assert final.version == 4 and versions == [1, 2, 3, 4]
    assert {tuple(o[1:]) for o in out.values()} == {("4", final.sha256)}
    assert np.isfinite(final.params).all() and np.abs(final.params).max() < 10  # no 1e3 forgery in it
    # Every update a version used came from a distinct member, none more than S behind.
    for rec in agg.history[1:]:
        assert len({c["member"] for c in rec.contributors}) == len(rec.contributors) == 2
        assert all(c["staleness"] <= 2 for c in rec.contributors)
    # The late members' first updates were from version >= 1.
    late = [c for rec in agg.history[1:] for c in rec.contributors if c["member"] in ("c", "d")]
    assert late and min(c["base"] for c in late) >= 1
    rejected = flink.rejected
    assert rejected[Reject.REPLAYED] >= 1 and rejected[Reject.WRONG_ROLE] >= 1
    assert rejected[Reject.UNSIGNED] >= 1
    status = agg.status()
    assert status["version"] == 4 and status["buffer"] == 2 and status["max_staleness"] == 2
