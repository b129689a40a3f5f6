"""Asynchronous rounds survive the leading fleet process (issue 28 items 4 and 5): two real
``fractal fleet --async-params`` processes on one PostgreSQL and one Mosquitto; only the leader
aggregates (the follower's GET /api/async answers 503). The leader is SIGKILLed with an update in
its buffer; the follower takes the lead, resumes from the version stored in the database, takes
the member's resent update and publishes the next version. Every version seen on the wire, before
and after, has one set of bytes per number."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import numpy as np
import pytest

from deploy.keys import provision
from federation import topics
from federation.asyncagg import AsyncMember
from federation.asyncbuf import decode_version
from federation.signed import load_identity
from tests.fleet.test_fleet_failover import AUTH, FleetProc, wait_for

pytestmark = pytest.mark.mosquitto

SIZE = 64


def _async(proc: FleetProc) -> httpx.Response:
    return httpx.get(proc.base + "/api/async", headers=AUTH, timeout=5)


def test_follower_takes_over_async_aggregation(broker, pg_url, swarm_id, mqtt_link_factory, tmp_path):
    members = ["m-a", "m-b"]
    keys = tmp_path / "keys"
    provision(keys, swarm_id, [*members, "watch"])
    np.savez(tmp_path / "params.npz", p0000=np.zeros(SIZE, np.float32))
    extra = ("--key", str(keys / "keys/fleet.key"), "--keyring", str(keys / "keyring.json"),
             "--async-params", str(tmp_path / "params.npz"), "--async-buffer", "2",
             "--async-max-staleness", "2")

    def signed(name: str):
        ident = load_identity(keys / f"keys/{name}.key", keys / "keyring.json")
        return ident.link(mqtt_link_factory(broker, name))

    # every version published on the wire, verified (fleet-signed) and hash-checked
    wire: dict[int, set[str]] = {}
    lock = threading.Lock()

    def seen(_topic: str, payload: bytes) -> None:
        v = decode_version(payload, size=SIZE)
        with lock:
            wire.setdefault(v.version, set()).add(v.sha256)

    signed("watch").subscribe(topics.async_version(swarm_id), seen)

    a = FleetProc(broker.url, swarm_id, pg_url, extra)
    procs = [a]
    try:
        a.ready()
        wait_for(lambda: a.role() == "leader", 30, "the first fleet process leads")
        b = FleetProc(broker.url, swarm_id, pg_url, extra)
        procs.append(b)
        b.ready()
        assert b.role() == "follower"
        r = _async(b)
        assert r.status_code == 503 and a.base in r.text, r.text  # only the leader aggregates

        ma, mb = (AsyncMember(signed(m), m, SIZE).start() for m in members)
        # two versions at the first leader
        for k in range(2):
            va, vb = ma.wait_version(k, timeout=20), mb.wait_version(k, timeout=20)
            ma.publish_update(va, va.params + 1.0, samples=10)
            mb.publish_update(vb, vb.params - 0.5, samples=30)
        v2 = ma.wait_version(2, timeout=20)
        before = {v["version"]: v["sha256"] for v in _async(a).json()["versions"]}
        assert before[2] == v2.sha256
        # a's update from version 2 waits in the leader's buffer when the leader dies
        ma.publish_update(v2, v2.params + 0.25, samples=10)
        wait_for(lambda: _async(a).json()["pending"] == ["m-a"], 20, "a's update in the leader's buffer")

        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        wait_for(lambda: b.role() == "leader", 30, "the follower takes the lead")
        state = wait_for(lambda: (r := _async(b)).status_code == 200 and r.json(), 30,
                         "async at the new leader")
        takeover_s = time.monotonic() - t0
        print(f"\nasync failover: leader SIGKILLed -> the follower aggregates in {takeover_s:.2f} s")
        assert state["version"] == 2 and state["sha256"] == v2.sha256, state  # resumed, not version 0
        assert state["pending"] == []  # the dead leader's buffer is lost ...

        ma.resend()  # ... and the member's resent update refills it
        wait_for(lambda: _async(b).json()["pending"] == ["m-a"], 20, "a's resent update at the new leader")
        mb.publish_update(mb.wait_version(2, timeout=20), v2.params - 0.25, samples=30)
        v3 = ma.wait_version(3, timeout=20)
        assert mb.wait_version(3, timeout=20).sha256 == v3.sha256
        after = _async(b).json()
        assert after["version"] == 3 and after["sha256"] == v3.sha256
        assert {c["member"] for c in after["versions"][-1]["contributors"]} == set(members)
        assert np.allclose(v3.params, v2.params + (10 * 0.25 - 30 * 0.25) / 40)

        # The watcher is another client: its copy of version 3 comes on its own delivery thread,
        # and can arrive after the members' copies (which the waits above are on).
        def has_v3() -> bool:
            with lock:
                return 3 in wire

        wait_for(has_v3, 30, "version 3 at the watcher")
        with lock:
            assert set(wire) == {0, 1, 2, 3}, wire
            assert all(len(shas) == 1 for shas in wire.values()), wire  # no number with other bytes
            assert wire[2] == {before[2]} and wire[1] == {before[1]}
        for m in (ma, mb):
            m.close()
    finally:
        for p in procs:
            p.close()
