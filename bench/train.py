"""``fractal bench train``: one TVM training step (loss_and_grad + apply) vs PyTorch CPU.

Same model (the zoo ONNX graph; PyTorch runs it through :class:`OnnxTorch` with the weights
copied from the ONNX initializers), same batches, same plain SGD and learning rate, same thread
count (``TVM_NUM_THREADS`` and ``torch.set_num_threads``). Reports the median step time of
each and the loss after K steps, plus how far the two loss curves drift apart (they start from
identical weights, so they should agree to float rounding).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.artifacts import zoo_artifact
from bench.host import machine

__all__ = ["run", "DEFAULT_MODELS", "batches"]

DEFAULT_MODELS = ("digits-mlp", "ds-cnn-kws")


def batches(name: str, input_shape: tuple[int, ...], classes: int, batch: int, k: int,
            seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``k`` training batches: sklearn digits for digits-mlp (real data), seeded noise otherwise."""
    rng = np.random.default_rng(seed)
    if name == "digits-mlp":
        from sklearn.datasets import load_digits

        d = load_digits()
        x_all, y_all = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
        idx = [rng.choice(len(y_all), batch, replace=False) for _ in range(k)]
        return [(x_all[i], y_all[i]) for i in idx]
    return [(rng.standard_normal((batch, *input_shape)).astype(np.float32),
             rng.integers(0, classes, batch).astype(np.int64)) for _ in range(k)]


def _tvm_run(art: Any, data: list[tuple[np.ndarray, np.ndarray]], lr: float,
             warmup: int) -> tuple[list[float], list[float]]:
    tr = art.trainer
    params = [np.array(p) for p in art.params]
    state = tr.init_state(params)
    losses, times = [], []
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        loss, grads = tr.loss_and_grad(params, x, y)
        params, state = tr.apply(params, grads, state, lr=lr)
        dt = time.perf_counter() - t0
        losses.append(loss)
        if i >= warmup:
            times.append(dt)
    return losses, times


def _torch_run(onnx_path: Path, art: Any, data: list[tuple[np.ndarray, np.ndarray]], lr: float,
               warmup: int) -> tuple[list[float], list[float], float]:
    import onnx
    import torch

    from bench.onnx_torch import OnnxTorch

    model = OnnxTorch(onnx.load(str(onnx_path)), art.param_names)
    # same starting point as TVM, checked rather than assumed
    diff = max(float(np.abs(p.detach().numpy() - q).max())
               for p, q in zip(model.param_list(art.param_names), art.params, strict=True))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, times = [], []
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(xt), yt)
        loss.backward()
        opt.step()
        lv = float(loss.detach())
        dt = time.perf_counter() - t0
        losses.append(lv)
        if i >= warmup:
            times.append(dt)
    return losses, times, diff


def _summary(times: list[float]) -> dict[str, float]:
    ts = sorted(times)
    return {"median_ms": round(statistics.median(ts) * 1e3, 4),
            "p90_ms": round(ts[int(0.9 * len(ts))] * 1e3, 4), "min_ms": round(ts[0] * 1e3, 4)}


def bench_model(name: str, work_dir: Path, *, batch: int, steps: int, lr: float, warmup: int,
                progress: bool) -> dict[str, Any]:
    """TVM vs PyTorch on one zoo model."""
    from compiler import load_artifact

    def say(msg: str) -> None:
        if progress:
            print(f"[train] {name}: {msg}", file=sys.stderr, flush=True)

    say(f"compiling with a training module (batch {batch})")
    path = zoo_artifact(name, work_dir, batch=batch, lr=lr)
    art = load_artifact(path)
    spec = art.inputs[0]
    data = batches(name, tuple(spec.shape[1:]), int(art.outputs[0].shape[-1]), batch, steps + warmup)
    say(f"TVM: {steps + warmup} steps")
    tvm_losses, tvm_times = _tvm_run(art, data, lr, warmup)
    say(f"PyTorch: {steps + warmup} steps")
    pt_losses, pt_times, init_diff = _torch_run(work_dir / f"{name}-b{batch}.onnx", art, data, lr, warmup)
    tvm_s, pt_s = _summary(tvm_times), _summary(pt_times)
    k = steps + warmup
    return {
        "batch": batch, "lr": lr, "steps": k, "timed_steps": steps, "params": len(art.param_names),
        "tvm": {**tvm_s, "loss_first": round(tvm_losses[0], 6), "loss_after_k": round(tvm_losses[-1], 6)},
        "torch": {**pt_s, "loss_first": round(pt_losses[0], 6), "loss_after_k": round(pt_losses[-1], 6)},
        "speedup_tvm_vs_torch": round(pt_s["median_ms"] / tvm_s["median_ms"], 3),
        "tvm_no_slower": tvm_s["median_ms"] <= pt_s["median_ms"],
        "initial_weights_max_abs_diff": init_diff,
        "loss_curve_max_abs_diff": round(max(abs(a - b) for a, b in zip(tvm_losses, pt_losses, strict=True)),
                                         6),
    }


def run(models: tuple[str, ...] = DEFAULT_MODELS, *, batch: int = 32, steps: int = 50, lr: float = 0.1,
        warmup: int = 5, threads: int | None = None, work_dir: Path | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Run the training benchmark; returns one JSON-serialisable dict."""
    import torch

    n = threads or os.cpu_count() or 1
    # TVM reads TVM_NUM_THREADS when a thread first launches parallel work (not at import).
    os.environ["TVM_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fractal-bench-train-") as tmp:
        wd = Path(work_dir) if work_dir else Path(tmp)
        results = {m: bench_model(m, wd, batch=batch, steps=steps, lr=lr, warmup=warmup, progress=progress)
                   for m in models}
    return {"benchmark": "train", "machine": machine(), "threads": n, "torch": torch.__version__,
            "optimizer": "sgd", "loss": "ce", "models": results, "wall_s": round(time.perf_counter() - t0, 1)}


def format_table(result: dict[str, Any]) -> str:
    """A human-readable table of :func:`run`'s result."""
    rows = [f"{'model':<12} {'tvm ms':>9} {'torch ms':>9} {'speedup':>8} {'tvm loss@K':>11} "
            f"{'torch loss@K':>12}"]
    for name, r in result["models"].items():
        rows.append(f"{name:<12} {r['tvm']['median_ms']:>9.3f} {r['torch']['median_ms']:>9.3f} "
                    f"{r['speedup_tvm_vs_torch']:>8.2f} {r['tvm']['loss_after_k']:>11.4f} "
                    f"{r['torch']['loss_after_k']:>12.4f}")
    return "\n".join(rows)
