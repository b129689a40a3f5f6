"""Is calibrating int8 on a node's own samples worth it? Top-1 against float on sklearn digits.

    python -m bench.int8_calibration [--target x86_64] [--samples 400] [--autoencoder [--severity S]]
        [--swap-cost MODEL,...] [--node-swap MODEL,... [--steps N]] [--json]

The fleet's float model: zoo ``digits-mlp`` (64-64-10) with weights fitted by sklearn's
MLPClassifier on 1300 standard digits (as ``tests/compiler/test_quantize.py``). Two nodes see
different data: ``standard`` (the digits as trained) and ``dim`` (the same digits at 0.6x
brightness, a node whose sensor reads lower). Each node's data are split (seed 0) into the samples
it stores (400, written to a real ``SampleStore`` in a node data_dir) and held-out samples it is
scored on. For each node the float model is quantized (``--quantize int8``) and compiled for
``--target`` once per calibration source, then top-1 on the node's held-out samples is taken from
the compiled artifact next to the float model's (onnxruntime):

- ``random``: ``--samples`` seeded random-normal inputs (what ``bench.int8`` uses for the zoo);
- ``other-node``: the other node's stored samples (the other brightness);
- ``other-classes``: this node's samples of classes 0-4 only (a node that has seen half the classes);
- ``own``: the node's own store, through ``edgenode.calibration.store_calibration`` (the path
  ``fractal compile --calibration-from NODE_DATA_DIR`` takes).

Also reported: agreement of the int8 top-1 with the float top-1, the mean absolute logit error
against float, and the seconds each quantize + compile took (what a node re-quantizing after a
round would pay on this machine).

Anomaly detection (``--autoencoder``): zoo ``fc-autoencoder`` (640-128x4-8-128x4-640, BatchNorm
set to identity) with weights fitted by sklearn's MLPRegressor on 600 normal vibration windows of
each of two simulated machines (``deploy.vibration``). The node watches machine 1 and stores 400
of its normal windows; scored on 200 held-out normal windows and 70 of each fault kind at
severity ``--severity`` (weak faults, so that the AUC is not 1.0 for every build): AUC of the
reconstruction error, float (onnxruntime) and int8 (compiled artifact), calibrated on random
normal inputs, on the other machine's node's windows, and on the node's own store.

A node's swap after a real round (``--node-swap MODELS``, issue 30 "training stays float"): each
model compiled with ``--train --quantize int8`` (calibrated on the node's stored samples), served by
a real ``EdgeNode`` (precision auto = int8, one-member swarm on an in-memory transport) that stores
``--samples`` inputs (digits-mlp: the first sklearn digits, its zoo weights untrained; other models:
seeded random-normal inputs with random labels) and runs one round of ``--steps`` SGD steps. A
client thread sends one-sample requests back to back meanwhile. Reported: the seconds from the
commit to the rebuilt library serving (the node's child process: quantize + compile + load),
request latency p50 / p99 / max at rest and during the rebuild, and on held-out inputs (digits:
the 497 held-out digits; others: 200 random-normal inputs) the top-1 of the committed float
model, of the stale int8 library (built from the shipped weights) and of the rebuilt one, with
agreement with float and the mean absolute logit error against it.

Swap cost (``--swap-cost MODELS``): what a node re-quantizing a round's new float parameters on its
own samples would pay before it could swap its int8 library, per zoo model (seeded weights; a
store of ``--samples`` seeded random-normal inputs): seconds to read the store, quantize, compile
(untuned, ``--target``) and load the new artifact.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.host import print_rows

__all__ = ["main"]

DIM = 0.6  # brightness of the "dim" node's sensor


def _set_gemm_weights(m: Any, mlp: Any) -> dict[str, Any]:
    """Copy a fitted scikit-learn MLP's weights into the model's Gemm initializers, in order;
    returns the initializers by name."""
    from onnx import numpy_helper

    inits = {i.name: i for i in m.graph.initializer}
    for node, w, b in zip([n for n in m.graph.node if n.op_type == "Gemm"], mlp.coefs_, mlp.intercepts_,
                          strict=True):
        trans_b = any(a.name == "transB" and a.i == 1 for a in node.attribute)
        for name, arr in ((node.input[1], w.T if trans_b else w), (node.input[2], b)):
            inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr, np.float32), name))
    return inits


def _float_model(xtr: np.ndarray, ytr: np.ndarray, path: Path) -> Path:
    import onnx
    from sklearn.neural_network import MLPClassifier

    from compiler import zoo

    clf = MLPClassifier(hidden_layer_sizes=(64,), max_iter=300, random_state=0).fit(xtr, ytr)
    m = zoo.build("digits-mlp")
    _set_gemm_weights(m, clf)
    onnx.save(m, str(path))
    return path


def _logits(fn: Any, x: np.ndarray) -> np.ndarray:
    return np.concatenate([fn(x[i:i + 1]) for i in range(len(x))])


def run(target: str, n_cal: int, work: Path) -> list[dict[str, Any]]:
    import warnings

    import onnxruntime as ort
    from sklearn.datasets import load_digits
    from sklearn.exceptions import ConvergenceWarning

    from compiler import compile_model, load_artifact
    from compiler.quantize import CalibrationSet
    from edgenode.calibration import open_store, store_calibration
    from edgenode.store import SampleSpec, SampleStore

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    idx = np.random.default_rng(0).permutation(len(y))
    tr, te = idx[:1300], idx[1300:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = _float_model(x[tr], y[tr], work / "digits.onnx")
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    # each node stores n_cal of the training digits (its own split) and is scored on the held-out ones
    nodes = {"standard": 1.0, "dim": DIM}
    stored = {name: (x[tr[:n_cal]] * s, y[tr[:n_cal]]) for name, s in nodes.items()}
    spec = SampleSpec((("x", (64,), "float32"),), (), "int64")
    for name, (xs, ys) in stored.items():
        store = SampleStore(work / name / "samples.db", spec, num_classes=10)
        store.add({"x": xs}, ys)
        store.close()
    rows = []
    for name, scale in nodes.items():
        xte, yte = (x[te] * scale).astype(np.float32), y[te]
        f_logits = _logits(lambda a: sess.run(None, {"x": a})[0], xte)
        f_pred = f_logits.argmax(1)
        other = next(n for n in nodes if n != name)
        own_x, own_y = stored[name]
        store = open_store(work / name)
        try:
            own = store_calibration(store)
        finally:
            store.close()
        sources = {
            "random": CalibrationSet({"x": np.random.default_rng(0).standard_normal((n_cal, 64))
                                      .astype(np.float32)}, "random normal"),
            "other-node": CalibrationSet({"x": stored[other][0]}, f"node {other}"),
            "other-classes": CalibrationSet({"x": own_x[own_y < 5]}, "classes 0-4"),
            "own": own,
        }
        for src, cal in sources.items():
            t0 = time.perf_counter()
            art_dir = compile_model(model, target=target, out_dir=work / f"{name}-{src}", progress=False,
                                    quantize="int8", calibration=cal)
            seconds = time.perf_counter() - t0
            art = load_artifact(art_dir)
            q_logits = _logits(lambda a, art=art: art.infer({"x": a})["logits"], xte)
            q_pred = q_logits.argmax(1)
            rows.append({"node": name, "calibration": src, "cal_samples": int(len(cal.arrays["x"])),
                         "float_top1": round(float((f_pred == yte).mean() * 100), 2),
                         "int8_top1": round(float((q_pred == yte).mean() * 100), 2),
                         "agree_with_float": round(float((q_pred == f_pred).mean() * 100), 2),
                         "mean_abs_logit_err": round(float(np.abs(q_logits - f_logits).mean()), 4),
                         "quantize_compile_s": round(seconds, 2), "held_out": int(len(yte))})
    return rows


def _autoencoder(windows: np.ndarray, path: Path) -> Path:
    import warnings

    import onnx
    from onnx import numpy_helper
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPRegressor

    from compiler import zoo

    reg = MLPRegressor(hidden_layer_sizes=(128, 128, 128, 128, 8, 128, 128, 128, 128), max_iter=200,
                       random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        reg.fit(windows, windows)
    m = zoo.build("fc-autoencoder")
    inits = _set_gemm_weights(m, reg)
    for node in (n for n in m.graph.node if n.op_type == "BatchNormalization"):  # identity
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        for name, v in zip(node.input[1:], (1.0, 0.0, 0.0, 1.0 - eps), strict=True):
            inits[name].CopyFrom(numpy_helper.from_array(np.full(inits[name].dims, v, np.float32), name))
    onnx.save(m, str(path))
    return path


def run_autoencoder(target: str, n_cal: int, severity: float, work: Path) -> list[dict[str, Any]]:
    import onnxruntime as ort

    from compiler import compile_model, load_artifact
    from compiler.quantize import CalibrationSet
    from deploy.vibration import FaultKind, machines, windows
    from edgenode.anomaly import auc, reconstruction_error
    from edgenode.calibration import open_store, store_calibration
    from edgenode.store import SampleSpec, SampleStore

    rng = np.random.default_rng(0)
    ms = machines(2)
    fit = [windows(m, 600, None, rng=rng).astype(np.float32) for m in ms]
    model = _autoencoder(np.concatenate(fit), work / "ae.onnx")
    own = windows(ms[0], n_cal, None, rng=rng).astype(np.float32)
    other = windows(ms[1], n_cal, None, rng=rng).astype(np.float32)
    store = SampleStore(work / "ae-node" / "samples.db", SampleSpec((("x", (640,), "float32"),), (), "int64"))
    store.add({"x": own}, None)
    store.close()
    store = open_store(work / "ae-node")
    try:
        own_cal = store_calibration(store)
    finally:
        store.close()
    ev = [windows(ms[0], 200, None, rng=rng)] + [windows(ms[0], 70, k, rng=rng, severity=severity)
                                                 for k in FaultKind]
    x = np.concatenate(ev).astype(np.float32)
    flags = np.r_[np.zeros(200), np.ones(70 * len(FaultKind))]
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    f_auc = auc(reconstruction_error(x, _logits(lambda a: sess.run(None, {"x": a})[0], x)), flags)
    sources = {"random": CalibrationSet({"x": np.random.default_rng(0).standard_normal((n_cal, 640))
                                         .astype(np.float32)}, "random normal"),
               "other-node": CalibrationSet({"x": other}, "machine 2's node"), "own": own_cal}
    rows = []
    for src, cal in sources.items():
        t0 = time.perf_counter()
        art_dir = compile_model(model, target=target, out_dir=work / f"ae-{src}", progress=False,
                                quantize="int8", calibration=cal)
        seconds = time.perf_counter() - t0
        art = load_artifact(art_dir)
        recon = _logits(lambda a, art=art: art.infer({"x": a})["recon"], x)
        q_auc = auc(reconstruction_error(x, recon), flags)
        rows.append({"node": "machine-1", "calibration": src, "cal_samples": int(len(cal.arrays["x"])),
                     "severity": severity, "float_auc": round(float(f_auc or 0), 4),
                     "int8_auc": round(float(q_auc or 0), 4), "quantize_compile_s": round(seconds, 2)})
    return rows


def swap_cost(models: list[str], target: str, n_cal: int, work: Path) -> list[dict[str, Any]]:
    from compiler import compile_model, load_artifact, zoo
    from compiler.build import QUANT_FILE
    from compiler.quantize import quantize_int8
    from edgenode.calibration import open_store, store_calibration
    from edgenode.store import SampleSpec, SampleStore

    rows = []
    for name in models:
        f32 = zoo.save(name, work / f"{name}.onnx")
        shape = tuple(zoo.input_shape(name)[1:])
        store = SampleStore(work / name / "samples.db", SampleSpec((("x", shape, "float32"),), (), "int64"))
        store.add({"x": np.random.default_rng(0).standard_normal((n_cal, *shape)).astype(np.float32)}, None)
        store.close()
        t0 = time.perf_counter()
        store = open_store(work / name)
        try:
            cal = store_calibration(store)
        finally:
            store.close()
        t1 = time.perf_counter()
        qpath, _ = quantize_int8(f32, cal, work / f"{name}-{QUANT_FILE}")
        t2 = time.perf_counter()
        art_dir = compile_model(qpath, target=target, out_dir=work / f"{name}-int8", progress=False)
        t3 = time.perf_counter()
        load_artifact(art_dir).infer({"x": cal.arrays["x"][:1]})
        t4 = time.perf_counter()
        rows.append({"model": name, "cal_samples": n_cal, "read_store_s": round(t1 - t0, 2),
                     "quantize_s": round(t2 - t1, 2), "compile_s": round(t3 - t2, 2),
                     "load_and_first_infer_s": round(t4 - t3, 2), "total_s": round(t4 - t0, 2)})
    return rows


def _swap_data(name: str, n_cal: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Stored samples, their labels, held-out inputs and labels (None: no meaningful labels)."""
    from compiler import zoo

    rng = np.random.default_rng(0)
    if name == "digits-mlp":
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
        idx = rng.permutation(len(y))
        return x[idx[:n_cal]], y[idx[:n_cal]], x[idx[1300:]], y[idx[1300:]]
    shape = tuple(zoo.input_shape(name)[1:])
    classes = int(zoo.build(name).graph.output[0].type.tensor_type.shape.dim[-1].dim_value)
    return (rng.standard_normal((n_cal, *shape)).astype(np.float32),
            rng.integers(0, classes, n_cal).astype(np.int64),
            rng.standard_normal((200, *shape)).astype(np.float32), None)


