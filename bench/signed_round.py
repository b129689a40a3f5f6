"""Cost of a signed swarm on a whole training round (issue 12's goal: under 5% of round time).

    python -m bench.signed_round [--nodes 3] [--steps 100] [--repeats 3] [--outlier-factor F]
                                     [--members process|thread] [--model ZOO-MODEL]
                                     [--compression none|fp16|int8|topk] [--sets K] [--control]

N real edge nodes, each with its own MQTT connection to a Mosquitto the benchmark starts, train
digits-mlp (the demo's cached artifact, on sklearn's digits) or ``--model``, another zoo model
compiled with its training module once (on seeded random samples of its input shape). The same
rounds run alternately on an unsigned swarm and on a signed one (keys from ``deploy.keys``:
ed25519 statuses/events/commands, AES-GMAC ring frames). ``--members process`` (the default)
runs every node as its own ``fractal node`` process, as a swarm is deployed (one node per
board); ``thread`` runs them as ``EdgeNode`` objects in this one process, where one GIL
serialises every node's MQTT, MAC and ring work. Reports the median round time of each (command
published -> every node's DONE event), the median CPU seconds the nodes spent in it (the node
processes, or this process; neither counts the training steps, which run in worker processes)
and the overheads: the ratio of the medians, and the median of the per-repeat overheads (each
repeat runs one plain and one signed round back to back) with its bootstrap 95% interval
(``paired_overhead_ci95``, see bench/paired.py). ``--sets K`` starts fresh swarms K times
(``--repeats`` rounds each; the interval then accounts for the sets differing, and each set's
median is listed); ``--control`` adds a second unsigned swarm to every set, compared with the
first the same way: what the benchmark reads when nothing differs. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.host import machine
from bench.paired import paired_overhead

__all__ = ["run"]


def _samples(model: str) -> tuple[Any, Any]:
    """Training samples for ``model``: sklearn's digits for digits-mlp, else seeded random inputs
    of the zoo model's shape and random labels of its classes (timing only, nothing to learn)."""
    import numpy as np
    import onnx

    from compiler import zoo

    if model == "digits-mlp":
        from sklearn.datasets import load_digits

        d = load_digits()
        return (d.data / 16.0).astype("float32"), d.target.astype("int64")
    out = onnx.shape_inference.infer_shapes(zoo.build(model)).graph.output[0]
    classes = out.type.tensor_type.shape.dim[-1]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1800, *zoo.input_shape(model)[1:]), dtype=np.float32)
    return x, rng.integers(0, int(classes.dim_value), 1800).astype("int64")


def _swarm(tmp: Path, art_dir: Path, art: Any, broker_url: str, swarm: str, n: int, signed: bool,
           model: str):
    from deploy.keys import provision
    from edgenode.config import NodeConfig
    from edgenode.node import EdgeNode
    from federation.mqtt import MqttLink
    from federation.signed import load_identity

    ids = [f"{swarm}-n{k}" for k in range(n)]
    keys = tmp / swarm / "keys"
    if signed:
        provision(keys, swarm, ids)
    x, y = _samples(model)
    nodes = []
    for k, i in enumerate(ids):
        extra: dict[str, Any] = {}
        if signed:
            extra = {"key_file": keys / f"keys/{i}.key", "keyring_file": keys / "keyring.json"}
        cfg = NodeConfig.from_dict({"node_id": i, "artifact": str(art_dir), "data_dir": str(tmp / swarm / i),
                                    "broker": broker_url, "swarm": swarm, "heartbeat_s": 5.0, **extra})
        node = EdgeNode(cfg, artifact=art)
        node.start()
        node.add_samples({"x": x[k::n]}, y[k::n])
        nodes.append(node)
    link = MqttLink(broker_url, swarm=swarm, client_id=f"{swarm}-fleet")
    fleet: Any = link
    if signed:
        fleet = load_identity(keys / "keys/fleet.key", keys / "keyring.json").link(link)
    return ids, nodes, fleet, link


