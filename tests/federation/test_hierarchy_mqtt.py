"""Two sites over bridged Mosquittos (deploy/mosquitto/site-bridge.conf, backbone.conf), real
broker processes: three members per site on their site's broker, signed frames; a hierarchical
round's mean and vote agree bit for bit on both sites, only the leaders' subtree crosses the
bridge, and a frame forged on one site is dropped by the other site's leader. Then six member
processes: a site leader SIGKILLed mid-round fails the round on every other member (nobody
returns a result or votes), and the next round, led by the next member of its site, commits."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from federation import topics
from federation.auth import KeyEntry, Keyring, Role, Signer, generate_key
from federation.backbone import backbone_transport
from federation.hierarchy import HierarchicalAllreduce, Topology
from federation.mqtt import MqttLink
from federation.ring import RingAllreduce
from federation.signed import Identity
from tests.federation.ringutil import assert_identical, run_members
from tests.fixtures_sites import wait_bridged

pytestmark = pytest.mark.mosquitto

ROOT = Path(__file__).resolve().parents[2]
SITES = {"east": ["e0", "e1", "e2"], "west": ["w0", "w1", "w2"]}


def test_two_sites_over_bridged_brokers_agree_bit_for_bit_with_signed_frames(site_brokers, swarm_id) -> None:
    _, sites = site_brokers
    wait_bridged(sites, swarm_id)
    members = [m for ms in SITES.values() for m in ms]
    keys = {m: generate_key() for m in members}
    dh = {m: X25519PrivateKey.generate() for m in members}
    keyring = Keyring([KeyEntry(f"{m}-k1", m, Role.NODE, keys[m].public_key(), dh[m].public_key())
                       for m in members], swarm=swarm_id)
    topo = Topology.from_groups(SITES)
    links, engines = {}, {}
    try:
        for s, ms in SITES.items():
            for m in ms:
                raw = MqttLink(sites[s].url, swarm=swarm_id, client_id=f"{swarm_id}-{m}")
                links[m] = Identity(Signer(m, f"{m}-k1", keys[m]), keyring, dh[m]).link(raw)
                engines[m] = HierarchicalAllreduce(
                    RingAllreduce(links[m].transport(m, max_payload=16 * 1024), swarm=swarm_id),
                    RingAllreduce(backbone_transport(links[m], m, max_payload=16 * 1024), swarm=swarm_id))
        # An attacker on the east broker forges a backbone frame to the west leader: it crosses
        # the bridge and is dropped, unsigned, by its receiver.
        attacker = MqttLink(sites["east"].url, swarm=swarm_id, client_id=f"{swarm_id}-attacker")
        attacker.publish(topics.backbone_allreduce(swarm_id, "w0"), b"\x00" * 80)
        rng = np.random.default_rng(3)
        vecs = {m: rng.standard_normal(5000).astype(np.float32) for m in members}
        res = run_members({m: (lambda m=m: engines[m].allreduce(vecs[m], topology=topo, tag="r1.s0",
                                                                op="mean", timeout=20)) for m in members})
        got = assert_identical(res)
        ref = np.mean([vecs[m].astype(np.float64) for m in members], axis=0)
        assert np.abs(got - ref).max() < 1e-5
        votes = run_members({m: (lambda m=m: engines[m].vote(True, topology=topo, tag="r1.vote", timeout=20))
                             for m in members})
        assert all(votes[m] == [] for m in members), votes
        # The leaders' ring ran across the bridge; the other members never touched the backbone.
        assert engines["w0"].backbone.stats.frames_sent > 0 and engines["e0"].backbone.stats.frames_sent > 0
        assert all(engines[m].backbone.stats.frames_sent == 0 for m in members if m not in ("e0", "w0"))
        assert sum(links["w0"].rejected.values()) >= 1
        attacker.close()
    finally:
        for e in engines.values():
            e.close()
        for link in links.values():
            link.link.close()


class _Member:
    """One ``tests/federation/hier_member.py`` process and the lines it prints."""

    def __init__(self, url: str, swarm: str, member: str, value: float) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.federation.hier_member", "--url", url, "--swarm", swarm,
             "--id", member, "--value", str(value)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("EXIT")

    def expect(self, timeout: float = 30.0) -> str:
        return self.lines.get(timeout=timeout)

    def run(self, tag: str, sites: dict, die: bool = False) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{tag} {json.dumps(sites, separators=(',', ':'))}{' DIE' if die else ''}\n")
        self.proc.stdin.flush()


def test_a_site_leader_killed_mid_round_fails_it_everywhere_and_the_next_leader_commits(
        site_brokers, swarm_id) -> None:
    _, sites = site_brokers
    wait_bridged(sites, swarm_id)
    value = {m: float(i + 1) for i, m in enumerate(m for ms in SITES.values() for m in ms)}
    procs = {m: _Member(sites[s].url, swarm_id, m, value[m]) for s, ms in SITES.items() for m in ms}
    try:
        for m, p in procs.items():
            assert p.expect() == "READY", m
        victim = "e0"  # east's leader: the lowest id of its site
        t0 = time.monotonic()
        for m, p in procs.items():
            p.run("k1", SITES, die=m == victim)
        assert procs[victim].expect() == "EXIT" and procs[victim].proc.wait(10) == -9
        for m, p in procs.items():
            if m != victim:
                line = p.expect()
                assert line.startswith("ABORTED k1"), f"{m}: {line} (a partial result)"
        assert time.monotonic() - t0 < 3.0 * 3 + 5  # each waits at most its levels' deadlines
        # The fleet leaves the dead node out; e1 now leads east.
        nxt = {s: [m for m in ms if m != victim] for s, ms in SITES.items()}
        assert Topology.from_groups(nxt).leaders() == ["e1", "w0"]
        for m in procs:
            if m != victim:
                procs[m].run("k2", nxt)
        want = np.full(20000, sum(v for m, v in value.items() if m != victim), np.float32)
        digest = hashlib.sha256(want.tobytes()).hexdigest()
        for m in procs:
            if m != victim:
                assert procs[m].expect() == f"RESULT k2 {digest} -", m  # same bytes, vote: commit
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.proc.kill()
            p.proc.wait(10)
