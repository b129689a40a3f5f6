"""Issue 26 finding 4: a signed command captured off the broker and replayed later never runs twice,
also after the node restarted (its signature's replay window starts empty) and after other
commands came in between (the node used to remember only its last command id)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgenode.config import NodeConfig
from edgenode.node import EdgeNode
from federation.messages import ImageRollbackCommand, ImageUpdateCommand, RollbackCommand
from tests.edgenode.fakes import NumpyArtifact


class RecordingDevice:
    """The node's device (edgenode.ports.Updater): records what the node asked of it."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.calls = calls
        self.last: str | None = None

    def report(self) -> dict[str, Any]:
        return {"version": "1.0.0", "slot": "a", "state": "good", "health": "passed"}

    def last_update_id(self) -> str | None:
        return self.last

    def begin(self, update_id: str, kind: str, version: str) -> None:
        self.last = update_id

    def fail(self, update_id: str, kind: str, version: str, error: str | BaseException) -> None:
        self.last = update_id

    def update(self, update_id: str, url: str, image_id: str, *, max_bytes: int = 0) -> Any:
        self.calls.append(("update", update_id))

        class Stats:
            bytes_received = requests = 0

        return Stats()

    def rollback(self, rollback_id: str) -> dict[str, Any]:
        self.calls.append(("rollback", rollback_id))
        raise RuntimeError("there is no previous good slot to roll back to")


def _node(tmp_path: Path, calls: list[tuple[str, str]]) -> EdgeNode:
    """A (re)started node on the same data directory."""
    (tmp_path / "art").mkdir(exist_ok=True)
    cfg = NodeConfig.from_dict({"node_id": "solo", "artifact": str(tmp_path / "art"),
                                "data_dir": str(tmp_path / "data")})
    node = EdgeNode(cfg, artifact=NumpyArtifact())
    node.images.updater = RecordingDevice(calls)
    return node


def _settle(node: EdgeNode) -> None:
    assert node.images.wait_idle(10)


def test_a_replayed_signed_command_never_runs_twice_across_restarts(tmp_path):
    calls: list[tuple[str, str]] = []
    update = ImageUpdateCommand(update_id="u1", nodes=["solo"], image_id="ab" * 16, version="2.0.0",
                                size=1000, url="http://127.0.0.1:9/api/images/x")
    node = _node(tmp_path, calls)
    node.handle_command(update)
    _settle(node)
    assert calls == [("update", "u1")] and node.reboot_requested.is_set()

    node = _node(tmp_path, calls)  # the reboot into the new slot
    node.handle_command(ImageRollbackCommand(rollback_id="r1", nodes=["solo"]))  # the operator's, refused
    _settle(node)
    assert calls[-1] == ("rollback", "r1")
    n = len(calls)
    for _ in range(2):  # the captured update, replayed 3 s later, and again after another restart
        node.handle_command(update)
        _settle(node)
        node.handle_command(ImageRollbackCommand(rollback_id="r1", nodes=["solo"]))
        _settle(node)
        node = _node(tmp_path, calls)
    assert len(calls) == n, calls[n:]
    assert not node.reboot_requested.is_set()

    # a model rollback too: run once, replays ignored (also after a restart)
    rolled: list[int] = []
    node.rounds.rollback = lambda v, rid="": rolled.append(v) or True  # type: ignore[method-assign]
    cmd = RollbackCommand(rollback_id="m1", nodes=["solo"], to_version=0)
    node.handle_command(cmd)
    node.handle_command(cmd)
    node = _node(tmp_path, calls)
    node.rounds.rollback = lambda v, rid="": rolled.append(v) or True  # type: ignore[method-assign]
    node.handle_command(cmd)
    assert rolled == [0]
    # and a new command id still runs
    node.handle_command(RollbackCommand(rollback_id="m2", nodes=["solo"], to_version=0))
    assert rolled == [0, 0]
