"""A numpy stand-in for a compiled artifact (softmax regression) for fast, TVM-free node tests.

It implements the node's collaborator protocols (``edgenode.ports.Engine`` and ``Trainer``; mypy
checks that in ``make check``) and validates inputs with the compiler's one validator; tests
that need the real TVM artifact use the ``digits_artifact`` fixture from ``tests/fixtures_node.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.artifact import check_inputs
from compiler.manifest import TensorSpec as Spec
from edgenode import ports


class NumpyTrainer:
    """Mean cross-entropy softmax regression with plain SGD."""

    def __init__(self, batch: int = 16, lr: float = 0.1) -> None:
        self.batch, self.lr, self.loss, self.optimizer = batch, lr, "ce", "sgd"

    def loss_and_grad(self, params: list[np.ndarray], x: Any,
                      y: np.ndarray) -> tuple[float, list[np.ndarray]]:
        w, b = params
        assert x.shape[0] == self.batch, "the compiled batch is fixed"
        z = x.astype(np.float32) @ w + b
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        n = x.shape[0]
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        d = p.copy()
        d[np.arange(n), y] -= 1.0
        d /= n
        return loss, [(x.T @ d).astype(np.float32), d.sum(axis=0).astype(np.float32)]

    def init_state(self, params: list[np.ndarray]) -> list[np.ndarray]:
        return []

    def apply(self, params: list[np.ndarray], grads: list[np.ndarray], state: list[np.ndarray],
              lr: float | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        rate = np.float32(self.lr if lr is None else lr)
        return [(p - rate * g).astype(np.float32) for p, g in zip(params, grads, strict=True)], state


@dataclass(frozen=True)
class FakeTuning:
    tuned: bool = False


@dataclass(frozen=True)
class FakeManifest:
    preset: str = "x86_64"
    tvm_version: str = "none (numpy fake)"
    tuning: FakeTuning = FakeTuning()
    batched: bool = True


class NumpyArtifact:
    """``x`` float32 [N, 64] -> ``logits`` [N, 10], params W [64, 10], b [10]."""

    def __init__(self, *, n_in: int = 64, n_out: int = 10, seed: int = 0, batch: int = 16,
                 lr: float = 0.1, trainer: bool = True, infer_delay: float = 0.0) -> None:
        rng = np.random.default_rng(seed)
        self.name = "numpy-softmax"
        self.manifest = FakeManifest()
        self.inputs = [Spec("x", (1, n_in), "float32")]
        self.outputs = [Spec("logits", (1, n_out), "float32")]
        self.param_names = ["W", "b"]
        self.params = [(rng.standard_normal((n_in, n_out)) * 0.01).astype(np.float32),
                       np.zeros(n_out, np.float32)]
        self.trainer: NumpyTrainer | None = NumpyTrainer(batch, lr) if trainer else None
        self.infer_delay = infer_delay

    prepare_gate: Any = None  # a threading.Event: prepare_params waits on it (tests hold a swap open)

    def prepare_params(self, params: list[np.ndarray]) -> list[np.ndarray]:
        if self.prepare_gate is not None:
            self.prepare_gate.wait(10)
        return [np.array(p) for p in params]

    def infer(self, inputs: Mapping[str, Any], params: Any = None) -> dict[str, np.ndarray]:
        import time

        (x,), _ = check_inputs(self.inputs, inputs)
        params = params if params is not None else self.params
        w = params[0]
        if self.infer_delay:
            time.sleep(self.infer_delay)  # widen the window between reading W and b
        b = params[1]
        return {"logits": (x @ w + b).astype(np.float32)}


# mypy checks the fakes against the protocols the node states (make check).
_engine: ports.Engine = NumpyArtifact()
_trainer: ports.Trainer = NumpyTrainer()
