"""A swarm on a real (namespaced) network with faults: the harness of the network-fault tests,
``python -m harness.netswarm bench`` (round time under delay and drops) and ``harness/soak.py``.

Mosquitto runs on the broker host, ``fractal node`` processes on the nodes host, one
:class:`harness.faultproxy.ProxyThread` per node on the router between them (see
:mod:`harness.netns`). The fleet role is the real :class:`api.fleet.rounds.RoundManager` fed by an
MQTT link on the broker host, so a round ends the way the fleet decides (DONE, or FAILED with a
reason, then a RoundAbort to the others). The truth about parameters comes from each node's
``GET /v1/node``, never from the fleet's view. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from api.fleet.rounds import RoundManager, RoundRequest, RoundState
from federation import topics
from federation.broker import MosquittoBroker, start_mosquitto
from federation.messages import NodeState, NodeStatus, parse_event, parse_status
from federation.mqtt import MqttLink
from harness.faultproxy import ProxyThread
from harness.netns import BROKER_IP, BROKER_PORT, ROUTER_N_IP, NetTopology, sweep_stale

__all__ = ["NetSwarm", "NetSwarmOptions", "RoundOutcome", "main"]

REPO = Path(__file__).resolve().parents[1]
PROXY_BASE_PORT = 2000  # node k reaches the broker through ROUTER_N_IP:PROXY_BASE_PORT+k
HTTP_BASE_PORT = 8100  # node k serves HTTP on 127.0.0.1:HTTP_BASE_PORT+k in the nodes namespace


@dataclass
class NetSwarmOptions:
    artifact: Path
    workdir: Path
    nodes: int = 3
    swarm: str = "net"
    keepalive_s: int = 2  # short: a partitioned node's Last Will fires within ~3 s
    heartbeat_s: float = 0.5
    step_timeout_s: float = 6.0
    start_timeout_s: float = 15.0  # fleet: a participant silent this long after the command fails the round
    idle_timeout_s: float = 15.0
    offline_grace_s: float = 5.0  # fleet: an offline participant fails its round after this (0: at once)
    tag: str = "s"
    signed: bool = False  # keys for every node and the fleet (deploy/keys.py) in workdir/keys


@dataclass
class RoundOutcome:
    round_id: str
    state: str  # the fleet's verdict: done | failed
    reason: str | None
    seconds: float
    fleet: dict[str, Any] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        return self.state == RoundState.DONE.value


class NetSwarm:
    """Start with :meth:`start`, always :meth:`close` (namespaces are removed even on failure)."""

    def __init__(self, opts: NetSwarmOptions) -> None:
        self.opts = opts
        self.ids = [f"n{k}" for k in range(opts.nodes)]
        self.net = NetTopology(opts.tag)
        self.broker: MosquittoBroker | None = None
        self.proxies: list[ProxyThread] = []
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * opts.nodes
        self.fleet_link: Any = None  # MqttLink, or a SignedLink around it (opts.signed)
        self.statuses: dict[str, NodeStatus] = {}
        self.lock = threading.Lock()
        self.rounds = RoundManager(swarm=opts.swarm, publish=self._publish,
                                   start_timeout_s=opts.start_timeout_s, idle_timeout_s=opts.idle_timeout_s,
                                   step_timeout_s=opts.step_timeout_s, offline_grace_s=opts.offline_grace_s)
        self.offline_statuses = 0  # offline statuses received (Last Wills of dropped connections, stops)
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._http: dict[str, httpx.Client] = {}
        self.current_round: str | None = None  # the round run_round is waiting on

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> NetSwarm:
        try:
            sweep_stale()
            self.net.create()
            wd = self.opts.workdir
            wd.mkdir(parents=True, exist_ok=True)
            self.broker = self.net.call(self.net.broker, start_mosquitto, BROKER_PORT,
                                        workdir=wd / "mosquitto",
                                        extra_config=f"listener {BROKER_PORT} {BROKER_IP}")
            for k in range(self.opts.nodes):
                proxy = ProxyThread(BROKER_IP, BROKER_PORT, listen_host=ROUTER_N_IP,
                                    listen_port=PROXY_BASE_PORT + k, netns=self.net.router)
                self.proxies.append(proxy.start())
            link: Any = self.net.call(self.net.broker, MqttLink, self.broker.url, swarm=self.opts.swarm,
                                      client_id="fleet")
            if self.opts.signed:  # the fleet signs its commands and takes only verified messages
                from deploy.keys import provision
                from federation.signed import load_identity

                provision(self.keys, self.opts.swarm, self.ids)
                link = load_identity(self.keys / "keys" / "fleet.key", self.keys / "keyring.json").link(link)
            self.fleet_link = link
            link.subscribe(topics.status_all(self.opts.swarm), self._on_status)
            link.subscribe(topics.round_events_all(self.opts.swarm), self._on_event)
            self._ticker = threading.Thread(target=self._tick, name="netswarm-tick", daemon=True)
            self._ticker.start()
            for k in range(self.opts.nodes):
                self.start_node(k)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self._stop.set()
        for k in range(len(self.procs)):
            self.kill_node(k)
        for c in self._http.values():
            c.close()
        if self.fleet_link is not None:
            self.fleet_link.close()
        for p in self.proxies:
            p.stop()
        if self.broker is not None:
            self.broker.stop()
        self.net.destroy()

    def __enter__(self) -> NetSwarm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def keys(self) -> Path:
        return self.opts.workdir / "keys"

    # -- fleet ------------------------------------------------------------------------------
    def _publish(self, topic: str, msg: Any) -> None:
        assert self.fleet_link is not None
        self.fleet_link.publish(topic, msg, qos=1)

    def _on_status(self, topic: str, payload: bytes) -> None:
        try:
            s = parse_status(payload)
        except ValueError:
            return
        with self.lock:
            self.statuses[s.node_id] = s
        if s.state is NodeState.OFFLINE:
            self.offline_statuses += 1
            self.rounds.node_offline(s.node_id, time.time())
        else:
            self.rounds.node_online(s.node_id, s.round_id)

    def _on_event(self, topic: str, payload: bytes) -> None:
        try:
            ev = parse_event(payload)
        except ValueError:
            return
        self.rounds.on_event(ev, time.time())

    def _tick(self) -> None:
        while not self._stop.wait(0.2):
            self.rounds.tick(time.time())

    def online(self, *, idle_only: bool = False) -> set[str]:
        """Nodes whose retained status is not offline (the fleet's rule: a node still TRAINING a
        round the fleet already failed counts); ``idle_only``: only those in state ONLINE."""
        ok = {NodeState.ONLINE} if idle_only else {NodeState.ONLINE, NodeState.TRAINING}
        with self.lock:
            return {n for n, s in self.statuses.items() if s.state in ok}

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not within {timeout:g}s; statuses: {self.statuses}")
            time.sleep(0.05)

    def wait_online(self, ids: list[str] | None = None, timeout: float = 90.0, *, idle: bool = True) -> None:
        """Every node in ``ids`` (default all) has a live retained status (and is not training)."""
        want = ids or self.ids
        ok = {NodeState.ONLINE} if idle else {NodeState.ONLINE, NodeState.TRAINING}

        def ready() -> bool:
            with self.lock:
                return all(n in self.statuses and self.statuses[n].state in ok for n in want)

        self.wait_for(ready, timeout, f"nodes {want} online")

    def run_round(self, steps: int, *, lr: float | None = None, timeout: float = 120.0,
                  idle_only: bool = False, during: Callable[[str], None] | None = None) -> RoundOutcome:
        """Start a round on every online node (the fleet's rules; ``idle_only``: skip nodes still
        training); ``during(round_id)`` runs right after the command is published. Returns once
        the fleet decided."""
        t0 = time.monotonic()
        with self.lock:  # as the fleet service does: it names the start parameters (start-version rule)
            holdings = {n: s.params_sha256 for n, s in self.statuses.items()}
        rnd = self.rounds.start(RoundRequest(steps=steps, lr=lr), online=self.online(idle_only=idle_only),
                                known=set(self.ids), now=time.time(), holdings=holdings)
        self.current_round = rnd.round_id
        try:
            if during is not None:
                during(rnd.round_id)
            self.wait_for(lambda: rnd.state is not RoundState.RUNNING, timeout,
                          f"round {rnd.round_id} decided")
        finally:
            self.current_round = None
        d = self.rounds.get(rnd.round_id) or {}
        return RoundOutcome(rnd.round_id, rnd.state.value, rnd.reason, time.monotonic() - t0, d)

    # -- nodes ------------------------------------------------------------------------------
    def _node_toml(self, k: int) -> Path:
        node_dir = self.opts.workdir / self.ids[k]
        node_dir.mkdir(parents=True, exist_ok=True)
        cfg = node_dir / "NODE.toml"
        cfg.write_text("\n".join([
            f'node_id = "{self.ids[k]}"', f'artifact = "{self.opts.artifact.resolve()}"',
            f"port = {HTTP_BASE_PORT + k}",
            'data_dir = "data"', f'broker = "mqtt://{ROUTER_N_IP}:{PROXY_BASE_PORT + k}"',
            f'swarm = "{self.opts.swarm}"', f"heartbeat_s = {self.opts.heartbeat_s}",
            f"keepalive_s = {self.opts.keepalive_s}",
            *([f'key_file = "{self.keys / "keys" / f"{self.ids[k]}.key"}"',
               f'keyring_file = "{self.keys / "keyring.json"}"'] if self.opts.signed else []),
            "", "[training]",
            f"step_timeout_s = {self.opts.step_timeout_s}", "nice = 0", ""]))
        return cfg

    def start_node(self, k: int) -> None:
        cfg = self._node_toml(k)
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "TVM_NUM_THREADS": "1"}
        log = open(cfg.parent / "node.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            argv = [sys.executable, "-c", "from api.cli import main; main()", "node", "--config", str(cfg)]
            self.procs[k] = self.net.popen(self.net.nodes, argv, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, cwd=str(REPO), env=env)
        finally:
            log.close()

    def kill_node(self, k: int) -> None:
        """SIGKILL node ``k`` (a crash: its Last Will says offline)."""
        p = self.procs[k]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        self.procs[k] = None

    def node_pid(self, k: int) -> int | None:
        p = self.procs[k]
        return p.pid if p is not None and p.poll() is None else None

    def rss(self) -> dict[str, int]:
        """Resident memory (bytes) per running node process and the broker."""
        out: dict[str, int] = {}
        for k, nid in enumerate(self.ids):
            pid = self.node_pid(k)
            with contextlib.suppress(psutil.Error):
                if pid:
                    out[nid] = psutil.Process(pid).memory_info().rss
        if self.broker is not None and self.broker.pid:
            with contextlib.suppress(psutil.Error):
                out["mosquitto"] = psutil.Process(self.broker.pid).memory_info().rss
        return out

    def _client(self, k: int) -> httpx.Client:
        # httpx opens its sockets lazily from the calling thread: always call inside the nodes namespace
        c = self._http.get(self.ids[k])
        if c is None:
            c = self._http[self.ids[k]] = httpx.Client(base_url=f"http://127.0.0.1:{HTTP_BASE_PORT + k}",
                                                       timeout=10)
        return c

    def node_info(self, k: int) -> dict[str, Any]:
        return dict(self.net.call(self.net.nodes, lambda: self._client(k).get("/v1/node").json()))

    def post_samples(self, k: int, x: Any, y: Any) -> int:
        """POST samples to node ``k``; returns the HTTP status (a 2xx means stored durably)."""
        body = {"inputs": {"x": x.tolist()}, "labels": y.tolist()}

        def post() -> int:
            try:
                return self._client(k).post("/v1/samples", json=body).status_code
            except httpx.HTTPError:
                return 0

        return self.net.call(self.net.nodes, post)

    def log_tail(self, k: int, chars: int = 1500) -> str:
        path = self.opts.workdir / self.ids[k] / "node.log"
        return path.read_text(errors="replace")[-chars:] if path.is_file() else ""

    def wait_http(self, k: int, timeout: float = 90.0) -> None:
        def up() -> bool:
            if self.node_pid(k) is None:
                raise RuntimeError(f"{self.ids[k]} exited: {self.log_tail(k)}")
            try:
                code = self.net.call(self.net.nodes,
                                     lambda: self._client(k).get("/v2/health/ready").status_code)
                return bool(code == 200)
            except httpx.HTTPError:
                return False

        self.wait_for(up, timeout, f"{self.ids[k]} HTTP ready")

    def params(self) -> dict[str, tuple[int, str]]:
        """(model_version, params_sha256) of every running node, read over HTTP."""
        out = {}
        for k, nid in enumerate(self.ids):
            if self.node_pid(k):
                info = self.node_info(k)
                out[nid] = (int(info["model_version"]), str(info["params_sha256"]))
        return out

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Every running node reports (over HTTP) that no round runs."""
        def idle() -> bool:
            running = [k for k in range(len(self.ids)) if self.node_pid(k)]
            return all(self.node_info(k)["round_id"] is None for k in running)

        self.wait_for(idle, timeout, "nodes idle")


