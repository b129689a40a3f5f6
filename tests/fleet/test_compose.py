"""docker-compose.yml, deploy/Dockerfile and the Mosquitto configs, checked without Docker:
every service command parses as a real `fractal` invocation, ports/volumes/config files are
consistent, and the Mosquitto configs start a real Mosquitto that enforces what they say."""

from __future__ import annotations

import os
import pwd
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml

from api.cli import app
from edgenode.config import NodeConfig
from federation.broker import free_port, mosquitto_path
from federation.mqtt import MqttLink

try:  # recent typer vendors click; older releases use click itself
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover
    from click.exceptions import UsageError  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
CLI = typer.main.get_command(app)


def parse_fractal(argv: list[str]) -> tuple[str, dict]:
    """Parse ``fractal ...`` with the real CLI's click parser (types, required options, choices)."""
    assert argv[0] == "fractal", argv
    ctx = CLI.make_context("fractal", list(argv[1:]))
    # click keeps the sub-command and its args in (_)protected_args: the name moved in click 8.2
    protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])
    name, cmd, rest = CLI.resolve_command(ctx, [*protected, *ctx.args])
    sub = cmd.make_context(name, rest, parent=ctx)
    return name, sub.params


def container_ports(svc: dict) -> list[int]:
    return [int(str(p).rsplit(":", 1)[1]) for p in svc.get("ports", [])]


def host_ports(svc: dict) -> list[str]:
    return [str(p).rsplit(":", 1)[0] for p in svc.get("ports", [])]


def mounts(svc: dict) -> dict[str, str]:
    """container path -> source (bind path or named volume)."""
    out = {}
    for v in svc.get("volumes", []):
        src, dst, *_ = v.split(":")
        out[dst] = src
    return out


FRACTAL_SERVICES = [n for n, s in SERVICES.items() if s.get("command", [None])[0] == "fractal"]


def test_expected_services():
    assert {"mosquitto", "postgres", "node-1", "node-2", "node-3", "fleet"} <= set(SERVICES)
    assert sorted(FRACTAL_SERVICES) == ["feeder", "fleet", "fleet-standby", "node-1", "node-2", "node-3"]


