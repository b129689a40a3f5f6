"""Keyword spotting: does int8 keep the float model's top-1? (issue 30's accuracy goal)

    python -m bench.int8_kws [--per-class 300] [--epochs 12] [--target x86_64-avx2] [--json]

The data: no Speech Commands here (no network but the package registries), so the keywords are
synthesised, and the figures are the *difference* int8 makes, not an accuracy comparable to
MLPerf Tiny's. Twelve classes as in MLPerf Tiny KWS: ten keywords, ``_silence_`` (background noise
only) and ``_unknown_`` (other words). A word is one to three syllables, each a voiced sound (the
harmonics of a pitch contour shaped by two formants, as a vowel) optionally led by a fricative
(band-passed noise) or a plosive burst; every utterance varies the speaker (pitch x0.7-1.4, vocal
tract: formants x0.85-1.15), the tempo (x0.8-1.25), the onset (0-0.35 s), the loudness, formant
jitter, and sits in background noise at 0-20 dB SNR. One second at 16 kHz; features as MLPerf Tiny's
KWS: 49 frames (30 ms window, 20 ms stride) x 10 MFCCs of a 40-band log-mel spectrum (20-4000 Hz),
standardised with the training set's mean and deviation.

The model: the zoo's ``ds-cnn-kws`` (MLPerf Tiny DS-CNN S, [N,1,49,10] -> [N,12]), trained here in
PyTorch (Adam, the same layers in the same order, "same" padding as the zoo writes it) and written
back into the zoo's ONNX graph, so the model compiled is the zoo's own with trained weights. Then:
float top-1 (onnxruntime), int8 QDQ (``compiler.quantize.quantize_int8``: per-channel int8 weights,
MinMax, calibrated on 400 training utterances) run by onnxruntime and by the project's integer
kernels (``compile_model(..., integer=True)`` for ``--target``), on held-out utterances: top-1 of
each, agreement with float, and the int8 outputs' steps from onnxruntime's on the same QDQ model.
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

__all__ = ["KEYWORDS", "features", "main", "synth"]

SR = 16000
KEYWORDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
CLASSES = (*KEYWORDS, "_silence_", "_unknown_")

# syllable: (onset consonant: None | "s" | "f" | "t" | "k", (F1, F2) Hz, pitch contour: rise in
# octaves over the syllable, relative duration)
_VOWELS = {"a": (750, 1200), "e": (500, 1900), "i": (300, 2300), "o": (500, 900), "u": (320, 800),
           "ae": (660, 1700), "er": (490, 1350), "ai": (700, 1600)}
_WORDS: dict[str, list[tuple[str | None, str, float, float]]] = {
    "yes": [(None, "i", 0.0, 0.3), (None, "e", -0.1, 0.6), ("s", "e", 0.0, 0.1)],
    "no": [(None, "o", -0.2, 1.0)],
    "up": [(None, "er", 0.1, 0.7), ("t", "er", 0.0, 0.15)],
    "down": [("t", "a", -0.1, 0.6), (None, "u", -0.2, 0.4)],
    "left": [(None, "e", 0.1, 0.6), ("f", "e", 0.0, 0.2), ("t", "e", 0.0, 0.1)],
    "right": [(None, "er", 0.0, 0.3), (None, "ai", 0.1, 0.5), ("t", "ai", 0.0, 0.1)],
    "on": [(None, "a", 0.15, 0.8), (None, "er", 0.0, 0.2)],
    "off": [(None, "a", -0.15, 0.7), ("f", "a", 0.0, 0.3)],
    "stop": [("s", "a", 0.0, 0.2), ("t", "a", 0.0, 0.6), ("k", "a", 0.0, 0.1)],
    "go": [("k", "o", 0.1, 0.9)],
}
_CONSONANT_BAND = {"s": (4500, 7500), "f": (2000, 7000), "t": (2500, 6000), "k": (1200, 3000)}


def _band_noise(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1 / SR)
    spec[(f < lo) | (f > hi)] = 0
    out = np.fft.irfft(spec, n)
    return out / (np.abs(out).max() + 1e-9)


def _voiced(rng: np.random.Generator, n: int, f0: float, rise: float, formants: tuple[float, float],
            tract: float) -> np.ndarray:
    t = np.arange(n) / SR
    f0_t = f0 * 2.0 ** (rise * t / max(t[-1], 1e-3)) * (1 + 0.01 * rng.standard_normal())
    phase = 2 * np.pi * np.cumsum(f0_t) / SR
    f1, f2 = (f * tract * (1 + 0.08 * rng.standard_normal()) for f in formants)
    out = np.zeros(n)
    for k in range(1, int(4000 / f0) + 1):
        hk = k * f0
        amp = np.exp(-((hk - f1) / 140) ** 2) + 0.7 * np.exp(-((hk - f2) / 180) ** 2) + 0.02
        out += amp * np.sin(k * phase)
    env = np.sin(np.pi * np.arange(n) / n) ** 0.6
    return out * env / (np.abs(out).max() + 1e-9)


def _word(rng: np.random.Generator, recipe: list[tuple[str | None, str, float, float]]) -> np.ndarray:
    tempo, f0, tract = rng.uniform(0.8, 1.25), 130 * rng.uniform(0.7, 1.4), rng.uniform(0.85, 1.15)
    total = 0.45 * tempo  # seconds
    parts = []
    for cons, vowel, rise, frac in recipe:
        if cons is not None:
            lo, hi = _CONSONANT_BAND[cons]
            m = int(SR * (0.09 if cons in "sf" else 0.03) * tempo)
            parts.append(0.5 * _band_noise(rng, m, lo, hi) * np.hanning(m))
        parts.append(_voiced(rng, max(int(SR * total * frac), 200), f0, rise, _VOWELS[vowel], tract))
    return np.concatenate(parts)


def _unknown_recipe(rng: np.random.Generator) -> list[tuple[str | None, str, float, float]]:
    cons = [None, None, "s", "f", "t", "k"]
    n = int(rng.integers(1, 4))
    # pairs of vowels and contours no keyword uses in that order
    vowels = list(_VOWELS)
    return [(cons[int(rng.integers(len(cons)))], vowels[int(rng.integers(len(vowels)))],
             float(rng.uniform(-0.3, 0.3)), float(rng.uniform(0.2, 0.8))) for _ in range(n)]


def synth(per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``per_class`` one-second utterances of each of the 12 classes: audio [N, 16000], labels [N]."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for label, name in enumerate(CLASSES):
        for _ in range(per_class):
            noise = _band_noise(rng, SR, 20, 7900) * rng.uniform(0.3, 1.0)
            clip = np.zeros(SR)
            if name != "_silence_":
                recipe = _WORDS[name] if name in _WORDS else _unknown_recipe(rng)
                w = _word(rng, recipe)[:SR]
                at = int(rng.uniform(0, 0.35) * SR)
                w = w[:SR - at]
                clip[at:at + len(w)] = w
                snr_db = rng.uniform(0, 20)
                noise *= np.sqrt((clip ** 2).mean() / ((noise ** 2).mean() + 1e-12) / 10 ** (snr_db / 10))
            xs.append((clip + noise) * rng.uniform(0.2, 1.0))
            ys.append(label)
    return np.asarray(xs, np.float32), np.asarray(ys, np.int64)


def _mel_filters(n_fft: int, bands: int, lo: float, hi: float) -> np.ndarray:
    def mel(f: np.ndarray | float) -> np.ndarray:
        return 2595 * np.log10(1 + np.asarray(f) / 700)

    edges = 700 * (10 ** (np.linspace(mel(lo), mel(hi), bands + 2) / 2595) - 1)
    f = np.fft.rfftfreq(n_fft, 1 / SR)
    fb = np.zeros((bands, len(f)))
    for i in range(bands):
        a, b, c = edges[i:i + 3]
        fb[i] = np.clip(np.minimum((f - a) / (b - a), (c - f) / (c - b)), 0, None)
    return fb


def features(audio: np.ndarray) -> np.ndarray:
    """MFCCs as MLPerf Tiny's KWS: [N, 49, 10] (30 ms window, 20 ms stride, 40 log-mel bands)."""
    from scipy.fft import dct

    win, hop, n_fft = 480, 320, 512
    frames = 1 + (audio.shape[1] - win) // hop
    idx = np.arange(win)[None, :] + hop * np.arange(frames)[:, None]
    spec = np.abs(np.fft.rfft(audio[:, idx] * np.hanning(win), n_fft)) ** 2
    logmel = np.log(spec @ _mel_filters(n_fft, 40, 20, 4000).T + 1e-6)
    return dct(logmel, type=2, norm="ortho", axis=-1)[..., :10].astype(np.float32)