def _round(ids, nodes, fleet, swarm: str, rid: str, steps: int,
           opts: dict[str, Any] | None = None) -> tuple[float, float]:
    from federation import topics
    from federation.messages import EventKind, RoundCommand

    done = threading.Event()
    seen: set[str] = set()

    def listen(ev) -> None:
        if ev.round_id == rid and ev.kind in (EventKind.DONE, EventKind.FAILED):
            if ev.kind == EventKind.FAILED:
                raise SystemExit(f"round {rid} failed: {ev.reason}")
            seen.add(ev.node_id)
            if len(seen) == len(ids):
                done.set()

    for nd in nodes:
        nd.add_event_listener(listen)
    c0, t0 = time.process_time(), time.perf_counter()
    fleet.publish(topics.command(swarm), RoundCommand(round_id=rid, steps=steps, lr=0.05, participants=ids,
                                                      step_timeout_s=30, **(opts or {})))
    if not done.wait(300):
        raise SystemExit(f"round {rid} did not finish")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    for nd in nodes:  # DONE is emitted just before the worker thread ends: let it end
        nd.wait_idle(30)
    return elapsed, cpu


def _orders(kinds: list[str], repeats: int) -> list[list[str]]:
    """The order of the kinds' rounds in each repeat: every kind first, second, ... equally often
    (rotations), so a slot's systematic cost (the first round after a pause, ...) hits all alike."""
    return [kinds[r % len(kinds):] + kinds[:r % len(kinds)] for r in range(repeats)]


class _ThreadSwarm:
    """N ``EdgeNode`` objects of one swarm in this process (``--members thread``)."""

    def __init__(self, tmp: Path, art_dir: Path, art: Any, broker_url: str, swarm: str, n: int,
                 signed: bool, model: str) -> None:
        self.swarm = swarm
        self.ids, self.nodes, self.fleet, self.link = _swarm(tmp, art_dir, art, broker_url, swarm, n, signed,
                                                             model)

    def round(self, rid: str, steps: int, opts: dict[str, Any]) -> tuple[float, float]:
        return _round(self.ids, self.nodes, self.fleet, self.swarm, rid, steps, opts)

    def close(self) -> None:
        for nd in self.nodes:
            nd.stop()
        self.link.close()


