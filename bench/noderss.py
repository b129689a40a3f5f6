"""Memory of a node on a board (issue 25): the resident set (``VmRSS``) of a real ``fractal node``
process and of its training worker, idle once ready and again after one training round.

``python -m bench.noderss ARTIFACT [ARTIFACT ...] [--steps N] [--json]`` starts one Mosquitto,
then per artifact one ``fractal node`` (a fresh interpreter, its own data dir, the broker
configured so that the training worker starts, as on a board), stores labelled samples over HTTP,
publishes one round over MQTT and waits for its DONE event.

:func:`start_node` and :func:`run_round` are shared with tests/test_node_without_compiler.py, which
runs the same node with the compiler's packages made unimportable.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["NodeProc", "provision_keys", "start_node", "run_round", "infer", "rss_mb", "pss_mb", "measure",
           "main"]

ROOT = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float:
    """``VmRSS`` of a live process, in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for pid {pid} (a zombie?)")


def pss_mb(pid: int) -> float:
    """Proportional set size (``Pss`` of smaps_rollup): shared pages split among their sharers, so
    that node + worker count the library pages they share (libpython, numpy, ...) once."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no Pss for pid {pid}")


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (all its threads' children)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


@dataclass
class NodeProc:
    """A ``fractal node`` child process and where it answers."""

    proc: subprocess.Popen[str]
    url: str
    node_id: str
    swarm: str

    def worker_pid(self) -> int | None:
        """The training worker's pid (the node's only Python child), or None before it started."""
        kids = [c for c in children(self.proc.pid) if "edgenode.trainworker" in _cmdline(c)]
        return kids[0] if kids else None

    def stop(self) -> str:
        """SIGTERM, wait; the node's combined output."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        assert self.proc.stdout is not None
        return self.proc.stdout.read()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def _post(url: str, body: Mapping[str, Any], timeout: float = 30) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def provision_keys(workdir: Path, swarm: str, node_id: str) -> Path:
    """Keys for a signed swarm of one node plus the fleet (``deploy.keys``, as the demo swarm)."""
    from deploy.keys import provision

    keys = workdir / "keys"
    provision(keys, swarm, [node_id])
    return keys