def _train(x: np.ndarray, y: np.ndarray, epochs: int, seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    c = 64

    class Same(nn.Module):  # the zoo's explicit "same" padding: the extra row/column at the end
        def __init__(self, kh: int, kw: int) -> None:
            super().__init__()
            self.pad = ((kw - 1) // 2, kw // 2, (kh - 1) // 2, kh // 2)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return nn.functional.pad(t, self.pad)

    def block(cin: int, cout: int, k: tuple[int, int], stride: int = 1, groups: int = 1) -> list[nn.Module]:
        return [Same(*k), nn.Conv2d(cin, cout, k, stride, groups=groups, bias=False),
                nn.BatchNorm2d(cout, eps=1e-3), nn.ReLU()]

    layers = block(1, c, (10, 4), 2)
    for _ in range(4):
        layers += block(c, c, (3, 3), groups=c) + block(c, c, (1, 1))
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, len(CLASSES)))
    opt = torch.optim.Adam(net.parameters(), 2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        net.train()
        for idx in torch.randperm(len(xt), generator=g).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()
            opt.step()
        sched.step()
    return net.eval()


def _into_zoo(net: Any) -> Any:
    """The zoo's ds-cnn-kws graph with ``net``'s weights: its initializers are, in order, each
    conv's weight, each batch norm's gamma / beta / mean / var, then the Gemm's [in, out] weight and
    bias; the torch modules come in the same order."""
    from onnx import numpy_helper
    from torch import nn

    from compiler import zoo

    model = zoo.build("ds-cnn-kws")
    arrays: list[np.ndarray] = []
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            arrays.append(m.weight.detach().numpy())
        elif isinstance(m, nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None
            arrays += [m.weight.detach().numpy(), m.bias.detach().numpy(), m.running_mean.numpy(),
                       m.running_var.numpy()]
        elif isinstance(m, nn.Linear):
            arrays += [m.weight.detach().numpy().T, m.bias.detach().numpy()]
    inits = model.graph.initializer
    assert len(inits) == len(arrays), (len(inits), len(arrays))
    for i, arr in enumerate(arrays):
        assert tuple(inits[i].dims) == arr.shape, (inits[i].name, tuple(inits[i].dims), arr.shape)
        inits[i].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr, np.float32), inits[i].name))
    return model