# -- benchmark: round time under faults -------------------------------------------------------------
def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from compiler import host_preset_name
    from deploy.sensors import digits_shards
    from deploy.swarm import demo_artifact

    with contextlib.redirect_stdout(sys.stderr):  # its progress lines: stdout carries only the JSON
        artifact = demo_artifact(Path(args.cache_dir), host_preset_name())
    work = Path(tempfile.mkdtemp(prefix="fractal-netbench-"))
    shards = digits_shards(args.nodes)
    results: dict[str, Any] = {}
    load_before = round(os.getloadavg()[0], 2)
    try:
        with NetSwarm(NetSwarmOptions(artifact=artifact, workdir=work, nodes=args.nodes, tag="bench",
                                      offline_grace_s=args.offline_grace)) as sw:
            for k in range(args.nodes):
                sw.wait_http(k)
                assert sw.post_samples(k, shards[k].x[:200], shards[k].y[:200]) == 200
            sw.wait_online()
            sw.run_round(2)  # warm-up (imports, first TVM calls)
            sw.wait_online()
            def drops(p: ProxyThread) -> None:
                p.set_delay(0)
                p.drop_every(args.drop_every)

            faults: list[tuple[str, Callable[[ProxyThread], None]]] = [
                ("none", lambda p: None),
                ("delay-50ms", lambda p: p.set_delay(50)),
                (f"drop-every-{args.drop_every:g}s", drops),
            ]
            for name, apply in faults:
                if name.split("-")[0] not in args.faults:
                    continue
                for p in sw.proxies:
                    apply(p)
                times: list[float] = []
                reasons: dict[str, int] = {}
                offline0 = sw.offline_statuses
                for _ in range(args.rounds):
                    sw.wait_online(timeout=60)
                    out = sw.run_round(args.steps)
                    if out.committed:
                        times.append(out.seconds)
                    else:
                        why = (out.reason or "?").split(":")[0][:60]
                        reasons[why] = reasons.get(why, 0) + 1
                    sw.wait_idle()
                    if len(set(sw.params().values())) != 1:
                        reasons["PARAMETERS DIVERGED"] = reasons.get("PARAMETERS DIVERGED", 0) + 1
                results[name] = {"rounds": args.rounds, "committed": len(times), "failed": reasons,
                                 "offline_statuses": sw.offline_statuses - offline0,
                                 "median_s": round(statistics.median(times), 3) if times else None,
                                 "min_s": round(min(times), 3) if times else None,
                                 "max_s": round(max(times), 3) if times else None}
            for p in sw.proxies:
                p.drop_every(None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from bench.host import machine_line

    return {"machine": machine_line(), "loadavg_1m_before": load_before,
            "loadavg_1m_after": round(os.getloadavg()[0], 2), "nodes": args.nodes, "steps": args.steps,
            "drop_every_s": args.drop_every, "offline_grace_s": args.offline_grace, "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.netswarm")
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("bench", help="round time with no fault, 50 ms delay and periodic drops")
    b.add_argument("--nodes", type=int, default=3)
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--drop-every", type=float, default=2.0)
    b.add_argument("--offline-grace", type=float, default=5.0,
                   help="the fleet's grace for a participant's offline status (0: fail the round at once)")
    b.add_argument("--faults", type=lambda v: v.split(","), default=["none", "delay", "drop"],
                   help="comma-separated subset of none,delay,drop")
    b.add_argument("--cache-dir", default=str(REPO / ".cache" / "netfaults"))
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("error: network namespaces need root (help: run as root, e.g. in the CI container)",
              file=sys.stderr)
        return 1
    print(json.dumps(_bench(a), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
