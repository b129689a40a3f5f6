"""The learning-quality experiment: sklearn digits split non-IID over 4 nodes, swarm training
through the real EdgeNode code (gradient sync over RingAllreduce) versus centralized training of
the same compiled model with the same epochs and learning rate. Used by test_learning_quality.py
(and runnable as a script for BENCHMARKS.md: ``python -m tests.edgenode.learning ARTIFACT_DIR``)."""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

N_NODES = 4
# Each node's "home" classes (2.5 per node: classes 2 and 7 are shared by two nodes).
HOME = {0: [0], 1: [0], 2: [0, 1], 3: [1], 4: [1], 5: [2], 6: [2], 7: [2, 3], 8: [3], 9: [3]}
HOME_SHARE = 0.9  # 90% of a class goes to its home node(s), 10% is spread over all nodes


@dataclass
class Outcome:
    epochs: int
    lr: float
    batch: int
    swarm_acc: float
    central_acc: float  # same epochs, lr and global batch (nodes x batch) as the swarm
    central_small_batch_acc: float  # same epochs and lr, batch = one node's batch (4x more updates)
    swarm_steps: int
    swarm_seconds: float
    shards: list[list[int]]  # per node: samples per class
    params_sha256: set[str]


def load_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.25, stratify=y, random_state=seed)


