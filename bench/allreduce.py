"""`fractal bench allreduce`: ring vs star vs raw broker throughput, all in one run, one broker.

Every member is a separate OS process (``spawn``) with its own :class:`MqttLink`, as on a real
swarm: no shared GIL, each process pays its own paho, framing and numpy costs. Processes start
each timed call together on a barrier; a call's time is ``max(end) - min(start)`` over members
(wall clock, same host). The raw broker figure is one publisher process and one subscriber
process moving QoS 1 messages of ``max_payload`` bytes through the same broker, just before the
allreduce runs. Vectors are seeded per member; the parent recomputes the float64 mean with
numpy and compares it with member 0's result; every member's result hash must agree.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench.host import machine_line
from bench.paired import paired_overhead
from federation.errors import FederationError
from federation.ringmac import gmac_describe

__all__ = ["run_allreduce_bench", "raw_broker_throughput", "ideal_bytes_per_node"]

_SEED = 1234


def ideal_bytes_per_node(nodes: int, elements: int, itemsize: int = 4, algorithm: str = "ring") -> float:
    """What each member must send: 2(N-1)/N x elements x 4 bytes around the ring (bandwidth-optimal),
    (N-1) x elements x 4 bytes on the direct path (latency-optimal: one hop)."""
    if algorithm == "direct":
        return (nodes - 1) * elements * itemsize
    return 2 * (nodes - 1) / nodes * elements * itemsize


# --algorithm -> RingAllreduce(direct_max_bytes=...)
ALGORITHMS = {"auto": None, "ring": 0, "direct": 1 << 62}


def _vector(rank: int, elements: int) -> np.ndarray:
    return np.random.default_rng(_SEED + rank).standard_normal(elements).astype(np.float32)


# --- raw pub/sub ----------------------------------------------------------------------------------
def _raw_sub(url: str, topic: str, count: int, ready, out) -> None:
    import threading

    from federation.mqtt import MqttLink

    got = [0]
    done = threading.Event()

    def on(t: str, p: bytes) -> None:
        got[0] += 1
        if got[0] == count:
            out.put(("end", time.time()))
            done.set()

    with MqttLink(url, client_id=f"bench-rawsub-{uuid.uuid4().hex[:8]}") as link:
        link.subscribe(topic, on, inline=True)
        ready.set()
        if not done.wait(120):
            out.put(("lost", got[0]))


def _raw_pub(url: str, topic: str, count: int, size: int, go, out) -> None:
    from federation.mqtt import MqttLink

    payload = os.urandom(size)
    with MqttLink(url, client_id=f"bench-rawpub-{uuid.uuid4().hex[:8]}") as link:
        go.wait(30)
        out.put(("start", time.time()))
        infos = [link.publish(topic, payload) for _ in range(count)]
        for info in infos:
            info.wait_for_publish(60)


def raw_broker_throughput(url: str, *, size: int, count: int) -> float:
    """MB/s of ``count`` QoS 1 messages of ``size`` bytes, one publisher -> broker -> one subscriber
    (separate processes). ``count`` stays under Mosquitto's default queue (1000) so nothing drops."""
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Event()
    topic = f"fractal/v1/bench-{uuid.uuid4().hex[:8]}/raw"
    sub = ctx.Process(target=_raw_sub, args=(url, topic, count, ready, out), daemon=True)
    sub.start()
    deadline = time.monotonic() + 60
    while not ready.wait(0.1):
        if not sub.is_alive() or time.monotonic() > deadline:
            sub.kill()
            raise FederationError("raw throughput subscriber did not start (see its error above)")
    pub = ctx.Process(target=_raw_pub, args=(url, topic, count, size, ready, out), daemon=True)
    pub.start()
    marks: dict[str, float] = {}
    try:
        while len(marks) < 2:
            kind, value = out.get(timeout=180)
            if kind == "lost":
                raise FederationError(f"raw throughput: only {value} of {count} messages arrived",
                                      hint="the broker drops QoS 1 messages: raise its max_queued_messages")
            marks[kind] = value
    finally:
        pub.join(30)
        sub.join(30)
        for p in (pub, sub):
            if p.is_alive():
                p.kill()
    return size * count / (marks["end"] - marks["start"]) / 1e6


