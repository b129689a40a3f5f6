"""The vibration scenario's anomaly detection: the swarm's model against a centrally trained one.

    python -m bench.vibration [--nodes 3] [--steps 200] [--speed 8] [--json]

Runs ``fractal swarm --scenario vibration`` (real Mosquitto, real node processes, the simulated
machines publishing SenML), lets the scenario start its first round once every node holds
``--min-samples`` windows, and waits for the round to commit. Then:

- **swarm**: every node scores held-out windows of its own machine (``--eval`` normal ones and
  ``--eval`` of each fault kind, drawn by ``deploy.vibration.windows`` exactly as the streams cut
  them) through its Open Inference Protocol endpoint; AUC per node of normal vs faults.
- **central**: the same model from the same initial parameters, trained in one process with the
  same compiled training step (the artifact's ``loss_and_grad`` + ``apply``), the same steps and
  learning rate, on all nodes' normal windows pooled (read from the nodes' sample stores after the
  run; each step averages the gradients of one batch per node, as the swarm's gradient round
  does, but drawn from the pool); AUC per machine on the same held-out windows.

One JSON object on stdout with ``--json`` (else a short table). Goal (issue 31): swarm AUC >= 0.95,
and within 0.02 of the central model's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.host import machine
from fractal.oip import json_tensor

__all__ = ["run", "central_params"]

TOKEN = "bench-vibration"


def _swarm(nodes: int, work: Path, port: int, steps: int, lr: float, speed: float, min_samples: int,
           cache: Path, severity: float) -> subprocess.Popen:
    fractal = Path(sys.executable).with_name("fractal")
    argv = [str(fractal)] if fractal.is_file() else [sys.executable, "-c", "from api.cli import main; main()"]
    argv += ["swarm", "--scenario", "vibration", "--nodes", str(nodes), "--port", str(port), "--token", TOKEN,
             "--workdir", str(work), "--cache-dir", str(cache), "--speed", str(speed),
             "--round-steps", str(steps),
             "--fault-severity", str(severity), "--round-every", "100000", "--round-lr", str(lr),
             "--min-samples", str(min_samples)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def _wait_banner(proc: subprocess.Popen, timeout: float) -> dict[str, str]:
    """{node id: URL} from the banner's ``nodes:`` line."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip().startswith("nodes:"):
            return dict(p.split() for p in line.split(":", 1)[1].split(","))
        if time.monotonic() > deadline:
            break
    raise RuntimeError("fractal swarm did not come up:\n" + "".join(lines[-20:]))


def _wait_round(fleet: httpx.Client, timeout: float) -> dict[str, Any]:
    """The scenario's first round, once it ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rounds = fleet.get("/api/rounds").json()["rounds"]  # newest first
        if rounds and rounds[-1]["state"] != "running":
            if len(rounds) > 1:
                raise RuntimeError(f"the scenario started {len(rounds)} rounds; the comparison needs one")
            return rounds[-1]
        time.sleep(1.0)
    raise RuntimeError(f"no round finished within {timeout:.0f}s")


def _eval_sets(n_machines: int, n: int, seed: int, severity: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per machine: held-out inputs (n normal, then n of each fault kind) and their flags."""
    from deploy.vibration import FaultKind, machines, windows

    rng = np.random.default_rng(seed)
    out = []
    for m in machines(n_machines):
        xs = [windows(m, n, None, rng=rng)]
        xs += [windows(m, n, k, rng=rng, severity=severity) for k in FaultKind]
        out.append((np.concatenate(xs), np.r_[np.zeros(n), np.ones(n * len(FaultKind))]))
    return out


