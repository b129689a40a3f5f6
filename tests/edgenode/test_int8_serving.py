"""Training stays float, inference serves int8 (issue 30; edgenode/requantize.py): a node whose
artifact was compiled with ``--train --quantize int8`` rebuilds its int8 library from the
parameters a round committed, calibrated on its own stored samples, in a child process, and swaps
it in; ``[inference] precision = "float"`` keeps float; a rebuild that dies keeps the node
serving the library it had."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from compiler.build import QUANT_FILE
from compiler.manifest import MANIFEST, Manifest
from edgenode.errors import ConfigError
from federation import topics
from federation.messages import (
    EventKind,
    InferenceInfo,
    Int8State,
    NodeState,
    NodeStatus,
    Precision,
    RoundCommand,
)
from tests.fixtures_enrolment import wait_for
from tests.fixtures_node import SwarmWatch


def _output_step(qdq: onnx.ModelProto) -> float:
    """The quantization step of the graph output (the scale of its DequantizeLinear)."""
    out = qdq.graph.output[0].name
    node = next(n for n in qdq.graph.node if out in n.output)
    assert node.op_type == "DequantizeLinear"
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    return float(inits[node.input[1]])


def _reference(library_dir) -> tuple[ort.InferenceSession, float]:
    """onnxruntime on the QDQ model a library was compiled from (reference semantics)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    path = library_dir / QUANT_FILE
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]), \
        _output_step(onnx.load(str(path)))