class _ProcSwarm:
    """N ``fractal node`` processes of one swarm and the fleet's link (signed or not)."""

    def __init__(self, tmp: Path, art_dir: Path, model: str, broker_url: str, swarm: str, n: int,
                 signed: bool) -> None:
        import secrets

        import httpx

        from deploy.keys import provision
        from deploy.swarm import NodeProcess, fractal_argv
        from federation import topics
        from federation.broker import free_port
        from federation.messages import parse_event, parse_status
        from federation.mqtt import MqttLink
        from federation.signed import load_identity

        self.swarm, self.ids = swarm, [f"{swarm}-n{k}" for k in range(n)]
        keys, token = tmp / swarm / "keys", secrets.token_hex(16)
        if signed:
            provision(keys, swarm, self.ids)
        self.procs: list[Any] = []
        for i in self.ids:
            cfg, port = tmp / swarm / f"{i}.toml", free_port()
            cfg.parent.mkdir(parents=True, exist_ok=True)
            lines = [f'node_id = "{i}"', f'artifact = "{art_dir}"', f"port = {port}",
                     f'data_dir = "{tmp / swarm / i}"', f'broker = "{broker_url}"', f'swarm = "{swarm}"',
                     f'auth_token = "{token}"', "heartbeat_s = 5.0"]
            if signed:
                lines += [f'key_file = "{keys / "keys" / f"{i}.key"}"',
                          f'keyring_file = "{keys / "keyring.json"}"']
            cfg.write_text("\n".join(lines) + "\n")
            node = NodeProcess(i, port, cfg, tmp / swarm / f"{i}.log", "host",
                               [*fractal_argv(), "node", "--config", str(cfg)])
            node.start()
            self.procs.append(node)
        x, y = _samples(model)
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {token}"}) as client:
            for k, node in enumerate(self.procs):
                while True:
                    if not node.alive():
                        raise SystemExit(f"{node.node_id} exited: {node.log_tail()}")
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(node.url + "/v2/health/ready").status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{node.node_id} not ready: {node.log_tail()}")
                    time.sleep(0.2)
                r = client.post(node.url + "/v1/samples", json={"inputs": {"x": x[k::n].tolist()},
                                                                "labels": y[k::n].tolist()})
                if r.status_code >= 300:
                    raise SystemExit(f"{node.node_id} refused samples: {r.status_code} {r.text[:200]}")
        self.raw = MqttLink(broker_url, swarm=swarm, client_id=f"{swarm}-fleet")
        self.link: Any = self.raw
        if signed:
            self.link = load_identity(keys / "keys/fleet.key", keys / "keyring.json").link(self.raw)
        self._cv = threading.Condition()
        self._done: dict[str, dict[str, int]] = {}  # round id -> node -> committed version
        self._versions: dict[str, int] = {}  # node -> model version of its latest status

        def on_event(_topic: str, payload: bytes) -> None:
            ev = parse_event(payload)
            with self._cv:
                if ev.kind == "round.failed":
                    self._done.setdefault(ev.round_id, {})[ev.node_id] = -1
                elif ev.kind == "round.done":
                    self._done.setdefault(ev.round_id, {})[ev.node_id] = ev.model_version or 0
                self._cv.notify_all()

        def on_status(_topic: str, payload: bytes) -> None:
            st = parse_status(payload)
            with self._cv:
                if st.state == "online":
                    self._versions[st.node_id] = st.model_version
                self._cv.notify_all()

        self.link.subscribe(topics.round_events_all(swarm), on_event)
        self.link.subscribe(topics.status_all(swarm), on_status)

    def cpu(self) -> float:
        """CPU seconds the node processes used so far (every thread; not their training workers)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for node in self.procs:
            fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def round(self, rid: str, steps: int, opts: dict[str, Any]) -> tuple[float, float]:
        from federation import topics
        from federation.messages import RoundCommand

        c0, t0 = self.cpu(), time.perf_counter()
        self.link.publish(topics.command(self.swarm), RoundCommand(
            round_id=rid, steps=steps, lr=0.05, participants=self.ids, step_timeout_s=30, **opts))
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._done.get(rid, {})) == len(self.ids), 300):
                raise SystemExit(f"round {rid} did not finish")
            elapsed, cpu = time.perf_counter() - t0, self.cpu() - c0
            done = self._done[rid]
            if min(done.values()) < 0:
                raise SystemExit(f"round {rid} failed on {[k for k, v in done.items() if v < 0]}")
            # The status each node publishes last in a round: it is idle again, ready for the next.
            if not self._cv.wait_for(lambda: all(self._versions.get(i) == done[i] for i in self.ids), 60):
                raise SystemExit(f"nodes did not report idle after round {rid}")
        return elapsed, cpu

    def close(self) -> None:
        for node in self.procs:
            node.terminate()
        for node in self.procs:
            node.wait_or_kill(15)
        self.raw.close()


def _run_sets(make: Any, kinds: list[str], sets: int, steps: int, repeats: int, opts: dict[str, Any],
              out: dict[str, list[float]], cpu: dict[str, list[float]]) -> None:
    """``sets`` times: start one fresh swarm per kind (``make(tmp, swarm, signed)``), a warm-up round
    each, then ``repeats`` rounds of each kind in rotating order; close them. The order the swarms
    start in rotates from set to set (the swarm started last read ~2% faster than an identical one
    started first in A/A runs, docs/benchmarks-history.md, "Session 12"). Fresh swarms per set:
    what one set of processes happens to get (cores, memory layout, broker queues) is a bias
    between its swarms that more rounds of the same set cannot average out, more sets can."""
    for s in range(sets):
        with tempfile.TemporaryDirectory(prefix="fractal-signed-bench-") as tmp:
            swarms: dict[str, Any] = {}
            try:
                for kind in kinds[s % len(kinds):] + kinds[:s % len(kinds)]:  # who starts first rotates too
                    swarms[kind] = make(Path(tmp), f"b{kind}{s}", kind == "signed")
                for kind, sw in swarms.items():  # warm-up round each (TVM, connections, training workers)
                    sw.round(f"{kind}-warm", 5, opts)
                if s == 0 and isinstance(next(iter(swarms.values())), _ThreadSwarm):
                    from edgenode.common import freeze_startup_heap

                    freeze_startup_heap()  # as `fractal node` does once started
                for rep, order in enumerate(_orders(kinds, repeats)):
                    for kind in order:
                        wall, c = swarms[kind].round(f"{kind}-{s}-{rep}", steps, opts)
                        out[kind].append(wall)
                        cpu[kind].append(c)
            finally:
                for sw in swarms.values():
                    sw.close()


def run(nodes: int = 3, steps: int = 100, repeats: int = 3,
        outlier_factor: float | None = None, members: str = "process",
        model: str = "digits-mlp", compression: str = "none", sets: int = 1,
        control: bool = False) -> dict[str, Any]:
    """``outlier_factor``: the rounds' screening (federation/robust.py); None = the nodes' default.
    ``members``: "process" (one ``fractal node`` process per node) or "thread" (all in this one).
    ``model``: a zoo model, compiled with its training module once (digits-mlp: the demo's).
    ``sets``: fresh swarms this many times, ``repeats`` rounds of each per set (see _run_sets).
    ``control``: a second unsigned swarm in every set, reported against the first as the signed
    one is (an A/A comparison: what the benchmark reads when nothing differs)."""
    from compiler import host_preset_name, load_artifact
    from deploy.swarm import demo_artifact
    from federation.broker import start_mosquitto

    if sets < 1 or repeats < 1:
        raise ValueError("sets and repeats must be at least 1")
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines: stdout carries only the JSON
        art_dir = demo_artifact(Path(".cache"), host_preset_name(), model).resolve()
    broker = start_mosquitto()
    opts: dict[str, Any] = {"outlier_factor": outlier_factor, "compression": compression}
    kinds = ["plain", "signed"] + (["control"] if control else [])
    out: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    make: Any
    if members == "process":
        def make(tmp: Path, swarm: str, signed: bool) -> _ProcSwarm:
            return _ProcSwarm(tmp, art_dir, model, broker.url, swarm, nodes, signed)
    else:
        art = load_artifact(art_dir)

        def make(tmp: Path, swarm: str, signed: bool) -> _ThreadSwarm:
            return _ThreadSwarm(tmp, art_dir, art, broker.url, swarm, nodes, signed, model)
    try:
        _run_sets(make, kinds, sets, steps, repeats, opts, out, cpu)
    finally:
        broker.close()
    plain, signed = statistics.median(out["plain"]), statistics.median(out["signed"])
    pcpu, scpu = statistics.median(cpu["plain"]), statistics.median(cpu["signed"])
    # Repeat i ran its plain and its signed round back to back: per-pair overheads (bench/paired.py)
    paired = paired_overhead(out["plain"], out["signed"], clusters=sets)
    res = {"nodes": nodes, "steps": steps, "repeats": repeats, "sets": sets, "outlier_factor": outlier_factor,
           "compression": compression,
           "members": members, "model": model,
           "plain_round_s": round(plain, 4),
           "signed_round_s": round(signed, 4), "overhead": round(signed / plain - 1, 4),
           "paired_overhead": paired["median"], "paired_overhead_ci95": paired["ci95"],
           "paired_overhead_per_set": paired.get("per_cluster"),
           "plain_runs_s": [round(v, 4) for v in out["plain"]],
           "signed_runs_s": [round(v, 4) for v in out["signed"]],
           "plain_cpu_s": round(pcpu, 3), "signed_cpu_s": round(scpu, 3),
           "cpu_overhead": round(scpu / pcpu - 1, 4) if pcpu else None}
    if control:
        aa = paired_overhead(out["plain"], out["control"], clusters=sets)
        # Against both unsigned swarms of the repeat (their mean): what one swarm of a set happens
        # to cost more or less than another then weighs half as much.
        both = paired_overhead([(p + c) / 2 for p, c in zip(out["plain"], out["control"], strict=True)],
                               out["signed"], clusters=sets)
        res.update({"control_runs_s": [round(v, 4) for v in out["control"]],
                    "control_overhead": aa["median"], "control_overhead_ci95": aa["ci95"],
                    "control_overhead_per_set": aa.get("per_cluster"),
                    "overhead_vs_both_unsigned": both["median"],
                    "overhead_vs_both_unsigned_ci95": both["ci95"],
                    "overhead_vs_both_unsigned_per_set": both.get("per_cluster")})
    from federation.ringmac import gmac_describe

    return {**res, "gmac": gmac_describe(), "load_average": [round(v, 2) for v in os.getloadavg()],
            "machine": machine()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--outlier-factor", type=float, default=None, help="0 = no screening; default: the nodes'")
    p.add_argument("--members", choices=("process", "thread"), default="process",
                   help="one `fractal node` process per node (default), or all nodes in this process")
    p.add_argument("--model", default="digits-mlp",
                   help="a zoo model, compiled with its training module once (default: the demo's)")
    p.add_argument("--compression", default="none", choices=("none", "fp16", "int8", "topk"),
                   help="the rounds' compression (int8/topk with screening: a coded exchange per step)")
    p.add_argument("--sets", type=int, default=1,
                   help="start fresh swarms this many times, --repeats rounds of each per set")
    p.add_argument("--control", action="store_true",
                   help="also run a second unsigned swarm, reported against the first (A/A)")
    a = p.parse_args()
    try:
        r = run(a.nodes, a.steps, a.repeats, a.outlier_factor, a.members, a.model, a.compression,
                a.sets, a.control)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(r))


if __name__ == "__main__":
    main()
