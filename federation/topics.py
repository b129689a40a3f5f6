"""MQTT topic tree, versioned under ``fractal/v1/``. The one place topic strings are built.

    fractal/v1/{swarm}/status/{node}                retained JSON NodeStatus; Last Will = offline status
    fractal/v1/{swarm}/cmd                          JSON commands to all nodes (RoundCommand, RoundAbort)
    fractal/v1/{swarm}/rounds/{round_id}/events/{node}
                                                    JSON RoundEvent (step loss, done + hash, failed)
    fractal/v1/{swarm}/ar/{dst}                     binary allreduce frames addressed to member dst
    fractal/v1/{swarm}/ack/{dst}                    binary flow-control acks addressed to member dst
    fractal/v1/{swarm}/params/{dst}                 binary parameter transfer to a joining member dst
    fractal/v1/{swarm}/x/ar/{dst}                   allreduce frames between site leaders (the
                                                    subtree site brokers bridge to the backbone)
    fractal/v1/{swarm}/async/up/{node}              binary update of node (sync = "async": a
                                                    parameter delta from a base version)
    fractal/v1/{swarm}/async/version                retained binary global version (the aggregator's)
"""

from __future__ import annotations

__all__ = [
    "ROOT",
    "status",
    "status_all",
    "command",
    "round_events",
    "round_events_all",
    "allreduce",
    "ack",
    "params",
    "validate_id",
    "backbone_allreduce",
    "BACKBONE_BRIDGE",
    "async_update",
    "async_updates_all",
    "async_version",
]

import re

ROOT = "fractal/v1"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_id(value: str, what: str = "id") -> str:
    """Swarm, node and round ids become topic levels: no '/', '+', '#', spaces or empties."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(
            f"invalid {what} {value!r}: use 1-64 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return value


def status(swarm: str, node: str) -> str:
    return f"{ROOT}/{swarm}/status/{node}"


def status_all(swarm: str) -> str:
    return f"{ROOT}/{swarm}/status/+"


def command(swarm: str) -> str:
    return f"{ROOT}/{swarm}/cmd"


def round_events(swarm: str, round_id: str, node: str) -> str:
    return f"{ROOT}/{swarm}/rounds/{round_id}/events/{node}"


def round_events_all(swarm: str) -> str:
    return f"{ROOT}/{swarm}/rounds/+/events/+"


def allreduce(swarm: str, dst: str) -> str:
    return f"{ROOT}/{swarm}/ar/{dst}"


def ack(swarm: str, dst: str) -> str:
    return f"{ROOT}/{swarm}/ack/{dst}"


def params(swarm: str, dst: str) -> str:
    return f"{ROOT}/{swarm}/params/{dst}"


# The one topic subtree a site's broker bridges to the backbone broker (deploy/mosquitto/).
BACKBONE_BRIDGE = f"{ROOT}/+/x/#"


def backbone_allreduce(swarm: str, dst: str) -> str:
    return f"{ROOT}/{swarm}/x/ar/{dst}"


def async_update(swarm: str, node: str) -> str:
    return f"{ROOT}/{swarm}/async/up/{node}"


def async_updates_all(swarm: str) -> str:
    return f"{ROOT}/{swarm}/async/up/+"


def async_version(swarm: str) -> str:
    return f"{ROOT}/{swarm}/async/version"
