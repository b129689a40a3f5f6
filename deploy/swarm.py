"""The local swarm demo behind ``fractal swarm --nodes N`` (and ``make demo``).

Steps: compile (or reuse from ``.cache/swarm/``) the digits-mlp demo model with its training
module; start a broker (Mosquitto when installed, else the embedded amqtt broker) unless one
is given; write N ``NODE.toml`` files and start N ``fractal node`` processes (with
``--emulate-arm`` the last one is an aarch64 node under qemu-user, with ``--emulate-riscv`` the
last one, or the one before the aarch64 node, is a riscv64 node under qemu-user running the
model's C-backend library); feed each node its shard of
sklearn's digits from a simulated sensor; run the fleet service in this process and print the
dashboard URL and the token. Ctrl-C or SIGTERM stops the feeders, the nodes (SIGTERM, then
SIGKILL), the fleet and the broker, in that order; node processes also get PR_SET_PDEATHSIG
so they die with the launcher even if it is SIGKILLed.

``--scenario vibration`` compiles the zoo's fc-autoencoder instead, gives every node a simulated
machine's SenML stream instead of digits, and starts rounds itself (deploy/vibration_scenario.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from deploy.errors import DeployError
from deploy.sensors import Feeder, digits_shards
from deploy.vibration_scenario import ScenarioOptions

if TYPE_CHECKING:
    from federation.broker import Broker

__all__ = ["SwarmOptions", "SwarmFleet", "ServeFleet", "run_swarm", "demo_artifact", "NodeProcess", "Swarm",
           "DEMO_MODEL", "start_demo_broker", "VIBRATION_MODEL", "VIBRATION_TRAIN", "STAMP", "demo_stamp"]

log = logging.getLogger("fractal.swarm")

DEMO_MODEL = "digits-mlp"
DEMO_TRAIN = {"loss": "ce", "optimizer": "sgd", "lr": 0.1, "batch": 32}
# The vibration scenario's model: MLPerf Tiny's anomaly autoencoder, trained to reconstruct its input.
VIBRATION_MODEL = "fc-autoencoder"
VIBRATION_TRAIN = {"loss": "mse", "optimizer": "adam", "lr": 0.001, "batch": 32}
# The riscv64 node's preset: rv64gc (every riscv64 Linux board; the C route, no TVM on the node).
RISCV_PRESET = "riscv64"
REPO = Path(__file__).resolve().parents[1]


@dataclass
class SwarmOptions:
    nodes: int = 3
    sites: int = 1  # > 1: a bridged Mosquitto per site and a backbone (federation/PROTOCOL.md section 10)
    emulate_arm: bool = False
    emulate_riscv: bool = False
    port: int = 8080
    broker: str | None = None
    token: str | None = None
    workdir: Path | None = None
    cache_dir: Path = Path(".cache")
    feed_rate: float = 40.0
    host: str = "127.0.0.1"
    swarm: str = "default"
    # an emulated node needs ~30-90 s to import and load (two of them start at once on 2 cores)
    node_ready_timeout_s: float = 300.0
    sysroot: Path | None = None  # default: CACHE_DIR/sysroot-aarch64 (made by `make sysroot`)
    riscv_sysroot: Path | None = None  # default: CACHE_DIR/sysroot-riscv64 (`make sysroot-riscv64`)
    scenario: str = "digits"  # or "vibration" (deploy/vibration_scenario.py)
    # asynchronous rounds (federation/PROTOCOL.md section 13): the nodes run [training] sync =
    # "async" and the fleet aggregates every async_buffer updates; 0: synchronous rounds
    async_buffer: int = 0
    vibration: ScenarioOptions = field(default_factory=ScenarioOptions)

    def model(self) -> tuple[str, dict[str, Any]]:
        """The scenario's zoo model and its training settings."""
        if self.scenario == "vibration":
            return VIBRATION_MODEL, VIBRATION_TRAIN
        return DEMO_MODEL, DEMO_TRAIN

    def emulated(self) -> list[str]:
        """The arches of the emulated nodes, in node order: they are the last nodes."""
        return [a for a, on in (("riscv64", self.emulate_riscv), ("aarch64", self.emulate_arm)) if on]


def _say(msg: str) -> None:
    print(f"[swarm] {msg}", flush=True)


