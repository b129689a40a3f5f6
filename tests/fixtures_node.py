"""Edge-node fixtures shared by every area's tests (auto-loaded by ``tests/conftest.py``).

* ``digits_artifact`` comes from ``tests/fixtures_compiler.py`` (digits-mlp for this machine,
  training module ce/sgd/lr 0.1/batch 32); the node tests use it too.
* ``node_factory``: ``make(node_id, artifact_dir, *, broker=None, swarm="default", transport=None,
  artifact=None, start=True, **toml_keys) -> EdgeNode``. Writes ``NODE.toml`` under the test's
  tmp dir, loads it through the real config loader, starts the node; every node made is stopped
  after the test. ``artifact=`` shares one loaded Artifact between in-process nodes.
* ``digits_data``: sklearn's digits scaled to [0, 1]: ``(x float32 [N, 64], y int64 [N])``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DIGITS_BATCH = 32  # training batch and lr of the shared digits_artifact (fixtures_compiler.py)
DIGITS_LR = 0.1


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_node_toml(path: Path, keys: dict[str, Any]) -> Path:
    """Write a NODE.toml from a flat dict plus optional ``training``/``store`` sub-dicts."""
    lines, tables = [], []
    for k, v in keys.items():
        if isinstance(v, dict):
            tables.append(f"\n[{k}]")
            tables += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items() if vv is not None]
        elif v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines + tables) + "\n")
    return path


@pytest.fixture(scope="session")
def digits_data() -> tuple[np.ndarray, np.ndarray]:
    """sklearn digits: x float32 [1797, 64] in [0, 1], y int64 [1797]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``make(node_id, artifact_dir, **kw) -> EdgeNode`` (see module docstring); stopped afterwards."""
    from edgenode.config import load_config
    from edgenode.node import EdgeNode

    nodes: list[EdgeNode] = []

    def make(node_id: str, artifact_dir: Path, *, broker: str | None = None, swarm: str = "default",
             transport: Any = None, artifact: Any = None, start: bool = True, **keys: Any) -> EdgeNode:
        base = tmp_path / node_id
        cfg_path = write_node_toml(base / "NODE.toml", {
            "node_id": node_id, "artifact": str(artifact_dir), "port": keys.pop("port", 0),
            "data_dir": str(keys.pop("data_dir", base / "data")), "broker": broker, "swarm": swarm,
            "heartbeat_s": keys.pop("heartbeat_s", 1.0), **keys})
        node = EdgeNode(load_config(cfg_path), artifact=artifact, transport=transport)
        nodes.append(node)
        if start:
            node.start()
        return node

    yield make
    for n in nodes:
        try:
            n.stop(timeout=5)
        except Exception:  # noqa: BLE001 - teardown of one node must not hide the others
            pass


class SwarmWatch:
    """What a fleet sees of a swarm over MQTT: every RoundEvent and the latest NodeStatus per node.

    Read ``events`` / ``statuses`` under ``lock``; the link's subscription threads write them.
    """

    def __init__(self, link: Any, swarm: str) -> None:
        import threading

        from federation import topics
        from federation.messages import parse_event, parse_status

        self.events: list[Any] = []
        self.statuses: dict[str, Any] = {}
        self.lock = threading.Lock()

        def on_event(topic: str, payload: bytes) -> None:
            with self.lock:
                self.events.append(parse_event(payload))

        def on_status(topic: str, payload: bytes) -> None:
            s = parse_status(payload)
            with self.lock:
                self.statuses[s.node_id] = s

        link.subscribe(topics.round_events_all(swarm), on_event)
        link.subscribe(topics.status_all(swarm), on_status)
