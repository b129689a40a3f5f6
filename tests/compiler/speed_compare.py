"""Same-run latency of onnxruntime vs untuned TVM builds: naive lowering, pre-packed default schedules
without the channels-last conversion ("nchw", the previous default), default schedules, default
schedules with weight pre-packing (BatchNorm folded, compiler/prepack.py; the default).

    PYTHONPATH=. .venv/bin/python tests/compiler/speed_compare.py [--target x86_64-avx512] [MODEL ...]

Both sides on 1 thread (TVM_NUM_THREADS=1, onnxruntime intra_op_num_threads=1, sequential).
Per model: compile the artifacts (timed), then 3 interleaved rounds (--rounds) of
ort / naive / nchw / default / prepacked,
each >= 0.3 s of calls; prints medians of the three round medians, ratios to onnxruntime
measured in the same rounds, compile seconds and the load average. Not a test (no test_ prefix).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TVM_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--target", default="x86_64-avx512")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from bench.compile import _ort_session, measure, set_threads
    from compiler import layout, zoo
    from compiler.artifact import load_artifact
    from compiler.build import compile_model

    set_threads(1)
    models = args.models or ["ds-cnn-kws", "mobilenet-v1-0.25-vww", "resnet8-cifar10", "fc-autoencoder",
                             "sensor-mlp", "digits-mlp"]
    work = Path(tempfile.mkdtemp(prefix="speed-compare-"))
    for name in models:
        onnx_path = zoo.save(name, work / f"{name}.onnx")
        x = np.random.default_rng(0).standard_normal(zoo.input_shape(name)).astype(np.float32)
        sess = _ort_session(onnx_path, 1)
        ref = sess.run(None, {"x": x})[0]
        calls = {"ort": lambda s=sess, x=x: s.run(None, {"x": x})}
        row: dict[str, object] = {"model": name, "target": args.target}
        for kind, default, prepack in (("naive", False, False), ("nchw", True, True),
                                       ("default", True, False), ("prepacked", True, True)):
            t0 = time.perf_counter()
            # "nchw": the pre-packed default schedules without the channels-last conversion
            # (compiler.layout.channels_last), the previous default
            keep = layout.wants_channels_last
            if kind == "nchw":
                layout.wants_channels_last = lambda _t: False
            try:
                out = compile_model(onnx_path, target=args.target, out_dir=work / f"{name}-{kind}",
                                    progress=False, default_schedules=default, prepack=prepack)
            finally:
                layout.wants_channels_last = keep
            row[f"compile_{kind}_s"] = round(time.perf_counter() - t0, 2)
            art = load_artifact(out)
            got = next(iter(art.infer({art.inputs[0].name: x}).values()))
            row[f"max_abs_err_{kind}"] = float(np.abs(got - ref).max())
            main_f = art._infer.vm()["main"]
            xt = art._infer.tensor(x)
            params = art._default.tensors
            calls[kind] = lambda f=main_f, xt=xt, p=params: np.from_dlpack(f(xt, *p))
        rounds: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.rounds):
            for k, fn in calls.items():
                rounds[k].append(measure(fn, min_seconds=args.seconds)["median_us"])
        med = {k: round(statistics.median(v), 2) for k, v in rounds.items()}
        row["us"] = med
        row["x_ort"] = {k: round(v / med["ort"], 2) for k, v in med.items() if k != "ort"}
        row["load1"] = round(os.getloadavg()[0], 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