# -- the demo model ---------------------------------------------------------------------------
def demo_artifact(cache_dir: Path, preset: str, model: str = DEMO_MODEL,
                  train: dict[str, Any] | None = None) -> Path:
    """The digits-mlp artifact (or another zoo ``model``'s, with its ``train`` settings) with its
    training module for ``preset``, compiled once and cached.

    The cache is keyed by the TVM version, the training settings and the compiler's source (a
    stamp file written after a successful compile), so any change to them recompiles (~5 s).
    """
    from compiler import TrainSettings, compile_model, zoo

    root = Path(cache_dir) / "swarm"
    out = root / f"{model}-{preset}"
    stamp = out / STAMP
    train = dict(train or DEMO_TRAIN)
    want = demo_stamp(preset, model, train)
    if stamp.is_file():
        with contextlib.suppress(ValueError, OSError):
            if json.loads(stamp.read_text()) == want:
                _say(f"reusing compiled {model} for {preset} from {out}")
                return out
    root.mkdir(parents=True, exist_ok=True)
    onnx_path = root / f"{model}.onnx"
    zoo.save(model, onnx_path)
    _say(f"compiling {model} for {preset} (with its training module) into {out}")
    compile_model(onnx_path, target=preset, out_dir=out, name=model, train=TrainSettings(**train),
                  progress=False)
    stamp.write_text(json.dumps(want))
    return out


STAMP = ".swarm-stamp.json"  # in a cached artifact's directory: what it was compiled from


def demo_stamp(preset: str, model: str, train: dict[str, Any]) -> dict[str, Any]:
    """What a cached demo artifact must have been compiled from to be reused."""
    return {"tvm": importlib.metadata.version("apache-tvm"), "preset": preset, "train": dict(train),
            "model": model, "compiler": _compiler_fingerprint()}


