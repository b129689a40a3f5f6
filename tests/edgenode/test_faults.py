"""The commit fault plan enters through the objects a test builds (issue 27): ``EdgeNode(...,
faults=...)`` in process, ``tests/edgenode/faultnode.py`` for real node processes
(test_commit_faults.py); nothing reads it from the environment."""

from __future__ import annotations

import pytest

from edgenode.config import NodeConfig
from edgenode.errors import ConfigError
from edgenode.faults import NO_FAULTS, Action, Faults, Point
from edgenode.node import EdgeNode
from federation.memory import MemoryHub
from federation.messages import RoundCommand
from tests.edgenode import faultnode
from tests.edgenode.fakes import NumpyArtifact
from tests.edgenode.test_rounds_fake import run_all


def test_plan_text_round_trips_and_bad_items_are_named() -> None:
    f = Faults.parse(" kill@vote:r-3, fail@prepare ")
    assert str(f) == "kill@vote:r-3,fail@prepare"
    assert f.wants(Point.VOTE, "r-3") == Action.KILL and f.wants(Point.VOTE, "r-4") is None
    assert f.wants(Point.PREPARE, "any") == Action.FAIL
    assert not Faults.parse("") and not NO_FAULTS
    with pytest.raises(ConfigError, match="cannot read 'boom@vote'"):
        Faults.parse("kill@vote,boom@vote")
    with pytest.raises(ConfigError, match="nothing is written at vote"):
        Faults.parse("fail@vote")


def _node(tmp_path, hub: MemoryHub, node_id: str, **kw) -> EdgeNode:
    (tmp_path / "art").mkdir(exist_ok=True)
    cfg = NodeConfig.from_dict({"node_id": node_id, "artifact": str(tmp_path / "art"),
                                "data_dir": str(tmp_path / node_id)})
    node = EdgeNode(cfg, artifact=NumpyArtifact(), transport=hub.transport(node_id), **kw)
    node.start()
    return node


def test_a_node_built_with_a_plan_fails_its_write_and_nobody_commits(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FRACTAL_FAULTS", "kill@prepare")  # the old switch: read by nobody now
    hub = MemoryHub()
    nodes = {"a": _node(tmp_path, hub, "a"),
             "b": _node(tmp_path, hub, "b", faults=Faults.parse("fail@prepare:r1"))}
    assert nodes["a"].faults is NO_FAULTS
    try:
        for n in nodes.values():
            n.add_samples({"x": [[0.5] * 64] * 8}, [1] * 8)
        before = {i: n.params_sha256 for i, n in nodes.items()}
        errors = run_all(nodes, RoundCommand(round_id="r1", steps=2, lr=0.1, participants=list(nodes)))
        assert set(errors) == {"a", "b"}, errors
        assert "injected write failure at prepare" in str(errors["b"])
        assert {i: n.params_sha256 for i, n in nodes.items()} == before
        assert not run_all(nodes, RoundCommand(round_id="r2", steps=2, lr=0.1, participants=list(nodes)))
        assert len({n.params_sha256 for n in nodes.values()}) == 1 and nodes["a"].params_sha256 != before["a"]
    finally:
        for n in nodes.values():
            n.stop()


def test_the_entry_point_refuses_a_bad_plan_in_one_line(tmp_path, capsys) -> None:
    assert faultnode.main(["--faults", "kill@nowhere", "--config", str(tmp_path / "NODE.toml")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: fault plan: cannot read 'kill@nowhere'"), err
