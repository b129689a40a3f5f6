"""`fractal fleet` (the fleet service + dashboard) and `fractal swarm` (the local demo)."""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from api.cli import app
from api.fleet.errors import FleetError
from api.fleet.serve import serve_fleet

if TYPE_CHECKING:
    from deploy.swarm import SwarmFleet

__all__ = ["fleet", "swarm", "serve_fleet"]  # serve_fleet: re-exported from api.fleet.serve


class Scenario(enum.StrEnum):
    DIGITS = "digits"
    VIBRATION = "vibration"


def _settings(**flags):
    from pydantic import ValidationError

    from api.fleet.settings import FleetSettings

    try:
        return FleetSettings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise FleetError(f"invalid setting {where}: {err['msg']}",
                         hint="check the flags and FRACTAL_FLEET_* environment variables") from None


@app.command()
def fleet(
    broker: str = typer.Option(..., "--broker", envvar="FRACTAL_FLEET_BROKER",
                               help="Broker URL, mqtt://[user:pass@]host:port or mqtts://..."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="HTTP port of the API and dashboard."),
    token: str | None = typer.Option(None, "--token", help="Operator token (default: $FRACTAL_FLEET_TOKEN, "
                                     "else a random one is printed)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (0.0.0.0 for all)."),
    swarm_id: str = typer.Option("default", "--swarm", help="Swarm id (MQTT topic level)."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="CA certificate for an mqtts:// broker."),
    db: Path | None = typer.Option(None, "--db", help="SQLite file of round history and operator actions "
                                   "(default: $FRACTAL_FLEET_DB, else the user data dir, per swarm)."),
    database: str | None = typer.Option(None, "--database", envvar="FRACTAL_FLEET_DATABASE",
                                        help="PostgreSQL instead of the SQLite file: postgresql://USER:PW@HOST"
                                        ":PORT/DB. Several fleet processes may share it: one leads, the "
                                        "others serve reads and the dashboard (docs/operations.md)."),
    key: Path | None = typer.Option(None, "--key",
                                    help="The fleet's signing key (deploy/keys.py: keys/fleet.key)."),
    keyring: Path | None = typer.Option(None, "--keyring",
                                        help="The swarm keyring (deploy/keys.py: keyring.json); with --key, "
                                        "unsigned or forged member messages are dropped."),
    async_params: Path | None = typer.Option(None, "--async-params", help="Aggregate asynchronous rounds "
                                             "(nodes with [training] sync = \"async\"), starting from this "
                                             "artifact directory's parameters (version 0)."),
    async_buffer: int = typer.Option(4, "--async-buffer", min=1, max=256,
                                     help="Async: updates per new version (K)."),
    async_max_staleness: int = typer.Option(4, "--async-max-staleness", min=0, max=1000,
                                            help="Async: refuse updates more than this many versions "
                                            "behind (S)."),
    standby_for: str | None = typer.Option(None, "--standby-for", help="Start as the standby of the fleet "
                                           "process at this URL (same --database): wait until it leads, "
                                           "at most --standby-wait seconds, before contending for the lead."),
    standby_wait: float = typer.Option(60.0, "--standby-wait", min=0.0, max=3600.0,
                                       help="With --standby-for: how long to give the other process."),
) -> None:
    """Run the fleet service: node registry, training rounds, event stream and dashboard."""
    if db is not None and database:
        raise FleetError("--db (a SQLite file) and --database (PostgreSQL) exclude each other",
                         hint="pass one of them")
    if (key is None) != (keyring is None):
        raise FleetError("--key and --keyring go together", hint="make both with python -m deploy.keys")
    settings = _settings(broker=broker, port=port, token=token, host=host, swarm=swarm_id,
                         tls_ca=str(tls_ca) if tls_ca else None, db=str(db) if db else None,
                         database=database, key_file=str(key) if key else None,
                         keyring_file=str(keyring) if keyring else None,
                         **({"async_params": str(async_params), "async_buffer": async_buffer,
                             "async_max_staleness": async_max_staleness} if async_params else {}))
    if settings.async_params:  # a bad path is a one-line error now, not a failed start later
        from api.fleet.asyncrounds import load_version0

        load_version0(settings.async_params)
    if not settings.token:
        settings = settings.model_copy(update={"token": secrets.token_urlsafe(18)})
        typer.echo(f"operator token (generated): {settings.token}")
    if standby_for is not None:
        from urllib.parse import urlsplit

        if not settings.database:
            raise FleetError("--standby-for needs --database "
                             "(PostgreSQL shared with the other fleet process)",
                             hint="a fleet on its own SQLite file leads alone")
        parts = urlsplit(standby_for)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FleetError(f"bad --standby-for URL {standby_for!r}", hint="give http://HOST:PORT of the "
                             "other fleet process")
        from api.fleet.serve import wait_for_leader

        if not wait_for_leader(standby_for, standby_wait):
            typer.echo(f"{standby_for} did not lead within {standby_wait:g} s: contending for the lead",
                       err=True)
    url = f"http://{'127.0.0.1' if settings.host in ('0.0.0.0', '::') else settings.host}:{settings.port}/"
    serve_fleet(settings, ready=lambda: typer.echo(f"fleet dashboard: {url}", err=False))


