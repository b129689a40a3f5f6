"""Latency of the direct allreduce with and without waiting for its ACKs (PROTOCOL.md section 5).

    python -m bench.linger [--nodes 3] [--size 4810] [--calls 20] [--delay-ms 20] [--repeats 5]

N members (threads) over the in-memory hub, every message delayed by ``--delay-ms`` (a link's
latency; the machine's CPU stays out of it), run ``--calls`` direct allreduces of ``--size``
floats back to back, as a round's steps do: once with the calls lingering (the default: a call
returns once every row is in) and once draining (it also waits for the ACKs of its own rows, the
behaviour before), alternating repeat by repeat in the same run. Reports the median seconds per
call of each, the ratio, the ideal (one message latency per call) and whether both gave the same
bits. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import numpy as np

from bench.host import machine

__all__ = ["run"]


def _calls(linger: bool, nodes: int, size: int, calls: int, delay: float, tag: str) -> tuple[float, bytes]:
    """Seconds per call (the slowest member's) and the last result's bytes."""
    from federation.memory import MemoryHub
    from federation.ring import RingAllreduce

    ids = [f"m{k}" for k in range(nodes)]
    hub = MemoryHub()
    rings = {i: RingAllreduce(hub.transport(i, delay=delay), swarm="bench", linger=linger) for i in ids}
    rng = np.random.default_rng(0)
    vecs = {i: rng.standard_normal(size).astype(np.float32) for i in ids}
    took: dict[str, float] = {}
    out: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def member(i: str) -> None:
        try:
            t0 = time.perf_counter()
            for k in range(calls):
                res = rings[i].allreduce(vecs[i], group=ids, tag=f"{tag}/{k}", timeout=30, algorithm="direct")
            took[i] = time.perf_counter() - t0
            out[i] = np.asarray(res, np.float32).tobytes()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in rings.values():
        r.close()
    if errors:
        raise errors[0]
    if len(set(out.values())) != 1:
        raise AssertionError("members ended with different bits")
    return max(took.values()) / calls, next(iter(out.values()))


def run(nodes: int = 3, size: int = 4810, calls: int = 20, delay_ms: float = 20.0,
        repeats: int = 5) -> dict[str, Any]:
    delay = delay_ms / 1000.0
    per: dict[str, list[float]] = {"linger": [], "drain": []}
    bits: dict[str, bytes] = {}
    for rep in range(repeats):
        for mode in (("linger", "drain") if rep % 2 == 0 else ("drain", "linger")):
            s, b = _calls(mode == "linger", nodes, size, calls, delay, f"{mode}-{rep}")
            per[mode].append(s)
            bits[mode] = b
    lin, dra = statistics.median(per["linger"]), statistics.median(per["drain"])
    return {"nodes": nodes, "elements": size, "calls": calls, "delay_ms": delay_ms, "repeats": repeats,
            "linger_s_per_call": round(lin, 5), "drain_s_per_call": round(dra, 5),
            "linger_over_drain": round(lin / dra, 4), "ideal_s_per_call": delay,
            "linger_runs_s": [round(v, 5) for v in per["linger"]],
            "drain_runs_s": [round(v, 5) for v in per["drain"]],
            "same_bits": bits["linger"] == bits["drain"], "machine": machine()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--size", type=int, default=4810, help="floats per member (default: digits-mlp's)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--delay-ms", type=float, default=20.0, help="latency added to every message")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if a.nodes < 2 or a.size < 1 or a.calls < 1 or a.repeats < 1 or not a.delay_ms >= 0:
        p.error("need --nodes >= 2, --size >= 1, --calls >= 1, --repeats >= 1, --delay-ms >= 0")
    print(json.dumps(run(a.nodes, a.size, a.calls, a.delay_ms, a.repeats)))


if __name__ == "__main__":
    main()
