"""Learning without labels (edgenode/anomaly.py): the zoo's fc-autoencoder trains on unlabelled
samples, the node learns a threshold, inference answers scores and flags (tritonclient parses
them), labels arriving later give the round's validation an AUC."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton

from api.node_app import create_node_app
from api.serving import ServerThread
from edgenode.anomaly import auc, reconstruction_error

N = 640


def signals(rng: np.random.Generator, n: int, *, fault: bool) -> np.ndarray:
    """Vibration-like windows: two low tones at random phases (normal); a fault adds a high tone
    and noise."""
    t = np.arange(N) / N
    f = np.array([[4.0, 7.0]])
    ph = rng.uniform(0, 2 * np.pi, (n, 2))
    x = np.sin(2 * np.pi * f[:, :1] * t + ph[:, :1]) + 0.5 * np.sin(2 * np.pi * f[:, 1:] * t + ph[:, 1:])
    if fault:
        x = x + 0.8 * np.sin(2 * np.pi * rng.uniform(40, 60, (n, 1)) * t) + rng.normal(0, 0.3, (n, N))
    return (x + rng.normal(0, 0.05, (n, N))).astype(np.float32)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_auc_and_error_match_references() -> None:
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 200).astype(np.float64)  # many ties
    y = rng.integers(0, 2, 200)
    assert auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert auc(s, np.zeros(200)) is None
    x, r = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))
    np.testing.assert_allclose(reconstruction_error(x, r), ((x - r) ** 2).mean(axis=1), rtol=1e-6)
    assert reconstruction_error(x, np.full((3, 8), np.nan))[0] == np.inf


def test_samples_without_labels_refused_for_a_classifier(digits_artifact, node_factory) -> None:
    node = node_factory("clf", digits_artifact)
    with ServerThread(create_node_app(node)) as srv:
        code, body = post(f"{srv.url}/v1/samples", {"inputs": {"x": [[0.0] * 64]}})
        assert code == 400 and "labels" in body["error"]
        code, body = post(f"{srv.url}/v1/samples", {"inputs": {"x": [[0.0] * 64]}, "labels": [3]})
        assert code == 200 and body["ids"] == [1]
        # a window from a stream comes unlabelled; its label arrives later and makes it trainable
        ids, _ = node.insert_samples({"x": np.zeros((2, 64), np.float32)}, None)
        assert node.store.snapshot(which="known").labels.tolist() == [3]
        code, body = post(f"{srv.url}/v1/labels", {"label": 5, "ids": ids})
        assert code == 200 and body["labelled"] == 2
        assert node.store.snapshot(which="known").labels.tolist() == [3, 5, 5]
        code, body = post(f"{srv.url}/v1/labels", {"label": 10, "ids": ids})  # 10 classes: 0..9
        assert code == 400 and "class" in body["error"]


@pytest.mark.slow  # the fc-autoencoder's compile (~1 min, shared) and a 150-step round
def test_autoencoder_learns_normal_flags_faults_and_reports_auc(tmp_path: Path, autoencoder_artifact,
                                                               node_factory) -> None:
    from federation.memory import MemoryHub
    from federation.messages import RoundCommand

    node = node_factory("ae", autoencoder_artifact, transport=MemoryHub().transport("ae"),
                        training={"isolation": "thread", "validation_share": 0.3},
                        anomaly={"percentile": 99.0, "refresh_samples": 1000000})
    rng = np.random.default_rng(1)
    with ServerThread(create_node_app(node)) as srv:
        # unlabelled normal data, then a burst of faults (also unlabelled, as a stream would send)
        t_normal = time.time()
        normal = signals(rng, 600, fault=False)
        for lo in range(0, 600, 200):
            code, body = post(f"{srv.url}/v1/samples", {"inputs": {"x": normal[lo:lo + 200].tolist()}})
            assert code == 200 and body["stored"] == 200 and len(body["ids"]) == 200
        t_fault = time.time()
        faults = signals(rng, 120, fault=True)
        code, body = post(f"{srv.url}/v1/samples", {"inputs": {"x": faults.tolist()}})
        assert code == 200
        fault_ids = body["ids"]
        # the operator learns later that this hour was a fault: label by time range, and by ids
        code, got = post(f"{srv.url}/v1/labels", {"label": 1, "since": t_fault, "until": time.time() + 1})
        assert code == 200 and got["labelled"] == 120
        code, got = post(f"{srv.url}/v1/labels", {"label": 0, "ids": [1, 2, 3]})
        assert code == 200 and got["labelled"] == 3
        code, got = post(f"{srv.url}/v1/labels", {"label": 0, "since": t_normal, "until": t_fault})
        assert code == 200 and got["labelled"] == 600
        for bad in ({"label": 1}, {"label": 1, "ids": [1], "since": 0}, {"label": 7, "ids": [1]},
                    {"label": "x", "ids": [1]}, {"label": 1, "ids": ["a"]},
                    {"label": 1, "since": 5, "until": 1},
                    {"label": [[1], [2, 3]], "ids": [1]}, {"label": 1, "ids": [1], "extra": 1}):
            code, err = post(f"{srv.url}/v1/labels", bad)
            assert code == 400, (bad, code, err)
        assert node.store.count_labelled() == 720

        result = node.run_round(RoundCommand(round_id="ae-r1", steps=150, lr=0.003, participants=["ae"],
                                             step_timeout_s=60))
        assert result.version == 1
        val = node.validation
        val_set = node.store.snapshot(part="val", share=0.3)
        s = node.infer({"x": val_set.inputs["x"]})["anomaly_score"]
        diag = (val, s[val_set.labels == 0].mean(), s[val_set.labels == 1].mean())
        assert val is not None and val.auc is not None and val.auc >= 0.95, diag
        assert node.refresh_threshold() is not None

        client = triton.InferenceServerClient(srv.url.removeprefix("http://"))
        try:
            meta = client.get_model_metadata(node.model_name)
            assert [o["name"] for o in meta["outputs"]] == ["recon", "anomaly_score", "anomaly"]
            test_x = np.concatenate([signals(rng, 50, fault=False), signals(rng, 50, fault=True)])
            inp = triton.InferInput("x", list(test_x.shape), "FP32")
            inp.set_data_from_numpy(test_x, binary_data=True)
            res = client.infer(node.model_name, [inp])
        finally:
            client.close()
        score, flag, recon = res.as_numpy("anomaly_score"), res.as_numpy("anomaly"), res.as_numpy("recon")
        assert score.shape == (100,) and flag.dtype == np.bool_ and recon.shape == (100, N)
        np.testing.assert_allclose(score, reconstruction_error(test_x, recon), rtol=1e-5)
        assert node.anomaly is not None and node.anomaly.threshold is not None
        np.testing.assert_array_equal(flag, score > node.anomaly.threshold)
        # a 99th-percentile threshold: few normal windows flagged, many more faults
        assert flag[:50].mean() <= 0.1 and flag[50:].mean() >= 0.4, (flag[:50].mean(), flag[50:].mean())
        assert auc(score, np.r_[np.zeros(50), np.ones(50)]) >= 0.95
        assert fault_ids and node.info()["anomaly_threshold"] == node.anomaly.threshold


def test_live_trace_is_bounded_finite_and_travels_in_the_status() -> None:
    from pydantic import ValidationError

    from edgenode.anomaly import AnomalyScorer
    from federation.messages import ANOMALY_POINTS_MAX, AnomalyTrace, NodeState, NodeStatus, parse_status

    sc = AnomalyScorer("x", "recon", percentile=99.0)
    assert sc.trace() == AnomalyTrace()
    t = 1.7e9 + np.arange(100, dtype=np.float64)
    s = np.linspace(0.1, 1.0, 100).astype(np.float32)
    s[5] = np.inf  # a diverged output: not plotted
    sc.observe(t, s)
    sc.labelled_anomalous(1.7e9 + 10, 1.7e9 + 20)
    sc.labelled_anomalous(float("nan"), 1.0)
    sc.threshold = 0.5
    tr = sc.trace()
    assert len(tr.scores) == ANOMALY_POINTS_MAX and tr.scores[-1] == (t[-1], pytest.approx(1.0))
    assert tr.labelled == [(1.7e9 + 10, 1.7e9 + 20)] and tr.threshold == 0.5
    st = NodeStatus(node_id="n1", state=NodeState.ONLINE, anomaly=tr)
    assert parse_status(st.model_dump_json().encode()).anomaly == tr
    with pytest.raises(ValidationError):
        AnomalyTrace(scores=[(1.0, 0.1)] * (ANOMALY_POINTS_MAX + 1))
    with pytest.raises(ValidationError):
        AnomalyTrace(scores=[(1.0, float("inf"))])