@app.command()
def swarm(
    nodes: int = typer.Option(3, "--nodes", "-n", min=2, max=16, help="How many edge nodes to start."),
    emulate_arm: bool = typer.Option(False, "--emulate-arm", help="Run one node as aarch64 under qemu-user "
                                     "(needs the sysroot: make sysroot)."),
    emulate_riscv: bool = typer.Option(False, "--emulate-riscv", help="Run one node as riscv64 under "
                                       "qemu-user with the model's C library (needs make sysroot-riscv64); "
                                       "combines with --emulate-arm."),
    sites: int = typer.Option(1, "--sites", min=1, max=8, help="Split the nodes over this many sites, "
                              "each with its own Mosquitto bridged to a backbone (hierarchical rounds, "
                              "federation/PROTOCOL.md section 10)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="HTTP port of the fleet dashboard."),
    broker: str | None = typer.Option(None, "--broker", help="Use this broker instead of starting one."),
    token: str | None = typer.Option(None, "--token", help="Operator token (default: random, printed)."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Node configs, data and logs "
                                        "(default: a fresh temp dir)."),
    cache_dir: Path = typer.Option(Path(".cache"), "--cache-dir",
                                   help="Where the compiled demo model is cached."),
    feed_rate: float = typer.Option(40.0, "--feed-rate", min=0.1, help="Samples per second per node "
                                    "from the simulated sensors."),
    sysroot: Path | None = typer.Option(None, "--sysroot", help="aarch64 sysroot for --emulate-arm "
                                        "(default: CACHE_DIR/sysroot-aarch64, made by `make sysroot`)."),
    riscv_sysroot: Path | None = typer.Option(None, "--riscv-sysroot", help="riscv64 sysroot for "
                                              "--emulate-riscv (default: CACHE_DIR/sysroot-riscv64, made by "
                                              "`make sysroot-riscv64`)."),
    scenario: Scenario = typer.Option(Scenario.DIGITS, "--scenario", help="digits: handwritten digits POSTed "
                                      "with labels (a classifier); vibration: simulated machines publishing "
                                      "accelerometer SenML over MQTT with injected faults (an anomaly "
                                      "autoencoder learning without labels)."),
    speed: float = typer.Option(1.0, "--speed", min=0.1, max=20.0, help="vibration: simulated seconds per "
                                "second (faster fills the nodes sooner)."),
    round_every: float = typer.Option(60.0, "--round-every", min=60.0, help="vibration: at least this many "
                                      "seconds between the fleet's automatic rounds (they start when every "
                                      "node holds --min-samples new windows)."),
    round_steps: int = typer.Option(200, "--round-steps", min=1, max=10000,
                                    help="vibration: steps per round."),
    round_lr: float = typer.Option(0.003, "--round-lr", min=1e-6, max=1.0, help="vibration: learning rate "
                                   "of the rounds (Adam)."),
    fault_severity: float = typer.Option(1.0, "--fault-severity", min=0.05, max=2.0,
                                         help="vibration: how far the injected faults depart from normal "
                                         "(smaller is subtler)."),
    min_samples: int = typer.Option(150, "--min-samples", min=1, help="vibration: new windows every node "
                                    "holds before the fleet starts a round."),
    async_buffer: int = typer.Option(0, "--async", min=0, max=256, help="Asynchronous rounds: the nodes "
                                     "train whenever they have samples and the fleet makes a new version "
                                     "every N updates (GET /api/async); 0: synchronous rounds."),
) -> None:
    """The demo: a broker, N edge nodes fed by simulated sensors, and the fleet dashboard."""
    from api.fleet.serve import check_port_free
    from deploy.swarm import SwarmOptions, run_swarm
    from deploy.vibration_scenario import ScenarioOptions

    if sites > nodes:
        raise FleetError(f"--sites {sites} is more than --nodes {nodes}", hint="every site needs a node")
    if sites > 1 and scenario is Scenario.VIBRATION:
        raise FleetError("--scenario vibration runs on one broker", hint="leave out --sites")
    if sites > 1 and broker:
        raise FleetError("--sites starts its own brokers", hint="leave out --broker")
    if async_buffer and (sites > 1 or scenario is Scenario.VIBRATION):
        raise FleetError("--async runs the digits scenario on one broker",
                         hint="leave out --sites and --scenario")
    opts = SwarmOptions(nodes=nodes, sites=sites, emulate_arm=emulate_arm, emulate_riscv=emulate_riscv,
                        port=port, broker=broker, token=token, workdir=workdir, cache_dir=cache_dir,
                        feed_rate=feed_rate, sysroot=sysroot, riscv_sysroot=riscv_sysroot,
                        scenario=scenario.value, async_buffer=async_buffer,
                        vibration=ScenarioOptions(speed=speed, round_every_s=round_every,
                                                  round_steps=round_steps, round_lr=round_lr,
                                                  min_samples=min_samples, fault_severity=fault_severity))
    check_port_free(opts.host, opts.port)  # fail before minutes of work
    run_swarm(opts, _serve_swarm_fleet)


def _serve_swarm_fleet(fleet: SwarmFleet, ready: Callable[[str], None]) -> None:
    """The demo swarm's fleet service, in this process (deploy/swarm.py calls it once the nodes
    are up; the launchers never import the apps)."""
    from api.fleet.settings import FleetSettings

    settings = FleetSettings(broker=fleet.broker_url, swarm=fleet.swarm, host=fleet.host, port=fleet.port,
                             token=fleet.token, key_file=fleet.key_file, keyring_file=fleet.keyring_file,
                             async_params=fleet.async_params, async_buffer=fleet.async_buffer)
    if not settings.db:
        settings = settings.model_copy(update={"db": fleet.db})
    serve_fleet(settings, ready=lambda: ready(str(settings.db_path())))


@app.command()
def feed(
    node: list[str] = typer.Option(..., "--node", help="Node API URL (http://host:port); repeat per node."),
    token: str | None = typer.Option(None, "--token", envvar="FRACTAL_NODE_TOKEN",
                                     help="Bearer token of the nodes' API, if they have one."),
    rate: float = typer.Option(40.0, "--rate", min=0.1, help="Samples per second per node."),
    seed: int = typer.Option(0, "--seed", help="Seed of the uneven, non-IID split."),
) -> None:
    """Simulated sensors: stream sklearn digits (split unevenly, non-IID) to nodes' POST /v1/samples."""
    from deploy.sensors import Feeder, digits_shards

    shards = digits_shards(len(node), seed=seed)
    feeders = [Feeder(url, shard, token=token, rate=rate) for url, shard in zip(node, shards, strict=True)]
    for f in feeders:
        f.start()
        typer.echo(f"feeding {len(f.shard.y)} samples to {f.url}")
    try:
        for f in feeders:
            while f.is_alive():
                f.join(0.5)
    finally:
        for f in feeders:
            f.stop()
    failed = [f.error for f in feeders if f.error]
    if failed:
        raise FleetError(failed[0], hint="check the node URL and token")
    typer.echo("done: " + ", ".join(f"{f.url} {f.sent}" for f in feeders))