class _Client:
    """One-sample requests back to back on a thread; (start time, seconds) of each."""

    def __init__(self, infer: Any, x: np.ndarray) -> None:
        import threading

        self.lat: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._infer, self._x = infer, x
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i, n = 0, len(self._x)
        while not self._stop.is_set():
            t = time.perf_counter()
            self._infer({"x": self._x[i % n:i % n + 1]})
            self.lat.append((t, time.perf_counter() - t))
            i += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> dict[str, float]:
        a = np.asarray([d for t, d in self.lat if t0 <= t < t1]) * 1e3
        return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
                "max": round(float(a.max()), 3), "n": int(len(a))}


def _node_swap_one(name: str, target: str, n_cal: int, steps: int, work: Path) -> dict[str, Any]:
    from compiler import TrainSettings, compile_model, zoo
    from compiler.quantize import CalibrationSet
    from edgenode.config import NodeConfig
    from edgenode.node import EdgeNode
    from federation.memory import MemoryHub
    from federation.messages import RoundCommand

    xs, ys, xte, yte = _swap_data(name, n_cal)
    f32 = zoo.save(name, work / f"{name}.onnx")
    t0 = time.perf_counter()
    art = compile_model(f32, target=target, out_dir=work / f"{name}-art", progress=False,
                        train=TrainSettings(loss="ce", optimizer="sgd", lr=0.05, batch=8),
                        quantize="int8", calibration=CalibrationSet({"x": xs}, "the node's samples"))
    compile_s = time.perf_counter() - t0
    cfg = NodeConfig.from_dict({"node_id": "n1", "artifact": str(art),
                                "data_dir": str(work / f"{name}-node")})
    node = EdgeNode(cfg, transport=MemoryHub().transport("n1"))
    node.start()
    try:
        int8 = node.int8
        assert int8 is not None
        node.add_samples({"x": xs}, ys)

        def logits(fn: Any) -> np.ndarray:
            return np.concatenate([fn({"x": xte[i:i + 8]})["logits"] for i in range(0, len(xte), 8)])

        def acc(pred: np.ndarray) -> float | None:
            return None if yte is None else round(float((pred == yte).mean() * 100), 2)

        client = _Client(node.infer, xte)
        rest0 = time.perf_counter()
        time.sleep(3.0)
        rest1 = time.perf_counter()
        node.run_round(RoundCommand(round_id=f"bench-{name}", steps=steps, lr=0.05, participants=["n1"]))
        committed = time.perf_counter()
        stale = logits(int8.infer)
        sha = node.params_sha256
        while int8.built_from != (1, sha):
            if int8.info().error:
                raise RuntimeError(int8.info().error)
            time.sleep(0.01)
        swapped = time.perf_counter()
        client.stop()
        f_logits, q_logits = logits(node.model.infer), logits(int8.infer)
        f_pred = f_logits.argmax(1)
        return {
            "model": name, "train_quant_compile_s": round(compile_s, 1), "round_steps": steps,
            "commit_to_int8_s": round(swapped - committed, 2), "build_s": int8.info().build_s,
            "latency_rest_ms": client.between(rest0, rest1),
            "latency_rebuild_ms": client.between(committed, swapped),
            "float_top1": acc(f_pred), "stale_int8_top1": acc(stale.argmax(1)),
            "int8_top1": acc(q_logits.argmax(1)),
            "stale_agree_with_float": round(float((stale.argmax(1) == f_pred).mean() * 100), 2),
            "int8_agree_with_float": round(float((q_logits.argmax(1) == f_pred).mean() * 100), 2),
            "int8_mean_abs_logit_err": round(float(np.abs(q_logits - f_logits).mean()), 4),
            "held_out": int(len(xte))}
    finally:
        node.stop()


