"""A signed fleet that devices enrol into (issue 25 item 5), real processes, shared by the enrolment
end-to-end test (tests/fleet/test_enrollment_e2e.py) and the booted board images
(tests/firmware/test_os_image.py); auto-loaded by ``tests/conftest.py``.

* :func:`start_dynsec_broker`: a Mosquitto with the dynamic-security plugin and no anonymous
  access (admin ``admin``/``admin-pw``); ``dynsec_broker`` is one for a test.
* :func:`signed_fleet`: on such a broker, a swarm role, broker clients for the fleet and the named
  members, the swarm's keys (``deploy.keys.provision``) and a signed fleet service (uvicorn thread)
  that manages the broker's clients (it makes accepted devices' clients). Yields a
  :class:`SignedFleet`: ``client`` is an httpx client with the operator's token, ``member(name)``
  what a member node needs (broker URL with its credentials, key file, its own keyring copy).
* :func:`wait_for`: poll a predicate until it is truthy, failing after a deadline.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from federation.broker import MosquittoBroker, start_mosquitto

OPERATOR_TOKEN = "op-token-e2e"
DYNSEC_ADMIN = "admin:admin-pw"


def wait_for(pred: Callable[[], Any], timeout: float, what: str, poll_s: float = 0.1) -> Any:
    """``pred()``'s first truthy value; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(poll_s)
    return v


def start_dynsec_broker(workdir: Path) -> MosquittoBroker:
    """Mosquitto with the dynamic-security plugin (admin ``admin``), anonymous clients refused."""
    from federation.dynsec import PLUGIN, init_config

    workdir.mkdir(parents=True, exist_ok=True)
    user, pw = DYNSEC_ADMIN.split(":")
    cfg = init_config(workdir / "dynsec.json", user, pw)
    return start_mosquitto(workdir=workdir, extra_config=f"allow_anonymous false\nplugin {PLUGIN}\n"
                                                         f"plugin_opt_config_file {cfg}")


@pytest.fixture
def dynsec_broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    broker = start_dynsec_broker(tmp_path / "mosquitto")
    try:
        yield broker
    finally:
        broker.close()


@dataclass
class SignedFleet:
    broker: MosquittoBroker
    swarm: str
    workdir: Path
    url: str
    client: httpx.Client

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.broker.port}"

    def member(self, name: str) -> dict[str, str]:
        """NODE.toml keys of a member made at start: its broker credentials, key, own keyring copy."""
        ring = self.workdir / f"{name}-keyring.json"
        if not ring.exists():
            shutil.copy(self.workdir / "keys" / "keyring.json", ring)
        return {"broker": f"mqtt://{name}:{name}-pw@{self.host}", "swarm": self.swarm,
                "key_file": str(self.workdir / "keys" / "keys" / f"{name}.key"), "keyring_file": str(ring)}

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.client.get("/api/nodes").json()["nodes"])

    def node(self, node_id: str) -> dict[str, Any] | None:
        return next((n for n in self.nodes() if n["node_id"] == node_id), None)

    def enrollment(self, device_id: str, state: str) -> dict[str, Any] | None:
        rows = self.client.get("/api/enrollments").json()["enrollments"]
        return next((r for r in rows if r["device_id"] == device_id and r["state"] == state), None)


@contextmanager
def signed_fleet(workdir: Path, broker: MosquittoBroker, swarm: str, members: list[str], *,
                 device_broker: str = "", tick_s: float = 0.05, image_keys: list[str] | None = None,
                 public_host: str = "", rollout_stage_timeout_s: float = 900.0) -> Iterator[SignedFleet]:
    """A signed fleet service of ``swarm`` on ``broker`` (dynsec) with broker clients and keys for
    ``members``; ``device_broker``: the broker URL accepted devices get (default: the fleet's).
    ``image_keys``: release public keys of an image catalogue (in ``workdir/images``);
    ``public_host``: the host nodes reach the fleet as (its roll-outs' download URLs)."""
    from api.fleet.settings import FleetSettings
    from api.fleet_app import create_fleet_app
    from api.serving import ServerThread
    from deploy.keys import provision
    from federation.dynsec import DynsecAdmin

    host = f"127.0.0.1:{broker.port}"
    admin = DynsecAdmin(f"mqtt://{DYNSEC_ADMIN}@{host}")
    try:
        role = admin.ensure_swarm_role(swarm)
        admin.create_client("fleet", "fleet-pw", [role])
        for m in members:
            admin.create_client(m, f"{m}-pw", [role])
    finally:
        admin.close()
    keys = workdir / "keys"
    provision(keys, swarm, members)
    settings = FleetSettings(broker=f"mqtt://fleet:fleet-pw@{host}", swarm=swarm, token=OPERATOR_TOKEN,
                             tick_s=tick_s, key_file=str(keys / "keys/fleet.key"),
                             keyring_file=str(keys / "keyring.json"), db=str(workdir / "fleet.sqlite"),
                             dynsec_admin=f"mqtt://{DYNSEC_ADMIN}@{host}", device_broker=device_broker,
                             images_dir=str(workdir / "images") if image_keys else "",
                             image_keys=image_keys or [], rollout_stage_timeout_s=rollout_stage_timeout_s)
    srv = ServerThread(create_fleet_app(settings), lifespan="on", timeout_graceful_shutdown=1).start()
    if public_host:  # known once the server is bound; the service reads it at each roll-out
        settings.public_url = f"http://{public_host}:{srv.port}"
    client = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}, timeout=30)
    try:
        yield SignedFleet(broker, swarm, workdir, srv.url, client)
    finally:
        client.close()
        srv.stop()
