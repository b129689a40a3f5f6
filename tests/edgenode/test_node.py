"""EdgeNode without a swarm (fake numpy artifact): surface used by the HTTP layer, validation,
metrics, and RoundPlan defaults."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from edgenode.config import NodeConfig
from edgenode.errors import ConfigError, InvalidInput, NodeError
from edgenode.node import EdgeNode
from federation.messages import Compression, RoundCommand, SyncMode
from federation.phases import RoundPlan
from tests.edgenode.fakes import NumpyArtifact


def make(tmp_path, **extra) -> EdgeNode:
    (tmp_path / "art").mkdir(exist_ok=True)
    cfg = NodeConfig.from_dict({"node_id": "solo", "artifact": str(tmp_path / "art"),
                                "data_dir": str(tmp_path / "data"), **extra})
    return EdgeNode(cfg, artifact=NumpyArtifact())


def test_surface_and_metrics(tmp_path):
    node = make(tmp_path)
    node.start()
    try:
        assert node.model_name == "numpy-softmax" and node.model_version == 0
        assert [s.name for s in node.inputs] == ["x"] and [s.name for s in node.outputs] == ["logits"]
        # One dtype rule (compiler.artifact.check_inputs): untyped numbers are converted, a typed
        # array must have the model's dtype, as onnxruntime demands.
        out = node.infer({"x": np.ones((3, 64), np.float32)})
        assert out["logits"].shape == (3, 10)
        assert node.infer({"x": [[1] * 64]})["logits"].shape == (1, 10)
        with pytest.raises(InvalidInput, match="dtype float64, expected float32"):
            node.infer({"x": np.ones((3, 64), np.float64)})
        assert node.add_samples({"x": np.zeros((4, 64))}, np.array([1, 2, 3, 4])) == 4
        info = node.info()
        for key in ("node_id", "arch", "board", "model", "model_version", "params_sha256", "round_id",
                    "samples", "state"):
            assert key in info
        assert info["samples"] == 4 and info["state"] == "online" and info["board"] == "x86_64"
        assert node.metrics.inferences == 2 and node.metrics.samples_added == 4
        text = generate_latest(node.registry).decode()
        assert "fractal_node_inferences_total 2.0" in text and "fractal_node_samples 4.0" in text
    finally:
        node.stop()
        node.stop()  # idempotent


@pytest.mark.parametrize(("inputs", "needle"), [
    ({}, "missing input(s) 'x'"),
    ({"x": np.zeros((1, 64), np.float32), "z": np.zeros(1)}, "unknown input(s) 'z'"),
    ({"x": np.zeros((1, 63), np.float32)}, "expected [N, 64]"),
    ({"x": np.zeros(64, np.float32)}, "expected [N, 64]"),
    ({"x": np.zeros((0, 64), np.float32)}, "expected [N, 64]"),
    ({"x": [[1e39] * 64]}, "outside the float32 range"),  # NaN and inf are IEEE values; 1e39 has none
    ({"x": np.array([["a"] * 64])}, "dtype"),
])
def test_infer_rejects_bad_input(tmp_path, inputs, needle):
    node = make(tmp_path)
    with pytest.raises(InvalidInput) as ei:
        node.infer(inputs)
    assert needle in str(ei.value)
    node.stop()


def test_round_without_transport_is_refused(tmp_path):
    node = make(tmp_path)
    node.start()
    with pytest.raises(NodeError, match="no swarm transport"):
        node.start_round(RoundCommand(round_id="r", steps=1, participants=["solo"]))
    node.stop()


def test_batch_mismatch_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="batch"):
        make(tmp_path, training={"batch": 64})


def test_plan_takes_node_defaults_only_for_fields_the_command_omits(tmp_path):
    cfg = make(tmp_path, training={"lr": 0.5, "sync": "local-sgd", "local_steps": 7,
                                   "compression": "fp16"}).config
    sparse = RoundCommand.model_validate_json('{"kind": "round.start", "round_id": "a", "steps": 3, '
                                              '"participants": ["b", "a", "b"]}')
    plan = RoundPlan.from_command(sparse, cfg.training)
    assert (plan.lr, plan.sync, plan.local_steps, plan.compression) == (0.5, SyncMode.LOCAL_SGD, 7,
                                                                         Compression.FP16)
    assert plan.group == ("a", "b")
    full = RoundCommand(round_id="a", steps=3, lr=0.01, sync=SyncMode.GRADIENT, participants=["a"])
    plan = RoundPlan.from_command(full, cfg.training)
    assert (plan.lr, plan.sync) == (0.01, SyncMode.GRADIENT)
    null_lr = RoundCommand(round_id="a", steps=3, lr=None, participants=["a"])  # the fleet's "no lr"
    assert RoundPlan.from_command(null_lr, cfg.training).lr == 0.5


def test_choose_start_majority_or_the_fleets_choice_never_the_highest_version():
    from federation.errors import RoundRefused
    from federation.phases import choose_start

    h1, h2 = (1, 2, 3, 4), (9, 9, 9, 9)
    assert choose_start({"a": h1, "b": h1, "evil": h2}, None) == "a"
    with pytest.raises(RoundRefused, match="majority"):
        choose_start({"a": h1, "evil": h2}, None)
    sha = "%04x" * 4 % h2 + "0" * 48  # the fleet named evil's parameters (e.g. a restore)
    assert choose_start({"a": h1, "b": h1, "evil": h2}, sha) == "evil"
    with pytest.raises(RoundRefused, match="no participant holds"):
        choose_start({"a": h1, "b": h1}, sha)


def test_round_on_an_artifact_without_trainer_reports_failed(tmp_path):
    from federation.memory import MemoryHub
    from federation.messages import EventKind

    (tmp_path / "art").mkdir()
    cfg = NodeConfig.from_dict({"node_id": "n", "artifact": str(tmp_path / "art"),
                                "data_dir": str(tmp_path / "d")})
    node = EdgeNode(cfg, artifact=NumpyArtifact(trainer=False), transport=MemoryHub().transport("n"))
    events = []
    node.add_event_listener(events.append)
    node.start()
    try:
        node.handle_command(RoundCommand(round_id="r", steps=1, participants=["n"]))
        assert node.wait_idle(10)
        assert [e.kind for e in events] == [EventKind.FAILED] and "no training module" in events[0].reason
        assert node.metrics.rounds_failed == 1
    finally:
        node.stop()


def test_max_batch_defaults_and_validation(tmp_path):
    node = make(tmp_path)
    assert node.config.max_batch == 256
    # The cap is for HTTP requests (tests/api/test_limits_auth.py); in-process callers are trusted.
    assert node.infer({"x": np.zeros((300, 64), np.float32)})["logits"].shape == (300, 10)
    with pytest.raises(ConfigError, match="max_batch"):
        make(tmp_path, max_batch=0)
