"""The compiled training step (``train.so``): loss + gradients and the optimizer, callable separately."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from compiler.errors import ArtifactError, InputError
from compiler.manifest import TensorSpec, TrainingInfo
from compiler.runtime import Runtime, aligned_copy, aligned_empty, check_params

__all__ = ["Trainer", "ADJOINT_FUNC", "OPTIMIZER_FUNC"]

ADJOINT_FUNC = "backbone_loss_adjoint"
OPTIMIZER_FUNC = "optimizer"


class Trainer:
    """The compiled training step: loss + gradients, and the optimizer, callable separately.

    Uses its own VM (and lock), so a training step never blocks inference. Deterministic: the same
    inputs give bit-identical outputs (the swarm compares parameter hashes).
    """

    def __init__(self, runtime: Runtime, settings: TrainingInfo, inputs: list[TensorSpec],
                 param_names: list[str], params: list[np.ndarray], *, classes: int | None) -> None:
        self._rt = runtime
        self._lock = threading.Lock()
        self.loss: str = settings.loss
        self.optimizer: str = settings.optimizer
        self.lr: float = settings.lr
        self.batch: int = settings.batch
        self.param_names = param_names
        self._ref = params
        self._inputs = inputs
        self._state_specs = list(settings.optimizer_state)
        self.target_spec = settings.targets
        self.classes = classes  # ce: class ids lie in [0, classes); mse: None
        if self.loss == "ce" and (classes is None or classes < 1):
            raise ArtifactError(f"a ce training module needs the number of classes, got {classes!r}",
                             hint="the model's output must be logits shaped (batch, classes)")
        self._lr_tensor: tuple[float, Any] | None = None  # (rate, its 0-d tensor), reused while unchanged

    def _inputs_list(self, x: np.ndarray | dict[str, np.ndarray]) -> list[np.ndarray]:
        if not isinstance(x, dict):
            if len(self._inputs) != 1:
                raise InputError("this model has several inputs: pass x as {name: array}",
                                 hint=", ".join(s.name for s in self._inputs))
            x = {self._inputs[0].name: x}
        out = []
        for spec in self._inputs:
            if spec.name not in x:
                raise InputError(f"missing training input {spec.name!r}", hint="pass every model input")
            arr = np.asarray(x[spec.name])
            want = (self.batch, *spec.shape[1:])
            if arr.shape != want or str(arr.dtype) != spec.dtype:
                raise InputError(f"training input {spec.name!r} is {arr.dtype}{list(arr.shape)}, expected "
                                 f"{spec.dtype}{list(want)}",
                                 hint=f"training batches have exactly {self.batch} samples")
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():  # inference takes them; training never
                raise InputError(f"training input {spec.name!r} holds NaN or infinity",
                                 hint="training data must be finite numbers")
            out.append(arr)
        return out

    def _targets(self, y: np.ndarray) -> np.ndarray:
        """``y`` checked: shape, dtype, class ids in range (ce) or finite (mse). The compiled loss
        indexes memory by a class id, so an id out of range would read out of bounds."""
        y = np.asarray(y)
        spec = self.target_spec
        if y.shape != spec.shape:
            raise InputError(f"targets have shape {list(y.shape)}, expected {list(spec.shape)}",
                             hint="ce: int class ids (batch,); mse: float targets shaped like the output")
        if self.loss == "ce":
            return self._class_ids(y)
        if str(y.dtype) != spec.dtype:
            raise InputError(f"targets have dtype {y.dtype}, expected {spec.dtype}",
                             hint=f"convert them with .astype('{spec.dtype}')")
        if not np.isfinite(y).all():
            i = int(np.flatnonzero(~np.isfinite(y.ravel()))[0])
            raise InputError(f"targets contain NaN or Inf (element {i}: {y.ravel()[i]})",
                             hint="mse targets must be finite numbers")
        return y

    def _class_ids(self, y: np.ndarray) -> np.ndarray:
        classes = int(self.classes or 0)
        if y.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(y) | (np.mod(y, 1) != 0)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InputError(f"targets[{i}] = {y[i]} is not a class id",
                                 hint=f"ce targets are integer class ids in [0, {classes})")
        if y.dtype.kind not in "iu":
            raise InputError(f"targets have dtype {y.dtype}, expected {self.target_spec.dtype} class ids",
                             hint=f"convert them with .astype('{self.target_spec.dtype}')")
        bad = (y < 0) | (y >= classes)  # on the caller's dtype: no wrap-around before the check
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError(f"targets[{i}] = {int(y[i])} is not a class id in [0, {classes})",
                             hint=f"the model has {classes} classes: label them 0..{classes - 1}")
        return y.astype(self.target_spec.dtype, copy=False)

    def loss_and_grad(self, params: list[np.ndarray], x: np.ndarray | dict[str, np.ndarray],
                      y: np.ndarray) -> tuple[float, list[np.ndarray]]:
        """Mean loss over the batch and d(loss)/d(param) for every parameter, in manifest order."""
        params = check_params(params, self.param_names, self._ref)
        xs = self._inputs_list(x)
        y = self._targets(y)
        t = self._rt.tensor
        with self._lock:
            args = [*[t(a) for a in xs], *[t(p) for p in params], t(y)]
            out = self._rt.call(ADJOINT_FUNC, tuple(args), args)
        return float(out[0]), out[1:]

    def init_state(self, params: list[np.ndarray]) -> list[np.ndarray]:
        """The optimizer state before the first step (a list of arrays; opaque to callers)."""
        check_params(params, self.param_names, self._ref)
        state = []
        for i, (shape, dtype) in enumerate(self._state_specs):
            # Adam keeps beta1**t and beta2**t in slots 1 and 2; they start at 1.
            fill = 1.0 if self.optimizer == "adam" and i in (1, 2) else 0.0
            arr = aligned_empty(shape, dtype)  # aligned: passed to TVM without a copy
            arr[...] = fill
            state.append(arr)
        return state

    def apply(self, params: list[np.ndarray], grads: list[np.ndarray], state: list[np.ndarray],
              lr: float | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One optimizer step: (new params, new state). ``lr`` overrides the compiled default: it
        is a round's resolved rate (``federation.roundspec.resolve`` gives ``lr`` in (0, LR_MAX] or
        None for this default; compiler imports nothing of federation, its peer layer)."""
        params = check_params(params, self.param_names, self._ref)
        grads = check_params(grads, self.param_names, self._ref)
        if len(state) != len(self._state_specs):
            raise InputError(f"optimizer state has {len(state)} tensors, expected {len(self._state_specs)}",
                             hint="create it with trainer.init_state(params)")
        rate = self.lr if lr is None else float(lr)
        if not np.isfinite(rate) or rate <= 0:
            raise InputError(f"learning rate must be a positive finite number, got {lr!r}",
                             hint="e.g. lr=0.01")
        t = self._rt.tensor
        with self._lock:
            if self._lr_tensor is None or self._lr_tensor[0] != rate:
                self._lr_tensor = (rate, t(aligned_copy(np.asarray(rate, dtype=np.float32))))
            ps, gs = [t(p) for p in params], [t(g) for g in grads]
            ss = [t(np.asarray(s)) for s in state]
            out = self._rt.call(OPTIMIZER_FUNC, (ps, gs, ss, self._lr_tensor[1]), [*ps, *gs, *ss])
        k = len(params)
        return out[:k], out[k:]
