"""Broker credentials without a broker restart: Mosquitto's dynamic-security plugin.

The fleet (or an operator script) connects as the plugin's admin client and sends commands on
``$CONTROL/dynamic-security/v1``; answers arrive on ``$CONTROL/dynamic-security/v1/response``.
The plugin applies them at once: a created client can connect immediately, a deleted client is
disconnected by the broker and cannot reconnect. Nothing is reloaded, no signal is sent, so the
fleet needs no access to the broker's host (a password file + SIGHUP, as ``deploy/keys.py`` does,
only works for a broker on the fleet's own machine).

The roles this module makes (:func:`swarm_role`): ``fractal-{swarm}-node``, publish and subscribe
under ``fractal/v1/{swarm}/#``. A device without a client here (pending, rejected, revoked) cannot
connect at all (``allow_anonymous false``): it can publish nothing; its only channel is the fleet's
HTTP enrolment route. Signatures (``federation/auth.py``) stay the first wall inside the swarm.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
from pathlib import Path
from typing import Any

from federation.errors import TransportError
from federation.mqtt import parse_url

__all__ = ["DynsecAdmin", "DynsecError", "DynsecRefused", "swarm_role", "init_config", "PLUGIN",
           "CONTROL_TOPIC"]

CONTROL_TOPIC = "$CONTROL/dynamic-security/v1"
RESPONSE_TOPIC = CONTROL_TOPIC + "/response"


def plugin_path() -> str:
    """Where Debian's mosquitto package put the plugin (``/usr/lib/<multiarch>/``)."""
    import glob

    found = sorted(glob.glob("/usr/lib/*/mosquitto_dynamic_security.so"))
    return found[0] if found else "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so"


PLUGIN = plugin_path()


class DynsecError(TransportError):
    """The plugin refused a command (``refused``: its error text) or did not answer in time."""

    refused = False


class DynsecRefused(DynsecError):
    refused = True


def swarm_role(swarm: str) -> str:
    return f"fractal-{swarm}-node"


def init_config(path: str | Path, admin: str, password: str) -> Path:
    """Write a fresh dynamic-security JSON file with one admin client (``mosquitto_ctrl dynsec init``)."""
    path = Path(path)
    proc = subprocess.run(["mosquitto_ctrl", "dynsec", "init", str(path), admin, password],
                          capture_output=True, text=True, check=False, timeout=30)
    if proc.returncode != 0:
        raise DynsecError(f"mosquitto_ctrl dynsec init failed: {proc.stderr.strip() or proc.stdout.strip()}",
                          hint="install the mosquitto-clients package")
    path.chmod(0o600)
    return path


class DynsecAdmin:
    """A connection as the dynamic-security admin; :meth:`command` waits for the plugin's answer.

    ``url``: ``mqtt://ADMIN:PASSWORD@host:port`` (the admin's credentials in the URL)."""

    def __init__(self, url: str, *, timeout: float = 10.0, client_id: str | None = None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.timeout = timeout
        a = parse_url(url)
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2,
                                   client_id=client_id or f"fractal-dynsec-{secrets.token_hex(4)}")
        if a.username is None:
            raise DynsecError("the dynamic-security admin URL carries no user name",
                              hint="mqtt://ADMIN:PASSWORD@host:port")
        self._client.username_pw_set(a.username, a.password)
        if a.tls:
            self._client.tls_set()
        self._lock = threading.Lock()  # one command in flight: answers carry no correlation id
        self._answer: list[dict[str, Any]] = []
        self._got = threading.Event()
        self._ready = threading.Event()
        self._refused: str | None = None
        self._client.on_connect = self._on_connect
        self._client.on_message = self._on_message
        self._client.on_subscribe = lambda *a, **k: self._ready.set()
        try:
            self._client.connect(a.host, a.port, 30)
        except OSError as exc:
            raise DynsecError(f"cannot connect to the broker at {a.host}:{a.port}: {exc}") from None
        self._client.loop_start()
        if not self._ready.wait(timeout):
            self.close()
            raise DynsecError(f"the dynamic-security admin could not connect/subscribe "
                              f"({self._refused or 'no answer'})",
                              hint="check the admin credentials and that the broker loads the plugin")

    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        if reason_code.is_failure:
            self._refused = str(reason_code)
            return
        client.subscribe(RESPONSE_TOPIC, qos=1)

    def _on_message(self, client, userdata, msg) -> None:
        try:
            self._answer = json.loads(msg.payload).get("responses", [])
        except (ValueError, AttributeError):
            self._answer = [{"error": "malformed answer"}]
        self._got.set()

    def command(self, *commands: dict[str, Any]) -> list[dict[str, Any]]:
        """Send ``commands`` in one request; the plugin's responses; DynsecError on any error."""
        with self._lock:
            self._got.clear()
            self._client.publish(CONTROL_TOPIC, json.dumps({"commands": list(commands)}), qos=1)
            if not self._got.wait(self.timeout):
                raise DynsecError(f"no answer from the dynamic-security plugin within {self.timeout:.0f} s")
            answers = self._answer
        errors = [f"{a.get('command')}: {a['error']}" for a in answers if a.get("error")]
        if errors:
            raise DynsecRefused("dynamic security refused " + "; ".join(errors))
        return answers

    def ensure_swarm_role(self, swarm: str) -> str:
        """Create the swarm's node role when missing; its name."""
        role = swarm_role(swarm)
        try:
            self.command({"command": "getRole", "rolename": role})
            return role
        except DynsecRefused:
            pass
        base = f"fractal/v1/{swarm}/#"
        self.command({"command": "createRole", "rolename": role, "acls": [
            {"acltype": "publishClientSend", "topic": base, "allow": True},
            {"acltype": "publishClientReceive", "topic": base, "allow": True},
            {"acltype": "subscribePattern", "topic": base, "allow": True},
            {"acltype": "unsubscribePattern", "topic": base, "allow": True}]})
        return role

    def create_client(self, username: str, password: str, roles: list[str]) -> None:
        """A client that may connect now; an existing one of that name is replaced (new password)."""
        try:
            self.command({"command": "deleteClient", "username": username})
        except DynsecRefused:
            pass  # not there yet
        self.command({"command": "createClient", "username": username, "password": password,
                      "roles": [{"rolename": r} for r in roles]})

    def delete_client(self, username: str) -> bool:
        """Remove a client (the broker disconnects it); False when there was none."""
        try:
            self.command({"command": "deleteClient", "username": username})
        except DynsecRefused:
            return False
        return True

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()