def start_node(artifact: Path, workdir: Path, *, broker_url: str, swarm: str, node_id: str = "rss",
               keys: Path | None = None, env: Mapping[str, str] | None = None,
               timeout: float = 120) -> NodeProc:
    """Start ``fractal node`` on ``artifact`` with the broker (signed with ``keys`` from
    :func:`provision_keys`); return once ``/v2/health/ready`` answers. ``env`` replaces the child's
    environment (PYTHONPATH is set to this checkout)."""
    port = _free_port()
    cfg = workdir / "NODE.toml"
    workdir.mkdir(parents=True, exist_ok=True)
    signing = (f'key_file = "{keys / "keys" / f"{node_id}.key"}"\nkeyring_file = "{keys / "keyring.json"}"\n'
               if keys is not None else "")
    cfg.write_text(f'node_id = "{node_id}"\nartifact = "{artifact}"\nport = {port}\n'
                   f'data_dir = "{workdir / "data"}"\nbroker = "{broker_url}"\nswarm = "{swarm}"\n' + signing)
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (child_env.get("PYTHONPATH"), str(ROOT)) if p)
    proc = subprocess.Popen([sys.executable, "-c", "from api.cli import main; main()", "node", "--config",
                             str(cfg)], cwd=workdir, env=child_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    node = NodeProc(proc, f"http://127.0.0.1:{port}", node_id, swarm)
    deadline = time.monotonic() + timeout
    while True:
        try:
            _get(f"{node.url}/v2/health/ready", timeout=2)
            return node
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = node.stop()
                raise RuntimeError(f"fractal node did not get ready (exit {proc.returncode}):\n"
                                   f"{out[-3000:]}") from None
            time.sleep(0.1)


def infer(node: NodeProc, model: str, name: str, x: np.ndarray) -> np.ndarray:
    """One OIP v2 JSON inference request; the first output as float32 ``[N, ...]``."""
    from fractal.oip import json_tensor

    body = {"inputs": [json_tensor(name, np.asarray(x, np.float32))]}
    out = _post(f"{node.url}/v2/models/{model}/infer", body)["outputs"][0]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def run_round(node: NodeProc, broker_url: str, x: np.ndarray, y: np.ndarray, *, steps: int,
              round_id: str = "rss-r1", keys: Path | None = None, timeout: float = 300) -> Any:
    """Store ``(x, y)`` on the node over HTTP, publish a one-member round over MQTT (signed by the
    fleet's key in ``keys``), wait for its DONE event (returned); raises on FAILED."""
    from federation import topics
    from federation.messages import EventKind, RoundCommand, parse_event
    from federation.mqtt import MqttLink

    _post(f"{node.url}/v1/samples", {"inputs": {"x": x.tolist()}, "labels": y.tolist()})
    events: queue.Queue[Any] = queue.Queue()
    raw = MqttLink(broker_url, swarm=node.swarm, client_id=f"{node.swarm}-bench-fleet")
    link: Any = raw
    if keys is not None:
        from federation.signed import load_identity

        link = load_identity(keys / "keys" / "fleet.key", keys / "keyring.json").link(raw)
    try:
        link.subscribe(topics.round_events_all(node.swarm), lambda _t, p: events.put(parse_event(p)))
        link.publish(topics.command(node.swarm),
                     RoundCommand(round_id=round_id, steps=steps, participants=[node.node_id]))
        deadline = time.monotonic() + timeout
        while True:
            ev = events.get(timeout=max(0.1, deadline - time.monotonic()))
            if ev.round_id == round_id and ev.kind == EventKind.DONE:
                return ev
            if ev.round_id == round_id and ev.kind == EventKind.FAILED:
                raise RuntimeError(f"round failed: {ev.reason}")
    finally:
        raw.close()


def _settled(pid: int, quiet_s: float = 1.0, timeout: float = 120) -> float:
    """RSS of ``pid`` once it has not changed for ``quiet_s`` (a worker loading its module)."""
    last, since = rss_mb(pid), time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = rss_mb(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def _worker(node: NodeProc, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while (pid := node.worker_pid()) is None:
        if time.monotonic() > deadline:
            raise RuntimeError("the node started no training worker")
        time.sleep(0.1)
    return pid


def measure(artifact: Path, broker_url: str, workdir: Path, *, steps: int = 20,
            signed: bool = False) -> dict[str, Any]:
    """RSS (MB) of node and worker: idle once ready, and after one ``steps``-step round."""
    from sklearn.datasets import load_digits

    manifest = json.loads((artifact / "manifest.json").read_text())
    d = load_digits()
    x, y = (d.data[:256] / 16.0).astype(np.float32), d.target[:256].astype(np.int64)
    swarm = f"rss{os.getpid()}-{workdir.name}"
    keys = provision_keys(workdir, swarm, "rss") if signed else None
    node = start_node(artifact, workdir, broker_url=broker_url, swarm=swarm, keys=keys)
    try:
        wpid = _worker(node)
        idle = _snapshot(node.proc.pid, wpid)
        run_round(node, broker_url, x, y, steps=steps, keys=keys)
        after = _snapshot(node.proc.pid, wpid)
    finally:
        node.stop()
    return {"artifact": str(artifact), "target": manifest.get("target", {}).get("preset"), "signed": signed,
            "idle": idle, "after_round": after, "steps": steps}


def _snapshot(node: int, worker: int) -> dict[str, float]:
    rss = {"node": _settled(node), "worker": _settled(worker)}
    return {**rss, "total": rss["node"] + rss["worker"], "pss_total": pss_mb(node) + pss_mb(worker)}


def main(argv: list[str] | None = None) -> None:
    """Print the RSS of node + worker for each artifact (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench.noderss")
    ap.add_argument("artifacts", type=Path, nargs="+")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--signed", action="store_true", help="a signed swarm, as the demo's (deploy.keys)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from federation.broker import start_mosquitto

    results = []
    with tempfile.TemporaryDirectory(prefix="noderss-") as tmp:
        broker = start_mosquitto(workdir=Path(tmp) / "broker")
        try:
            for k, art in enumerate(args.artifacts):
                results.append(measure(art.resolve(), broker.url, Path(tmp) / f"n{k}", steps=args.steps,
                                       signed=args.signed))
        finally:
            broker.close()
    if args.json:
        print(json.dumps({"rss_mb": results}))
        return
    for r in results:
        i, a = r["idle"], r["after_round"]
        print(f"{r['target'] or r['artifact']}{' signed' if r['signed'] else ''}: VmRSS idle node "
              f"{i['node']:.1f} + worker {i['worker']:.1f} = {i['total']:.1f} MB (PSS {i['pss_total']:.1f}); "
              f"after a {r['steps']}-step round {a['node']:.1f} + {a['worker']:.1f} = {a['total']:.1f} MB "
              f"(PSS {a['pss_total']:.1f})")


if __name__ == "__main__":
    main()