def node_swap(models: list[str], target: str, n_cal: int, steps: int, work: Path) -> list[dict[str, Any]]:
    """``--node-swap``: see the module docstring."""
    return [_node_swap_one(name, target, n_cal, steps, work) for name in models]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.int8_calibration", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="x86_64")
    ap.add_argument("--samples", type=int, default=400, help="samples each node stores (and random ones)")
    ap.add_argument("--autoencoder", action="store_true", help="the fc-autoencoder's anomaly AUC instead")
    ap.add_argument("--severity", type=float, default=0.2, help="fault severity with --autoencoder")
    ap.add_argument("--swap-cost", metavar="MODELS", help="time re-quantizing these zoo models instead")
    ap.add_argument("--node-swap", metavar="MODELS",
                    help="a node's int8 swap after a real round, these zoo models")
    ap.add_argument("--steps", type=int, default=30, help="SGD steps of the --node-swap round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fractal-int8-cal-") as tmp:
        if args.node_swap:
            rows = node_swap([m for m in args.node_swap.split(",") if m], args.target, args.samples,
                             args.steps, Path(tmp))
        elif args.swap_cost:
            models = [m for m in args.swap_cost.split(",") if m]
            rows = swap_cost(models, args.target, args.samples, Path(tmp))
        elif args.autoencoder:
            rows = run_autoencoder(args.target, args.samples, args.severity, Path(tmp))
        else:
            rows = run(args.target, args.samples, Path(tmp))
    print_rows(args.target, rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