@pytest.mark.parametrize("name", FRACTAL_SERVICES)
def test_service_command_is_a_valid_fractal_invocation(name):
    verb, params = parse_fractal(SERVICES[name]["command"])
    assert verb == {"feeder": "feed", "fleet": "fleet", "fleet-standby": "fleet"}.get(name, "node")
    svc = SERVICES[name]
    assert svc["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    assert (ROOT / svc["build"]["dockerfile"]).is_file()
    if verb == "fleet":
        assert params["port"] in container_ports(svc)
        broker = urlsplit(params["broker"])
        assert broker.hostname in SERVICES and broker.port == 1883
        assert "FRACTAL_FLEET_TOKEN" in svc["environment"]  # never a token baked into the file


def test_parser_rejects_bad_invocations():
    # The check above must be able to fail: a typo'd option or a missing required one.
    for bad in (["fractal", "fleet", "--brokr", "mqtt://x:1"], ["fractal", "fleet"],
                ["fractal", "node"], ["fractal", "nodes", "--config", "x"]):
        with pytest.raises(UsageError):
            parse_fractal(bad)


@pytest.mark.parametrize("name", [n for n in FRACTAL_SERVICES if n.startswith("node-")])
def test_node_configs_exist_and_match_ports_volumes_and_broker(name):
    svc = SERVICES[name]
    _, params = parse_fractal(svc["command"])
    vols = mounts(svc)
    src = vols[str(params["config"])]  # the --config file is mounted
    path = ROOT / src
    assert path.is_file(), f"{name}: {src} does not exist"
    cfg = NodeConfig.model_validate(tomllib.loads(path.read_text()))  # the node's own schema
    assert cfg.node_id == name
    assert cfg.port in container_ports(svc) and cfg.host == "0.0.0.0"
    assert cfg.advertised_url == f"http://{name}:{cfg.port}"
    assert str(cfg.data_dir) in vols and vols[str(cfg.data_dir)] in COMPOSE["volumes"]
    assert str(cfg.artifact).startswith("/opt/fractal/artifacts/")
    broker = urlsplit(cfg.broker)
    assert broker.hostname == "mosquitto" and broker.port == 1883


def test_ports_and_volumes_consistent():
    published = [p for s in SERVICES.values() for p in host_ports(s)]
    assert len(published) == len(set(published)), "two services publish the same host port"
    assert all(p.startswith("127.0.0.1:") for p in published), "publish on loopback only"
    used = {src for s in SERVICES.values() for src in mounts(s).values() if not src.startswith(".")}
    assert used == set(COMPOSE["volumes"]), "named volumes used and declared differ"
    for s in SERVICES.values():
        for src in mounts(s).values():
            if src.startswith("."):
                assert (ROOT / src).exists(), src
        for dep in s.get("depends_on", []):
            assert dep in SERVICES


def test_feeder_targets_the_node_services():
    _, params = parse_fractal(SERVICES["feeder"]["command"])
    for url in params["node"]:
        u = urlsplit(url)
        assert u.hostname in SERVICES and u.port in container_ports(SERVICES[u.hostname])


def test_dockerfile_installs_like_the_readme_and_builds_the_artifact():
    docker = (ROOT / "deploy/Dockerfile").read_text()
    readme = (ROOT / "README.md").read_text()
    install = re.search(r"RUN (python3 -m venv \.venv && \.venv/bin/pip install -e '\.\[compiler\]')\s*$",
                        docker, re.M)
    assert install and install.group(1) in readme
    compile_cmd = re.search(r"fractal compile (.*?)--quiet", docker, re.S).group(0)
    preset = "\"$(python -c 'from compiler import host_preset_name; print(host_preset_name())')\""
    argv = shlex.split(compile_cmd.replace("\\\n", " ").replace(preset, "x86_64"))
    verb, params = parse_fractal(argv)
    assert verb == "compile" and params["train"] and str(params["out"]) == "/opt/fractal/artifacts/digits-mlp"
    for d in ("compiler", "federation", "edgenode", "api", "deploy"):
        assert f"COPY {d} ./{d}" in docker


def test_compose_mosquitto_conf_serves_anonymous_clients(tmp_path):
    conf = (ROOT / "deploy/mosquitto/compose.conf").read_text()
    assert "listener 1883 0.0.0.0" in conf
    port = free_port()
    conf = conf.replace("listener 1883 0.0.0.0", f"listener {port} 127.0.0.1").replace("log_dest stdout", "")
    with _mosquitto(tmp_path, conf):
        MqttLink(f"mqtt://127.0.0.1:{port}", client_id="anon").close()


class _mosquitto:
    def __init__(self, tmp_path: Path, conf: str) -> None:
        self.path = tmp_path / "mosquitto.conf"
        # As root Mosquitto would switch to user "mosquitto", which cannot read pytest's tmp dir.
        self.path.write_text(conf + f"\nuser {pwd.getpwuid(os.geteuid()).pw_name}\n")
        self.port = int(re.search(r"^listener (\d+)", conf, re.M).group(1))

    def __enter__(self):
        self.proc = subprocess.Popen([mosquitto_path(), "-c", str(self.path)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        import socket
        import time
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise AssertionError("mosquitto did not start")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(5)


def test_podman_override_differs_from_docker_only_in_loopback():
    """deploy/compose/podman.yml (run for real by test_compose_podman.py) mounts node configs and a
    broker config of its own: they must stay the Docker ones but for listening on loopback."""
    def node(path: str) -> NodeConfig:
        return NodeConfig.model_validate(tomllib.loads((ROOT / path).read_text()))

    for k in (1, 2, 3):
        docker, podman = node(f"deploy/compose/node-{k}.toml"), node(f"deploy/compose/podman/node-{k}.toml")
        assert podman.host == "127.0.0.1" and podman.model_copy(update={"host": docker.host}) == docker
    override = (ROOT / "deploy/compose/podman.yml").read_text()
    for src in re.findall(r"- \./(\S+):/", override):
        assert (ROOT / src).is_file(), src
    conf = (ROOT / "deploy/mosquitto/compose.conf").read_text().replace("0.0.0.0", "127.0.0.1")
    podman_conf = (ROOT / "deploy/mosquitto/compose-podman.conf").read_text()
    def settings(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]

    assert settings(podman_conf) == settings(conf)


@pytest.mark.parametrize("name", ["fleet", "fleet-standby"])
def test_fleet_store_is_the_postgres_service(name):
    """The fleet's FRACTAL_FLEET_DATABASE names the postgres service's user, database and port; the
    password is one variable both take (compose refuses to start without it), never in the file."""
    pg, fleet = SERVICES["postgres"], SERVICES[name]
    url = urlsplit(fleet["environment"]["FRACTAL_FLEET_DATABASE"])
    assert url.scheme == "postgresql" and url.hostname == "postgres" and url.port == 5432
    assert url.password is None  # PGPASSWORD carries it
    assert url.username == pg["environment"]["POSTGRES_USER"]
    assert url.path == "/" + pg["environment"]["POSTGRES_DB"]
    secret = re.compile(r"\$\{FRACTAL_POSTGRES_PASSWORD:\?[^}]+\}")
    assert secret.fullmatch(pg["environment"]["POSTGRES_PASSWORD"])
    assert secret.fullmatch(fleet["environment"]["PGPASSWORD"])
    assert mounts(pg)[pg["environment"]["PGDATA"]] in COMPOSE["volumes"]  # the data outlives the container
    assert fleet["depends_on"]["postgres"] == {"condition": "service_healthy"}
    assert pg["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert "ports" not in pg  # on the compose network only


def test_standby_fleet_is_the_fleet_on_another_port():
    fleet, standby = SERVICES["fleet"], SERVICES["fleet-standby"]
    assert standby["profiles"] == ["standby"] and "profiles" not in fleet  # started on request only
    _, a = parse_fractal(fleet["command"])
    _, b = parse_fractal(standby["command"])
    # the same fleet on another port, which lets the primary take the lead first (--standby-for)
    assert {**b, "port": a["port"], "standby_for": None} == a and b["port"] != a["port"]
    assert a["standby_for"] is None and b["standby_for"] == f"http://fleet:{a['port']}"
    assert standby["environment"] == fleet["environment"] and standby["depends_on"] == fleet["depends_on"]


def test_podman_override_fleet_and_postgres_match_docker():
    """Under Podman the fleet waits for PostgreSQL, then runs Docker's command but on loopback; the
    postgres script initialises with Docker's variables and listens on loopback only."""
    override = yaml.safe_load((ROOT / "deploy/compose/podman.yml").read_text().replace("!reset", ""))
    for name in ("fleet", "fleet-standby"):
        cmd = override["services"][name]["command"]
        assert cmd[:2] == ["sh", "-c"] and "pg_isready" in cmd[2] and cmd[3] == "wait-for-postgres"
        docker = list(SERVICES[name]["command"])
        docker[docker.index("--host") + 1] = "127.0.0.1"
        assert cmd[4:] == docker
        parse_fractal(cmd[4:])
    hosts = {h.split(":")[0] for h in override["x-loopback"]["extra_hosts"]}
    assert hosts >= set(SERVICES) - {"feeder"}
    script = (ROOT / "deploy/compose/podman/postgres.sh").read_text()
    for var in ("PGDATA", "POSTGRES_USER", "POSTGRES_DB", "POSTGRES_PASSWORD"):
        assert f"${{{var}" in script and var in SERVICES["postgres"]["environment"]
    assert "listen_addresses=127.0.0.1" in script
    assert override["services"]["postgres"]["user"] == "postgres"