def non_iid_shards(y: np.ndarray, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shards: list[list[int]] = [[] for _ in range(N_NODES)]
    for i, label in enumerate(y):
        home = HOME[int(label)]
        k = home[rng.integers(len(home))] if rng.random() < HOME_SHARE else int(rng.integers(N_NODES))
        shards[k].append(i)
    return [np.asarray(s) for s in shards]


def accuracy(artifact: Any, params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float((artifact.infer({"x": x}, params=params)["logits"].argmax(1) == y).mean())


def centralized(artifact: Any, x: np.ndarray, y: np.ndarray, *, epochs: int, lr: float, accumulate: int,
                seed: int = 0) -> list[np.ndarray]:
    """Plain SGD on all the data; ``accumulate`` micro-batches of the compiled batch per update
    (the mean of their gradients = the gradient of one accumulate x batch batch)."""
    tr = artifact.trainer
    b = tr.batch
    rng = np.random.default_rng(seed)
    params = [np.array(p) for p in artifact.params]
    state = tr.init_state(params)
    per_epoch = len(y) // (b * accumulate)
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for s in range(per_epoch):
            grads = None
            for m in range(accumulate):
                idx = order[(s * accumulate + m) * b:(s * accumulate + m + 1) * b]
                _, g = tr.loss_and_grad(params, x[idx], y[idx])
                grads = g if grads is None else [a + c for a, c in zip(grads, g, strict=True)]
            grads = [g / np.float32(accumulate) for g in grads]
            params, state = tr.apply(params, grads, state, lr=lr)
    return params


class _Scaled:
    """A trainer whose gradients are multiplied by ``factor`` (a broken or hostile member)."""

    def __init__(self, inner: Any, factor: float) -> None:
        self.inner, self.factor = inner, np.float32(factor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def loss_and_grad(self, params, x, y):
        loss, grads = self.inner.loss_and_grad(params, x, y)
        return loss, [np.asarray(g) * self.factor for g in grads]


def swarm(artifact_dir: Path, artifact: Any, x: np.ndarray, y: np.ndarray, shards: list[np.ndarray], *,
          epochs: int, lr: float, workdir: Path, aggregation: str = "mean", outlier_factor: float = 10.0,
          hostile: float | None = None) -> tuple[list[Any], int, float]:
    """Four real EdgeNodes on a MemoryHub, one gradient-sync round of ``epochs`` local epochs.
    ``hostile``: node 1's gradients are scaled by this factor."""
    from edgenode.config import NodeConfig
    from edgenode.node import EdgeNode
    from federation.memory import MemoryHub
    from federation.messages import RoundCommand, SyncMode

    hub = MemoryHub()
    ids = [f"lq{k}" for k in range(N_NODES)]
    nodes = []
    for k, i in enumerate(ids):
        cfg = NodeConfig.from_dict({"node_id": i, "artifact": str(artifact_dir),
                                    "data_dir": str(workdir / i), "training": {"lr": lr}})
        node = EdgeNode(cfg, artifact=artifact, transport=hub.transport(i))
        node.start()
        node.add_samples({"x": x[shards[k]]}, y[shards[k]])
        if hostile is not None and k == 1:
            node.rounds.trainer = _Scaled(node.rounds.trainer, hostile)
        nodes.append(node)
    steps = int(round(epochs * np.mean([len(s) for s in shards]) / artifact.trainer.batch))
    cmd = RoundCommand(round_id="lq", steps=steps, sync=SyncMode.GRADIENT, participants=ids,
                       step_timeout_s=30, aggregation=aggregation, outlier_factor=outlier_factor)
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(node):
        try:
            results[node.node_id] = node.run_round(cmd)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    if errors:
        raise errors[0]
    return nodes, steps, seconds


def run_experiment(artifact_dir: Path, *, epochs: int = 40, lr: float = 0.1, workdir: Path | None = None,
                   artifact: Any = None, aggregation: str = "mean", outlier_factor: float = 10.0,
                   hostile: float | None = None, baselines: bool = True) -> Outcome:
    from compiler import load_artifact

    artifact = artifact or load_artifact(artifact_dir)
    xtr, xte, ytr, yte = load_split()
    shards = non_iid_shards(ytr)
    with tempfile.TemporaryDirectory() as tmp:
        nodes, steps, seconds = swarm(artifact_dir, artifact, xtr, ytr, shards, epochs=epochs, lr=lr,
                                      workdir=Path(workdir or tmp), aggregation=aggregation,
                                      outlier_factor=outlier_factor, hostile=hostile)
        try:
            swarm_params = list(nodes[0].model.snapshot.params)
            shas = {n.params_sha256 for n in nodes}
            swarm_acc = float((nodes[0].infer({"x": xte})["logits"].argmax(1) == yte).mean())
        finally:
            for n in nodes:
                n.stop()
    assert accuracy(artifact, swarm_params, xte, yte) == swarm_acc
    if baselines:
        central = centralized(artifact, xtr, ytr, epochs=epochs, lr=lr, accumulate=N_NODES)
        small = centralized(artifact, xtr, ytr, epochs=epochs, lr=lr, accumulate=1)
        central_acc, small_acc = accuracy(artifact, central, xte, yte), accuracy(artifact, small, xte, yte)
    else:
        central_acc = small_acc = float("nan")
    return Outcome(epochs, lr, artifact.trainer.batch, swarm_acc, central_acc, small_acc, steps, seconds,
                   [np.bincount(ytr[s], minlength=10).tolist() for s in shards], shas)


def robust_table(artifact_dir: Path, epochs: int = 60) -> None:
    """BENCHMARKS.md "robust aggregation": swarm accuracy per aggregation, honest and with one
    member's gradients scaled by 1e3 (screening at its default, 10 x median)."""
    from compiler import load_artifact

    art = load_artifact(artifact_dir)
    print("| aggregation | outlier_factor | hostile member | test accuracy | round s |")
    print("|---|---|---|---|---|")
    for hostile, factor in ((None, 10.0), (1e3, 10.0), (1e3, 0.0)):
        for agg in ("mean", "median", "trimmed_mean"):
            row = f"| {agg} | {factor:g} | {'x1e3' if hostile else 'none'} |"
            try:
                out = run_experiment(artifact_dir, epochs=epochs, artifact=art, aggregation=agg,
                                     hostile=hostile, outlier_factor=factor, baselines=False)
            except Exception as exc:  # noqa: BLE001 - a failed round is a result of the table
                print(f"{row} round failed: {str(exc)[:90]} | |", flush=True)
                continue
            print(f"{row} {out.swarm_acc:.2%} | {out.swarm_seconds:.1f} |", flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[2:3] == ["robust"]:
        robust_table(Path(sys.argv[1]), *[int(a) for a in sys.argv[3:4]])
    else:
        for e in [int(a) for a in sys.argv[2:]] or [40]:
            print(run_experiment(Path(sys.argv[1]), epochs=e))
