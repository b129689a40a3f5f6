"""A numpy stand-in for a compiled artifact (softmax regression) for fast, TVM-free node tests.

It follows the compiler's Artifact/Trainer interface (BRIEF.md) exactly; tests that need the
real TVM artifact use the ``digits_artifact`` fixture from ``tests/fixtures_node.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import numpy as np


class Spec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str


class NumpyTrainer:
    """Mean cross-entropy softmax regression with plain SGD."""

    def __init__(self, batch: int = 16, lr: float = 0.1) -> None:
        self.batch, self.lr, self.loss, self.optimizer = batch, lr, "ce", "sgd"

    def loss_and_grad(self, params, x, y):
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

    def init_state(self, params):
        return []

    def apply(self, params, grads, state, lr=None):
        lr = np.float32(self.lr if lr is None else lr)
        return [(p - lr * g).astype(np.float32) for p, g in zip(params, grads, strict=True)], state


class NumpyArtifact:
    """``x`` float32 [N, 64] -> ``logits`` [N, 10], params W [64, 10], b [10]."""

    def __init__(self, *, n_in: int = 64, n_out: int = 10, seed: int = 0, batch: int = 16,
                 lr: float = 0.1, trainer: bool = True, infer_delay: float = 0.0) -> None:
        rng = np.random.default_rng(seed)
        self.name = "numpy-softmax"
        self.manifest = SimpleNamespace(preset="x86_64")
        self.inputs = [Spec("x", (1, n_in), "float32")]
        self.outputs = [Spec("logits", (1, n_out), "float32")]
        self.param_names = ["W", "b"]
        self.params = [(rng.standard_normal((n_in, n_out)) * 0.01).astype(np.float32),
                       np.zeros(n_out, np.float32)]
        self.trainer = NumpyTrainer(batch, lr) if trainer else None
        self.infer_delay = infer_delay

    def infer(self, inputs, params=None):
        import time

        params = params if params is not None else self.params
        w = params[0]
        if self.infer_delay:
            time.sleep(self.infer_delay)  # widen the window between reading W and b
        b = params[1]
        return {"logits": (inputs["x"] @ w + b).astype(np.float32)}