def _run(sess: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return np.concatenate([sess.run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])  # batch 1


def test_fleet_view_carries_the_inference_state():
    """The fleet's node table gets what the status says (the dashboard tags int8 nodes with it)."""
    from api.fleet.registry import NodeRegistry

    st = NodeStatus(node_id="a", state=NodeState.ONLINE, model_version=3, inference=InferenceInfo(
        precision=Precision.INT8, built_from_version=2, built_from_sha256="ab" * 32,
        int8_state=Int8State.BUILDING))
    view = NodeRegistry().update(NodeStatus.model_validate_json(st.model_dump_json()), time.time())
    assert view is not None and view["inference"]["int8_state"] == "building"
    assert view["inference"]["built_from_version"] == 2 and view["model_version"] == 3


def test_int8_precision_needs_an_int8_artifact(node_factory, digits_artifact):
    with pytest.raises(ConfigError, match="has no int8 library"):
        node_factory("f8", digits_artifact, start=False, inference={"precision": "int8"})
    node = node_factory("fa", digits_artifact, start=False)  # auto: float
    assert node.int8 is None and node.inference_info().precision == Precision.FLOAT


@pytest.mark.slow
@pytest.mark.mosquitto
def test_round_then_int8_library_from_the_committed_weights(mosquitto, swarm_id, mqtt_link_factory,
                                                            node_factory, digits_int8_artifact, digits_data):
    """Two nodes of one --train --quantize int8 artifact run a round over Mosquitto: the int8 one
    (precision auto) serves int8 from the shipped library, then from one rebuilt from the committed
    parameters, matching onnxruntime on the rebuilt QDQ model within one output step; the float
    one (precision = "float") serves the committed float parameters and builds nothing."""
    man = Manifest.read(digits_int8_artifact)  # float training artifact + int8 library inside it
    assert man.training is not None and man.quantization is not None and man.quantization.integer
    assert man.quantization.calibration_samples == 400
    assert f"{man.quantization.library}/{MANIFEST}" in man.files
    x, y = digits_data
    q_id, f_id = f"{swarm_id}-q", f"{swarm_id}-f"
    qnode = node_factory(q_id, digits_int8_artifact, broker=mosquitto.url, swarm=swarm_id)
    fnode = node_factory(f_id, digits_int8_artifact, broker=mosquitto.url, swarm=swarm_id,
                         inference={"precision": "float"})
    assert fnode.int8 is None and qnode.int8 is not None
    qnode.add_samples({"x": x[0:600:2]}, y[0:600:2])
    fnode.add_samples({"x": x[1:600:2]}, y[1:600:2])
    held = x[1400:1500]
    shipped = qnode.int8.library_dir
    assert shipped == digits_int8_artifact / "int8"
    sess, step = _reference(shipped)
    got, ref = qnode.infer({"x": held})["logits"], _run(sess, held)
    assert np.abs(got - ref).max() <= step * 1.001
    info = qnode.inference_info()
    assert (info.precision, info.built_from_version, info.int8_state) == \
        (Precision.INT8, 0, Int8State.CURRENT)

    fleet = mqtt_link_factory(mosquitto, "fleet")
    watch = SwarmWatch(fleet, swarm_id)
    fleet.publish(topics.command(swarm_id), RoundCommand(round_id="q8-r1", steps=15, lr=0.1,
                                                         participants=[q_id, f_id], step_timeout_s=30))

    def done():
        with watch.lock:
            assert not [e for e in watch.events if e.kind == EventKind.FAILED], watch.events
            return {e.node_id for e in watch.events if e.kind == EventKind.DONE} == {q_id, f_id}

    wait_for(done, 120, "the round's DONE events")
    sha = qnode.params_sha256
    assert qnode.model_version == 1 and fnode.params_sha256 == sha
    # the retained status says which parameters the serving int8 library was built from
    wait_for(lambda: qnode.int8.built_from == (1, sha), 180, "the rebuilt int8 library")

    def status_current():
        with watch.lock:
            s = watch.statuses.get(q_id)
        return s is not None and s.inference is not None and s.inference.built_from_sha256 == sha \
            and s.inference.int8_state == Int8State.CURRENT

    wait_for(status_current, 30, "the status naming the rebuilt library")
    rebuilt = qnode.int8.library_dir
    assert rebuilt.parent == qnode.config.data_dir / "int8" and rebuilt.name == f"v1-{sha[:12]}"
    sess, step = _reference(rebuilt)
    got, ref = qnode.infer({"x": held})["logits"], _run(sess, held)
    assert np.abs(got - ref).max() <= step * 1.001, (np.abs(got - ref).max(), step)
    # built from the committed weights: it agrees with the float model on them, not with the shipped ones
    committed = qnode.model.infer({"x": held})["logits"]
    before = qnode.model.infer_shipped({"x": held})["logits"]
    assert np.abs(got - committed).max() < np.abs(got - before).max()
    assert (got.argmax(1) == committed.argmax(1)).mean() >= 0.95
    # float serving: the committed float parameters, nothing built
    np.testing.assert_array_equal(fnode.infer({"x": held})["logits"],
                                  fnode.model.infer({"x": held})["logits"])
    assert fnode.info()["inference"]["precision"] == "float"
    assert not (fnode.config.data_dir / "int8").exists()


@pytest.mark.slow
def test_killed_rebuild_keeps_serving_the_previous_library(node_factory, digits_int8_artifact, digits_data):
    """A rebuild killed mid-way (SIGKILL to its child) leaves the node serving the library it had,
    reporting the failure; nothing half-built stays behind; a restart serves the same library and
    builds again, and a commit during that build is built right after it."""
    x, y = digits_data
    node = node_factory("k8", digits_int8_artifact)
    node.add_samples({"x": x[:300]}, y[:300])
    held = x[1400:1450]
    before = node.infer({"x": held})["logits"]
    assert node.int8 is not None
    params = [p * 0.5 for p in node.model.snapshot.params]
    node.model.commit(params, 1)
    node.rounds.parts.params_changed()
    pid = wait_for(lambda: node.int8.pid, 30, "the rebuild's child process")
    np.testing.assert_array_equal(node.infer({"x": held})["logits"], before)  # served during the rebuild
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: node.int8.state == Int8State.FAILED, 30, "the failed rebuild")
    info = node.inference_info()
    assert info.built_from_version == 0 and "killed by signal 9" in (info.error or ""), info
    np.testing.assert_array_equal(node.infer({"x": held})["logits"], before)
    assert node.readiness() is None
    leftovers = [p.name for p in (node.config.data_dir / "int8").iterdir() if p.name != "current.json"]
    hidden = [n for n in leftovers if n.startswith(".")]
    # the killed compile's temporary may remain until the next build cleans up; never a library
    assert not [n for n in leftovers if n not in hidden], leftovers
    node.stop()

    again = node_factory("k8", digits_int8_artifact, data_dir=node.config.data_dir)
    assert again.model_version == 1 and again.int8 is not None
    wait_for(lambda: again.int8.pid, 30, "the rebuild after the restart")
    # a commit while it builds: the build in progress finishes, then the newest parameters are built
    again.model.commit([p * 0.25 for p in again.model.snapshot.params], 2)
    again.rounds.parts.params_changed()

    def swapped_to_v2() -> bool:  # the library it replaced gone, nothing half-built left
        names = sorted(p.name for p in (again.config.data_dir / "int8").iterdir())
        return again.int8.built_from == (2, again.params_sha256) and names == \
            sorted(["current.json", again.int8.library_dir.name])

    wait_for(swapped_to_v2, 240, "the rebuild for version 2")
    assert again.int8.state == Int8State.CURRENT and again.int8.builds_failed == 0
    assert not np.array_equal(again.infer({"x": held})["logits"], before)
    again.stop()

    # a library recorded for another artifact (a new one deployed into this data_dir) is not served
    record = again.config.data_dir / "int8" / "current.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "artifact": "0" * 64}))
    third = node_factory("k8", digits_int8_artifact, data_dir=node.config.data_dir, start=False)
    assert third.int8 is not None and third.int8.library_dir == digits_int8_artifact / "int8"
    assert third.int8.built_from[0] == 0