def _compiler_fingerprint() -> str:
    """sha256 over the compiler package's sources: a changed compiler invalidates the cache."""
    h = hashlib.sha256()
    for path in sorted((REPO / "compiler").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


# -- node processes ---------------------------------------------------------------------------
def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGTERMs the child when the launcher dies (Linux), so even a
    SIGKILLed launcher leaves no orphan nodes behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def fractal_argv() -> list[str]:
    """How to run the `fractal` CLI from this interpreter."""
    script = Path(sys.executable).with_name("fractal")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from api.cli import main; main()"]


@dataclass
class NodeProcess:
    node_id: str
    port: int
    config: Path
    log_path: Path
    arch: str
    argv: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        logf = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            # Own session: a terminal's Ctrl-C reaches the launcher only, which stops nodes in order.
            self.proc = subprocess.Popen(self.argv, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=REPO,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            logf.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 1200) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:].strip()
        return ""

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def wait_or_kill(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _free_port() -> int:
    from federation.broker import free_port

    return free_port()


def start_demo_broker() -> Broker:
    """The demo's broker: anonymous on loopback, but with the production config's size limits
    (deploy/mosquitto/mosquitto.conf), so no client can push a 200 MiB message through it."""
    from federation.broker import MAX_PACKET_SIZE, MESSAGE_SIZE_LIMIT, start_default

    return start_default(message_size_limit=MESSAGE_SIZE_LIMIT, max_packet_size=MAX_PACKET_SIZE)


def _write_node_config(path: Path, *, node_id: str, artifact: Path, port: int, data_dir: Path, broker: str,
                       swarm: str, token: str, keys: Path, site: str | None = None, extra: str = "",
                       sync: str = "gradient") -> None:
    # Written by hand: the demo's NODE.toml doubles as a readable example of the format.
    path.write_text(
        f'node_id = "{node_id}"\n'
        f'artifact = "{artifact}"\n'
        f"port = {port}\n"
        f'data_dir = "{data_dir}"\n'
        f'broker = "{broker}"\n'
        f'swarm = "{swarm}"\n'
        f'auth_token = "{token}"\n'
        "# signed swarm (python -m deploy.keys): only the fleet's key starts rounds\n"
        f'key_file = "{keys / "keys" / f"{node_id}.key"}"\n'
        f'keyring_file = "{keys / "keyring.json"}"\n'
        + ("# its site: rounds across sites are hierarchical (federation/PROTOCOL.md section 10)\n"
           f'site = "{site}"\n' if site else "")
        + "\n[training]\n"
        f'sync = "{sync}"\n'
        "step_timeout_s = 30.0\n"
        + ('isolation = "thread"  # hierarchical rounds run on the round thread in this release\n'
           if site else "")
        + extra
    )


def _scenario_toml(machine: Any, swarm: str) -> str:
    from deploy.vibration_scenario import node_toml

    return node_toml(machine, swarm)


def _arm_node_env(sysroot: Path) -> tuple[list[str], dict[str, str]]:
    """argv prefix and environment to run `fractal` as an aarch64 process under qemu-user."""
    from deploy.armnode import arm_python

    return arm_python(sysroot)


def _riscv_node_env(sysroot: Path) -> tuple[list[str], dict[str, str]]:
    """argv prefix and environment to run `fractal` as a riscv64 process under qemu-user."""
    from deploy.riscvnode import riscv_python

    return riscv_python(sysroot)


# -- the swarm --------------------------------------------------------------------------------
@dataclass
class Swarm:
    """Everything `fractal swarm` started; :meth:`stop` undoes it (idempotent)."""

    opts: SwarmOptions
    token: str
    workdir: Path
    owns_workdir: bool
    broker: Any = None  # federation.broker.Broker when we started one
    broker_url: str = ""
    sites: Any = None  # deploy.sites.Sites with --sites > 1 (broker_url is then the backbone's)
    nodes: list[NodeProcess] = field(default_factory=list)
    feeders: list[Feeder] = field(default_factory=list)
    vibration: Any = None  # deploy.vibration_scenario.VibrationRun with --scenario vibration
    _stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def keys(self) -> Path:
        return self.workdir / "keys"

    def start_broker(self) -> None:
        if self.opts.sites > 1:
            from deploy.sites import site_names, start_sites

            self.sites = start_sites(site_names(self.opts.sites))
            self.broker_url = self.sites.backbone.url
            _say(f"started {self.opts.sites} site brokers bridged to the backbone {self.broker_url}: "
                 + ", ".join(f"{s} {b.url}" for s, b in self.sites.sites.items()))
            return
        if self.opts.broker:
            self.broker_url = self.opts.broker
            _say(f"using broker {self.broker_url}")
            return
        self.broker = start_demo_broker()
        self.broker_url = self.broker.url
        _say(f"started {self.broker.kind.value} broker at {self.broker_url}")
        if self.broker.kind.value != "mosquitto":
            _say("warning: the embedded broker has no message size limit; install mosquitto for one")

    def start_nodes(self, artifacts: dict[str, Path],
                    launchers: dict[str, tuple[list[str], dict[str, str]]]) -> None:
        """Start the nodes; ``launchers`` maps an emulated arch to its argv prefix and environment."""
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        # The demo swarm is a signed one (federation/PROTOCOL.md section 9): keys for every node
        # and the fleet, made fresh in the work dir.
        from deploy.keys import provision

        provision(self.keys, self.opts.swarm, [f"node-{i + 1}" for i in range(self.opts.nodes)])
        machines = self.machines()
        emulated = self.opts.emulated()
        arches = ["host"] * (self.opts.nodes - len(emulated)) + emulated
        for i, arch in enumerate(arches):
            node_id = f"node-{i + 1}"
            port = _free_port()
            cfg = self.workdir / f"{node_id}.toml"
            site, broker = self.site_of(i)
            _write_node_config(cfg, node_id=node_id, artifact=artifacts[arch], port=port,
                               data_dir=self.workdir / "data" / node_id, broker=broker,
                               swarm=self.opts.swarm, token=self.token, keys=self.keys, site=site,
                               extra=_scenario_toml(machines[i], self.opts.swarm) if machines else "",
                               sync="async" if self.opts.async_buffer else "gradient")
            if arch in launchers:
                prefix, env = launchers[arch]
                argv = [*prefix, "node", "--config", str(cfg)]
            else:
                argv, env = [*fractal_argv(), "node", "--config", str(cfg)], None
            np_ = NodeProcess(node_id, port, cfg, logs / f"{node_id}.log", arch, argv, env)
            np_.start()
            self.nodes.append(np_)
        _say(f"started {len(self.nodes)} nodes: " + ", ".join(f"{n.node_id} ({n.url})" for n in self.nodes))

    def site_of(self, i: int) -> tuple[str | None, str]:
        """Node ``i``'s site and broker: consecutive nodes share a site (none without --sites)."""
        if self.sites is None:
            return None, self.broker_url
        names = list(self.sites.sites)
        site = names[i * len(names) // self.opts.nodes]
        return site, self.sites.sites[site].url

    def wait_nodes_ready(self) -> None:
        deadline = time.monotonic() + self.opts.node_ready_timeout_s
        pending = list(self.nodes)
        with httpx.Client(timeout=2) as client:
            while pending:
                for n in list(pending):
                    if n.proc is None or n.proc.poll() is not None:
                        code = n.proc.returncode if n.proc else None
                        raise DeployError(f"{n.node_id} exited during start-up (exit code "
                                         f"{code}); last log lines: {n.log_tail(600)}",
                                         hint=f"see {n.log_path}")
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(n.url + "/v2/health/ready").status_code == 200:
                            pending.remove(n)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(n.node_id for n in pending)
                    raise DeployError(f"nodes not ready after {self.opts.node_ready_timeout_s:.0f}s: {names}",
                                     hint=f"see the logs in {self.workdir / 'logs'}")
                time.sleep(0.2)

    def watch_nodes(self) -> None:
        """Say so when a node process dies while the demo runs (the dashboard shows it offline)."""
        def watch() -> None:
            reported: set[str] = set()
            while not self._stopping.wait(1.0):
                for n in self.nodes:
                    if n.node_id not in reported and n.proc is not None and n.proc.poll() is not None:
                        reported.add(n.node_id)
                        _say(f"{n.node_id} exited unexpectedly (code {n.proc.returncode}); see {n.log_path}")

        threading.Thread(target=watch, name="swarm-watch", daemon=True).start()

    def machines(self) -> list:
        """The vibration scenario's machines, one per node (none in the digits demo)."""
        if self.opts.scenario != "vibration":
            return []
        from deploy.vibration import machines

        return machines(self.opts.nodes)

    def start_sensors(self) -> None:
        if self.opts.scenario == "vibration":
            self.start_vibration()
        else:
            self.start_feeders()

    def start_vibration(self) -> None:
        from deploy.vibration import make_schedule
        from deploy.vibration_scenario import start_vibration

        vo = self.opts.vibration
        ms = self.machines()
        schedule = make_schedule(ms, time.time(), warmup_s=vo.warmup_s, every_s=vo.fault_every_s,
                                 length_s=vo.fault_s, horizon_s=vo.horizon_s, severity=vo.fault_severity)
        urls = {m.name: n.url for m, n in zip(ms, self.nodes, strict=True)}
        self.vibration = start_vibration(self.broker_url, self.opts.swarm, schedule, urls, self.token,
                                         self.workdir / "faults.json", vo)
        _say(f"simulated machines publishing SenML at {schedule.rate_hz:.0f} Hz x 2 axes "
             f"(speed x{vo.speed:g}): "
             + ", ".join(f"{m.name} -> {n.node_id} ({m.shaft_hz:.1f} Hz)" for m, n in zip(ms, self.nodes,
                                                                                          strict=True))
             + f"; {len(schedule.faults)} faults scheduled in {self.workdir / 'faults.json'}")

    def start_feeders(self) -> None:
        shards = digits_shards(len(self.nodes))
        for n, shard in zip(self.nodes, shards, strict=True):
            f = Feeder(n.url, shard, token=self.token, rate=self.opts.feed_rate)
            f.start()
            self.feeders.append(f)
        _say("simulated sensors feeding digits: " + ", ".join(
            f"{n.node_id} {len(s.y)} samples" for n, s in zip(self.nodes, shards, strict=True)))

    def stop(self) -> None:
        self._stopping.set()
        if self.vibration is not None:
            self.vibration.stop()
            self.vibration = None
        for f in self.feeders:
            f.stop()
        for n in self.nodes:  # SIGTERM all first, then wait: they shut down in parallel
            n.terminate()
        for n in self.nodes:
            n.wait_or_kill(8.0)
        for f in self.feeders:
            f.join(2)
        if self.sites is not None:
            self.sites.close()
            self.sites = None
        if self.broker is not None:
            # MosquittoBroker.close also deletes its temp dir; the embedded broker only has stop.
            (getattr(self.broker, "close", None) or self.broker.stop)()
            self.broker = None
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _raise_interrupt(signum, frame):  # SIGTERM behaves like Ctrl-C: unwind and clean up
    raise KeyboardInterrupt


@dataclass(frozen=True)
class SwarmFleet:
    """What the demo's fleet service is given: its broker, swarm, address, token, signing key and
    keyring, and the default history database (in the swarm's workdir)."""

    broker_url: str
    swarm: str
    host: str
    port: int
    token: str
    key_file: str
    keyring_file: str
    db: str
    async_params: str = ""  # the artifact (version 0) when the fleet aggregates async rounds
    async_buffer: int = 4


# Runs the fleet service until Ctrl-C; calls ready(history database path) once it listens. The
# CLI passes it in (api/cli/fleet.py): the launchers sit below the apps and never import them.
ServeFleet = Callable[[SwarmFleet, Callable[[str], None]], None]


def run_swarm(opts: SwarmOptions, serve_fleet: ServeFleet) -> None:
    """Run the demo until Ctrl-C/SIGTERM; everything started is stopped before returning.
    The caller checks that the fleet's port is free first (before minutes of work)."""
    token = opts.token or os.environ.get("FRACTAL_FLEET_TOKEN") or secrets.token_urlsafe(12)
    owns = opts.workdir is None
    if opts.workdir is not None:
        workdir = Path(opts.workdir)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="fractal-swarm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    swarm = Swarm(opts, token, workdir.resolve(), owns)
    try:
        from compiler import host_preset_name

        launchers: dict[str, tuple[list[str], dict[str, str]]] = {}
        if opts.emulate_riscv:  # checked before minutes of compiling
            launchers["riscv64"] = _riscv_node_env(Path(opts.riscv_sysroot or
                                                        Path(opts.cache_dir) / "sysroot-riscv64"))
        if opts.emulate_arm:
            sysroot = Path(opts.sysroot or Path(opts.cache_dir) / "sysroot-aarch64")
            launchers["aarch64"] = _arm_node_env(sysroot)
        model, train = opts.model()
        artifacts = {"host": demo_artifact(opts.cache_dir, host_preset_name(), model, train).resolve()}
        if opts.emulate_arm:
            artifacts["aarch64"] = demo_artifact(opts.cache_dir, "aarch64", model, train).resolve()
        if opts.emulate_riscv:
            artifacts["riscv64"] = demo_artifact(opts.cache_dir, RISCV_PRESET, model, train).resolve()
        swarm.start_broker()
        swarm.start_nodes(artifacts, launchers)
        swarm.wait_nodes_ready()
        swarm.start_sensors()
        swarm.watch_nodes()
        # the demo keeps its fleet history with its nodes (FRACTAL_FLEET_DB overrides)
        fleet = SwarmFleet(broker_url=swarm.broker_url, swarm=opts.swarm, host=opts.host, port=opts.port,
                           token=token, key_file=str(swarm.keys / "keys" / "fleet.key"),
                           keyring_file=str(swarm.keys / "keyring.json"), db=str(workdir / "fleet.sqlite"),
                           async_params=str(artifacts["host"]) if opts.async_buffer else "",
                           async_buffer=opts.async_buffer or 4)

        def banner(db_path: str) -> None:
            url = f"http://{opts.host}:{opts.port}/"
            kept = "" if opts.workdir is not None else " (temp dir, removed at exit; keep one: --workdir)"
            first = swarm.nodes[0]
            print(f"\nfractal swarm is up: {len(swarm.nodes)} nodes, broker {swarm.broker_url}\n"
                  f"  dashboard: {url}?token={token}\n"
                  f"  token:     {token}  (the fleet's and every node's)\n"
                  f"  nodes:     " + ", ".join(f"{n.node_id} {n.url}" for n in swarm.nodes) + "\n"
                  f"  try:       curl -s -H 'Authorization: Bearer {token}' {first.url}/v1/node\n"
                  f"  files:     {workdir}{kept}: node-N.toml (node configs), data/node-N/ (samples and\n"
                  f"             parameter versions), logs/node-N.log (node logs)\n"
                  f"  fleet db:  {db_path} (round history and operator actions)\n"
                  + (vibration_banner(workdir, opts.vibration) if swarm.vibration is not None else "")
                  + "Press Ctrl-C to stop everything.", flush=True)
            if swarm.vibration is not None:
                swarm.vibration.start_rounds(f"http://{opts.host}:{opts.port}", token, opts.vibration)

        serve_fleet(fleet, banner)
    except KeyboardInterrupt:
        pass
    finally:
        _say("stopping nodes, fleet and broker")
        try:
            swarm.stop()
        finally:
            signal.signal(signal.SIGTERM, previous)
        _say("stopped")


def vibration_banner(workdir: Path, opts: ScenarioOptions) -> str:
    """The vibration scenario's lines of the swarm's banner."""
    return (f"  faults:    {workdir / 'faults.json'} (the injected faults)\n"
            f"  rounds:    automatic: when every node holds {opts.min_samples} new windows, at least "
            f"{max(60.0, opts.round_every_s):g} s apart (dashboard: Automatic rounds)\n")