# --- allreduce members ----------------------------------------------------------------------------
def _proc_cpu(pid: int | None) -> float:
    """user + system CPU seconds of process ``pid`` (Linux /proc); 0.0 if unknown."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _bench_key(swarm: str, member: str):
    """A deterministic ed25519 key per benchmark member (benchmark only: not a secret)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"{swarm}/{member}".encode()).digest())


def _bench_dh(swarm: str, member: str):
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    return X25519PrivateKey.from_private_bytes(hashlib.sha256(f"dh/{swarm}/{member}".encode()).digest())


def _member(url: str, swarm: str, rank: int, nodes: int, elements: int, compression: str, max_payload: int,
            repeats: int, timeout: float, outdir: str, barrier, out, broker_pid: int | None = None,
            signed: bool = False, algorithm: str = "auto") -> None:
    from federation.mqtt import MqttLink
    from federation.ring import RingAllreduce
    from federation.star import StarAllreduce
    from fractal.heap import tune_allocator

    tune_allocator()  # as every `fractal` process does (a spawned member does not run the CLI)
    ids = [f"m{i}" for i in range(nodes)]
    me = ids[rank]
    vec = _vector(rank, elements)
    report: dict[str, Any] = {"rank": rank, "ring": [], "star": [], "signed": []}
    direct = ALGORITHMS[algorithm]
    path: dict[str, Any] = {} if direct is None else {"direct_max_bytes": direct}
    with MqttLink(url, swarm=swarm, client_id=f"{swarm}-{me}") as link:
        # Keep ~4 MiB unacknowledged per peer whatever the frame size: 16 x 1 MiB frames queue
        # so long behind each other that their ACKs outlive the 1 s retransmit timer.
        window = max(2, min(16, (4 << 20) // max_payload))
        ring = RingAllreduce(link.transport(me, max_payload=max_payload), swarm=swarm, max_in_flight=window,
                             **path)
        report["algorithm"] = ring.algorithm(nodes, elements, compression)
        star = StarAllreduce(link.transport(f"{me}-star", max_payload=max_payload), swarm=swarm,
                             max_in_flight=window)
        barrier.wait(120)
        engines: list[tuple[str, Any, list[str]]] = [("ring", ring, ids),
                                                     ("star", star, [f"{i}-star" for i in ids])]
        if signed:  # the same ring, every frame authenticated (federation/signed.py, ringmac.py)
            from federation.auth import KeyEntry, Keyring, Role, Signer
            from federation.signed import Identity

            sig_ids = [f"{i}-sig" for i in ids]
            keyring = Keyring([KeyEntry(f"{i}-k", i, Role.NODE, _bench_key(swarm, i).public_key(),
                                        _bench_dh(swarm, i).public_key()) for i in sig_ids], swarm=swarm)
            me_sig = f"{me}-sig"
            slink = Identity(Signer(me_sig, f"{me_sig}-k", _bench_key(swarm, me_sig)), keyring,
                             _bench_dh(swarm, me_sig)).link(link)
            sring = RingAllreduce(slink.transport(f"{me}-sig", max_payload=max_payload), swarm=swarm,
                                  max_in_flight=window, **path)
            engines.insert(1, ("signed", sring, sig_ids))
        # Plain and signed rings alternate repeat by repeat so that a change in the machine's load
        # hits both alike, and which goes first alternates too (ring, signed; signed, ring; ...):
        # the second call of a pair runs on the first one's freed memory and lingering traffic,
        # which at 10M elements alone made a fixed order look like a 10% cost. The star runs after.
        pair = [e for e in engines if e[0] != "star"]
        order = [(rep, e) for rep in range(repeats) for e in (pair if rep % 2 == 0 else pair[::-1])]
        order += [(rep, e) for rep in range(repeats) for e in engines if e[0] == "star"]
        for rep, (name, engine, group) in order:
            before = engine.stats.bytes_sent
            barrier.wait(300)
            b0 = _proc_cpu(broker_pid) if rank == 0 else 0.0
            c0, t0 = time.process_time(), time.time()
            res = engine.allreduce(vec, group=group, tag=f"{name}-{rep}", op="mean", timeout=timeout,
                                   compression=compression)
            t1, c1 = time.time(), time.process_time()
            b1 = _proc_cpu(broker_pid) if rank == 0 else 0.0
            report[name].append({"start": t0, "end": t1, "bytes": engine.stats.bytes_sent - before,
                                 "cpu": c1 - c0, "broker_cpu": b1 - b0,
                                 "sha256": hashlib.sha256(res.tobytes()).hexdigest()})
            if rep == repeats - 1:
                if rank == 0:
                    np.save(Path(outdir) / f"{name}.npy", res)
                report[f"{name}_stats"] = {k: v for k, v in vars(engine.stats).items() if isinstance(v, int)}
        barrier.wait(300)  # nobody leaves while a peer may still need an ACK from it
    out.put(report)


def _summarise(reports: list[dict], name: str) -> tuple[float, list[float], float, bool, float, float] | None:
    """-> (median seconds, all seconds, bytes per member, bit-identical, median CPU s of all members,
    median CPU s of the broker (0 when the benchmark did not start it))."""
    runs = [r[name] for r in reports]
    if not runs[0]:
        return None
    reps = range(len(runs[0]))
    secs = [max(r[i]["end"] for r in runs) - min(r[i]["start"] for r in runs) for i in reps]
    per_node = statistics.mean(r[-1]["bytes"] for r in runs)
    identical = all(len({r[i]["sha256"] for r in runs}) == 1 for i in reps)
    cpu = statistics.median(sum(r[i]["cpu"] for r in runs) for i in reps)
    broker_cpu = statistics.median(runs[0][i].get("broker_cpu", 0.0) for i in reps)
    return statistics.median(secs), secs, per_node, identical, cpu, broker_cpu


def run_allreduce_bench(nodes: int, elements: int, *, broker_url: str | None = None,
                        compression: str = "none", max_payload: int = 256 * 1024, repeats: int = 3,
                        timeout: float | None = None, signed: bool = False,
                        algorithm: str = "auto") -> dict[str, Any]:
    """Run the benchmark and return one JSON-able dict (see ``fractal bench allreduce --help``).
    ``signed``: also time the ring with signed frames (same members, same run). ``algorithm``:
    ``auto`` (the engine's choice: the direct path for small F32 vectors), ``ring`` or ``direct``."""
    if algorithm not in ALGORITHMS:
        raise FederationError(f"unknown algorithm {algorithm!r}", hint="use auto, ring or direct")
    if algorithm == "direct" and compression != "none":
        raise FederationError("the direct path sends float32 only", hint="drop --compression or use ring")
    if not 2 <= nodes <= 64:
        raise FederationError(f"--nodes must be between 2 and 64, got {nodes}")
    if not 1 <= elements <= 200_000_000:
        raise FederationError(f"--size must be between 1 and 200M elements, got {elements}")
    if repeats < 1:
        raise FederationError("--repeats must be >= 1")
    from federation.broker import start_mosquitto

    own = None
    if broker_url is None:
        own = start_mosquitto()
        broker_url = own.url
    else:  # fail here, with one clear line, rather than in N child processes
        from federation.mqtt import MqttLink

        MqttLink(broker_url, client_id=f"bench-probe-{uuid.uuid4().hex[:8]}", connect_timeout=5).close()
    timeout = timeout or 60.0 + elements * nodes * 2e-6
    try:
        raw_count = int(min(800, max(64, 2 * elements * 4 // max_payload)))
        # Median of three: one run on a shared host is at the mercy of the scheduler.
        raw_runs = [raw_broker_throughput(broker_url, size=max_payload, count=raw_count) for _ in range(3)]
        broker_mb_s = statistics.median(raw_runs)
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(nodes), ctx.Queue()
        swarm = f"bench-{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryDirectory(prefix="fractal-bench-") as outdir:
            procs = [ctx.Process(target=_member, daemon=True,
                                 args=(broker_url, swarm, r, nodes, elements, compression, max_payload,
                                       repeats, timeout, outdir, barrier, out,
                                       getattr(own, "pid", None), signed, algorithm)) for r in range(nodes)]
            for p in procs:
                p.start()
            reports: list[dict[str, Any]] = []
            try:
                deadline = time.monotonic() + 120 + 2 * repeats * (timeout + 10)
                while len(reports) < nodes:
                    reports.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
            except Exception as exc:
                raise FederationError(
                    f"benchmark member failed or timed out ({len(reports)}/{nodes} reported)",
                    hint="see the members' stderr above") from exc
            finally:
                for p in procs:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
            reports.sort(key=lambda r: r["rank"])
            ref = np.zeros(elements, np.float64)
            for r in range(nodes):
                ref += _vector(r, elements)
            ref /= nodes
            ring_res = np.load(Path(outdir) / "ring.npy")
            err = float(np.abs(ring_res.astype(np.float64) - ref).max())
            star_err = None
            if (Path(outdir) / "star.npy").exists():
                star_err = float(np.abs(np.load(Path(outdir) / "star.npy").astype(np.float64) - ref).max())
    finally:
        if own is not None:
            own.close()

    ring = _summarise(reports, "ring")
    star = _summarise(reports, "star")
    sig = _summarise(reports, "signed")
    assert ring is not None
    seconds, ring_runs, per_node, identical, ring_cpu, ring_broker_cpu = ring
    signed_paired = paired_overhead(ring_runs, sig[1]) if sig else None
    path = reports[0]["algorithm"]
    ideal = ideal_bytes_per_node(nodes, elements, algorithm=path)
    return {
        "nodes": nodes,
        "elements": elements,
        "compression": compression,
        # How the "ring" engine ran this size: around the ring, or the direct path (one hop).
        "algorithm": path,
        "seconds": round(seconds, 4),
        "star_seconds": round(star[0], 4) if star else None,
        "bytes_sent_per_node": int(per_node),
        "ideal_bytes_per_node": int(ideal),
        "bytes_over_ideal": round(per_node / ideal - 1, 4) if ideal else None,
        "star_bytes_sent_per_node": int(star[2]) if star else None,
        "max_abs_error": err,
        "star_max_abs_error": star_err,
        "bit_identical": identical and (star[3] if star else True),
        "broker_mb_per_s": round(broker_mb_s, 1),
        "broker_runs_mb_per_s": [round(x, 1) for x in raw_runs],
        # Bytes every member put through the broker per second, summed over members: the load
        # the broker carried. Per member it is ring_mb_per_s / nodes.
        "ring_mb_per_s": round(nodes * per_node / seconds / 1e6, 1),
        "ring_runs_s": [round(s, 6) for s in ring_runs],
        # CPU seconds of all member processes together (every thread): wall >> cpu / cores means
        # the members waited (latency), not computed.
        "ring_cpu_s": round(ring_cpu, 3),
        "star_cpu_s": round(star[4], 3) if star else None,
        # The broker's CPU seconds during a call (only when the benchmark started the broker):
        # with members + broker on few cores, wall time ~ (ring_cpu_s + broker cpu) / cores.
        "ring_broker_cpu_s": round(ring_broker_cpu, 3) if own is not None else None,
        "star_broker_cpu_s": round(star[5], 3) if star and own is not None else None,
        "star_runs_s": [round(s, 6) for s in star[1]] if star else None,
        "retransmits": sum(r["ring_stats"].get("retransmits", 0) for r in reports),
        # --signed: the ring with ed25519-signed frames, and its cost over the unsigned ring.
        "signed_seconds": round(sig[0], 4) if sig else None,
        "signed_runs_s": [round(s, 6) for s in sig[1]] if sig else None,
        "signed_cpu_s": round(sig[4], 3) if sig else None,
        "signed_overhead": round(sig[0] / seconds - 1, 4) if sig else None,
        # per-repeat overheads (plain and signed alternate repeat by repeat): median, 95% interval
        "signed_paired_overhead": signed_paired["median"] if signed_paired else None,
        "signed_paired_overhead_ci95": signed_paired["ci95"] if signed_paired else None,
        "signed_cpu_overhead": round(sig[4] / ring_cpu - 1, 4) if sig and ring_cpu else None,
        "signed_gmac": gmac_describe() if sig else None,
        "repeats": repeats,
        "max_payload": max_payload,
        "members": "process",
        "broker": "mosquitto (started by the benchmark)" if own is not None else broker_url.split("@")[-1],
        "machine": machine_line(),
    }
