"""Tell the fleet that this board halted: no slot may boot (``fractal boot`` exits 78).

Without this the fleet only sees the node go offline. When the device's node settings (a slot's
node config template + ``data/node.extra.toml``, as :func:`firmware.boot.node_config` writes them)
name a broker, the supervisor publishes the node's retained status once with state ``halted``
and ``halt`` = why (``federation.messages.NodeStatus``), signed with the node's ``key_file``
exactly as the node signs its own status (``federation.signed``) when the config has one. It is
best effort: a broker that cannot be reached is logged and the board halts all the same.

The template comes from a slot whose files still verify when there is one (a slot below the
rollback floor still verifies: its template is the signed one), else from any slot that has one.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from firmware.device import Device, verify_slot
from firmware.errors import FirmwareError
from firmware.manifest import NODE_TEMPLATE_MEMBER
from fractal import FractalError

__all__ = ["announce_halt", "HALT_PUBLISH_TIMEOUT_S"]

HALT_PUBLISH_TIMEOUT_S = 10.0  # connect, then the broker's PUBACK: each within this


def _settings(dev: Device, config_for: Callable[[str], Path]) -> tuple[dict[str, Any], Path] | None:
    """The node config the device would run with (parsed) and its path; None when no slot has a template."""
    slots = [s for s in ("a", "b") if (dev.slot(s) / NODE_TEMPLATE_MEMBER).is_file()]
    verified = []
    for s in slots:
        try:
            verify_slot(dev, s)
        except FirmwareError:
            continue
        verified.append(s)
    for s in verified + [s for s in slots if s not in verified]:
        cfg = config_for(s)
        try:
            return tomllib.loads(cfg.read_text()), cfg
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            continue
    return None


def _path(value: object, base: Path) -> Path | None:
    if not isinstance(value, str) or not value:
        return None
    p = Path(value)
    return p if p.is_absolute() else base / p


def announce_halt(dev: Device, why: str, *, node_id: str, config_for: Callable[[str], Path],
                  log: Callable[[str], None]) -> bool:
    """Publish the retained ``halted`` status when the node settings name a broker; True when the
    broker acknowledged it. ``config_for(slot)`` writes the node config the slot would run with
    (``firmware.boot.node_config``). Never raises: the board halts whatever the broker does."""
    try:
        state = dev.load_state()
        found = _settings(dev, config_for)
    except (FractalError, OSError) as exc:
        log(f"cannot read the node settings to tell the fleet: {exc}")
        return False
    if found is None:
        return False
    doc, cfg = found
    broker = doc.get("broker")
    if not isinstance(broker, str) or not broker:
        return False  # no swarm: nobody to tell
    try:
        return _publish(doc, cfg, broker, why, node_id=str(doc.get("node_id") or node_id),
                        arch=state.arch, board=str(doc.get("board") or state.board))
    except (FractalError, OSError, ValueError) as exc:  # ValueError: pydantic bounds on the settings
        log(f"could not tell the fleet that this board halted: {exc}")
        return False


def _publish(doc: dict[str, Any], cfg: Path, broker: str, why: str, *, node_id: str, arch: str,
             board: str) -> bool:
    from federation import topics
    from federation.errors import FederationError
    from federation.messages import NodeState, NodeStatus
    from federation.mqtt import MqttLink

    swarm = str(doc.get("swarm") or "default")
    status = NodeStatus(
        node_id=node_id, state=NodeState.HALTED, arch=arch, board=board,
        site=doc.get("site") if isinstance(doc.get("site"), str) else None, halt=why,
    )
    key_file = _path(doc.get("key_file"), cfg.parent)
    keyring_file = _path(doc.get("keyring_file"), cfg.parent)
    identity = None
    if key_file is not None and keyring_file is not None:
        from federation.signed import load_identity  # `cryptography` only for signed swarms

        identity = load_identity(key_file, keyring_file)
        if identity.signer.sender != node_id:
            raise FederationError(f"key_file {key_file} belongs to {identity.signer.sender!r}, "
                                  f"not to this node ({node_id!r})")
    # A client id of its own: never kicks a node of the same id off the broker, and no Last Will
    # (a clean disconnect after the PUBACK leaves the halted status retained).
    raw = MqttLink(broker, swarm=swarm, client_id=f"{node_id}-boot", connect_timeout=HALT_PUBLISH_TIMEOUT_S)
    try:
        link = raw if identity is None else identity.link(raw)
        info = link.publish(topics.status(swarm, node_id), status.model_dump_json(), retain=True, qos=1)
        info.wait_for_publish(HALT_PUBLISH_TIMEOUT_S)
        return bool(getattr(info, "is_published", lambda: True)())
    finally:
        raw.close()