def run(per_class: int, epochs: int, target: str, work: Path, seed: int = 0) -> list[dict[str, Any]]:
    import onnx
    import onnxruntime as ort

    from compiler import compile_model, load_artifact
    from compiler.quantize import CalibrationSet, quantize_int8

    t0 = time.perf_counter()
    audio, y = synth(per_class, seed)
    feats = features(audio)
    order = np.random.default_rng(seed).permutation(len(y))
    n_te = len(y) // 5
    te, tr = order[:n_te], order[n_te:]
    mu, sd = feats[tr].mean(), feats[tr].std()
    x = ((feats - mu) / sd)[:, None].astype(np.float32)
    t1 = time.perf_counter()
    net = _train(x[tr], y[tr], epochs, seed)
    t2 = time.perf_counter()
    f32 = work / "kws.onnx"
    onnx.save(_into_zoo(net), str(f32))
    cal = CalibrationSet({"x": x[tr[:400]]}, "400 training utterances")
    qdq, _ = quantize_int8(f32, cal, work / "kws.int8.onnx")
    art = load_artifact(compile_model(qdq, target=target, out_dir=work / "kws-int8", progress=False,
                                      integer=True))
    t3 = time.perf_counter()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the QDQ reference
    s32 = ort.InferenceSession(str(f32), providers=["CPUExecutionProvider"])
    s8 = ort.InferenceSession(str(qdq), so, providers=["CPUExecutionProvider"])
    xte, yte = x[te], y[te]

    def batched(fn: Any) -> np.ndarray:  # the zoo graph's batch is 1
        return np.concatenate([fn(xte[i:i + 1]) for i in range(len(xte))])

    f_logits = batched(lambda a: s32.run(None, {"x": a})[0])
    o_logits = batched(lambda a: s8.run(None, {"x": a})[0])
    t_logits = batched(lambda a: art.infer({"x": a})["logits"])
    # the QDQ model's output is dequantized: one step is its output scale
    out_scale = next(float(onnx.numpy_helper.to_array(i)) for i in onnx.load(str(qdq)).graph.initializer
                     if i.name.startswith("logits") and i.name.endswith("_scale"))
    f_pred = f_logits.argmax(1)

    def top1(pred: np.ndarray) -> float:
        return round(float((pred == yte).mean() * 100), 2)

    rows = []
    for name, logits in (("float32 (onnxruntime)", f_logits), ("int8 QDQ (onnxruntime)", o_logits),
                         (f"int8 integer kernels ({target})", t_logits)):
        pred = logits.argmax(1)
        rows.append({"model": "ds-cnn-kws", "run": name, "top1": top1(pred),
                     "vs_float_points": round(top1(pred) - top1(f_pred), 2),
                     "agree_with_float": round(float((pred == f_pred).mean() * 100), 2),
                     "steps_from_ort_int8": (None if logits is f_logits else
                                             int(np.rint(np.abs(logits - o_logits).max() / out_scale))),
                     "held_out": int(len(yte)), "train": int(len(tr)), "epochs": epochs,
                     "data_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1),
                     "quantize_compile_s": round(t3 - t2, 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.int8_kws", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-class", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--target", default="x86_64-avx2")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.per_class < 10 or args.epochs < 1:
        print("error: --per-class must be >= 10 and --epochs >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fractal-kws-") as tmp:
        rows = run(args.per_class, args.epochs, args.target, Path(tmp))
    print_rows(args.target, rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