def _node_scores(url: str, model: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scores and flags from the node's OIP endpoint, in requests of at most 100 windows (its
    max_batch is 256)."""
    parts = [_node_batch(url, model, x[lo:lo + 100]) for lo in range(0, len(x), 100)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _node_batch(url: str, model: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    body = {"inputs": [json_tensor("x", np.asarray(x, np.float32))],
            "outputs": [{"name": "anomaly_score"}, {"name": "anomaly"}]}
    r = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {TOKEN}"})
    r.raise_for_status()
    outs = {o["name"]: o["data"] for o in r.json()["outputs"]}
    return np.asarray(outs["anomaly_score"], np.float32), np.asarray(outs["anomaly"], bool)


def central_params(artifact: Any, pools: list[np.ndarray], *, steps: int, lr: float, per_step: int,
                   seed: int = 0) -> list[np.ndarray]:
    """Train the artifact's model in this process with its compiled training step: ``steps`` steps,
    each averaging the gradients of ``per_step`` batches drawn from the pooled windows."""
    tr = artifact.trainer
    pool = np.concatenate(pools)
    rng = np.random.default_rng(seed)
    params = [np.array(p) for p in artifact.params]
    state = tr.init_state(params)
    for _ in range(steps):
        grads_sum = None
        for _ in range(per_step):
            x = pool[rng.integers(0, len(pool), int(tr.batch))]
            _, grads = tr.loss_and_grad(params, x, x)
            grads_sum = [np.array(g) for g in grads] if grads_sum is None else \
                [a + np.asarray(g) for a, g in zip(grads_sum, grads, strict=True)]
        assert grads_sum is not None
        params, state = tr.apply(params, [g / per_step for g in grads_sum], state, lr=lr)
    return params


def _auc(scores: np.ndarray, flags: np.ndarray) -> float:
    from edgenode.anomaly import auc

    a = auc(scores, flags)
    assert a is not None  # both kinds are in every evaluation set
    return a


def _stored_normal(data_dir: Path) -> np.ndarray:
    from edgenode.store import SampleSpec, SampleStore

    store = SampleStore(data_dir / "samples.db", SampleSpec((("x", (640,), "float32"),), (), "int64"))
    try:
        return store.snapshot(which="normal").inputs["x"]
    finally:
        store.close()


def run(nodes: int = 3, steps: int = 200, lr: float | None = None, speed: float = 8.0, min_samples: int = 300,
        n_eval: int = 100, cache: Path = Path(".cache"), timeout: float = 1800.0,
        severity: float = 1.0) -> dict[str, Any]:
    from compiler import host_preset_name, load_artifact
    from deploy.swarm import VIBRATION_MODEL, VIBRATION_TRAIN, demo_artifact
    from deploy.vibration_scenario import ScenarioOptions
    from edgenode.anomaly import reconstruction_error
    from federation.broker import free_port

    lr = lr if lr is not None else (ScenarioOptions().round_lr or 0.003)
    art_dir = demo_artifact(cache, host_preset_name(), VIBRATION_MODEL, VIBRATION_TRAIN)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-vibration-") as tmp:
        work, port = Path(tmp) / "swarm", free_port()
        proc = _swarm(nodes, work, port, steps, lr, speed, min_samples, cache, severity)
        try:
            urls = _wait_banner(proc, timeout=300)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as fleet:
                rnd = _wait_round(fleet, timeout)
            if rnd["state"] != "done":
                raise RuntimeError(f"the round {rnd['state']}: {rnd['reason']}")
            evals = _eval_sets(nodes, n_eval, seed=12345, severity=severity)
            scored = [_node_scores(urls[f"node-{i + 1}"], VIBRATION_MODEL, x)
                      for i, (x, _) in enumerate(evals)]
            swarm_auc = [_auc(s, y) for (s, _), (_, y) in zip(scored, evals, strict=True)]
            # at each node's own threshold (99th percentile of its normal windows' scores)
            flagged_normal = [float(f[y == 0].mean()) for (_, f), (_, y) in zip(scored, evals, strict=True)]
            flagged_faults = [float(f[y == 1].mean()) for (_, f), (_, y) in zip(scored, evals, strict=True)]
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        pools = [_stored_normal(work / "data" / f"node-{i + 1}") for i in range(nodes)]
    swarm_s = time.monotonic() - t_start
    art = load_artifact(art_dir)
    t0 = time.monotonic()
    params = central_params(art, pools, steps=steps, lr=lr, per_step=nodes)
    central_s = time.monotonic() - t0
    out_name = art.outputs[0].name
    central_auc = [_auc(reconstruction_error(x, art.infer({"x": x}, params=params)[out_name]), y)
                   for x, y in evals]
    s_mean, c_mean = float(np.mean(swarm_auc)), float(np.mean(central_auc))
    return {"bench": "vibration", "machine": machine(), "nodes": nodes, "steps": steps, "lr": lr,
            "fault_severity": severity,
            "round_id": rnd["round_id"], "windows_per_node": [len(p) for p in pools],
            "eval_windows_per_node": {"normal": n_eval, "per_fault_kind": n_eval},
            "swarm_auc": [round(a, 4) for a in swarm_auc], "central_auc": [round(a, 4) for a in central_auc],
            "swarm_auc_mean": round(s_mean, 4), "central_auc_mean": round(c_mean, 4),
            "gap": round(c_mean - s_mean, 4),
            "swarm_flagged_normal": [round(v, 3) for v in flagged_normal],
            "swarm_flagged_faults": [round(v, 3) for v in flagged_faults],
            "goal_met": bool(s_mean >= 0.95 and c_mean - s_mean <= 0.02),
            "swarm_seconds": round(swarm_s, 1), "central_seconds": round(central_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=None, help="default: the scenario's round lr")
    ap.add_argument("--speed", type=float, default=8.0)
    ap.add_argument("--min-samples", type=int, default=300)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--cache-dir", type=Path, default=Path(".cache"))
    ap.add_argument("--severity", type=float, default=1.0, help="fault severity (deploy/vibration.py)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = run(a.nodes, a.steps, a.lr, a.speed, a.min_samples, a.eval, a.cache_dir, severity=a.severity)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"swarm AUC {res['swarm_auc_mean']} {res['swarm_auc']}  central AUC {res['central_auc_mean']} "
              f"{res['central_auc']}  gap {res['gap']}  goal met: {res['goal_met']}")


if __name__ == "__main__":
    main()
