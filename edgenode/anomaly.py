"""Anomaly scores of a reconstruction model (an autoencoder: one input, an output of the same shape).

Such a model learns what normal looks like from unlabelled samples: its training target is its
input. Its *score* for a sample is the reconstruction error, the mean squared difference between
the input and the model's output; the node's *threshold* is a stated percentile (``[anomaly]
percentile``, 99 by default) of the scores of its newest normal samples (unlabelled or labelled 0)
under the committed parameters, refreshed at start, after every committed round or rollback, and
after every ``refresh_samples`` new samples. Inference returns two outputs next to the model's:
``anomaly_score`` (FP32 [N]) and ``anomaly`` (BOOL [N], score above the threshold; all false
until a threshold exists).

Labels of an anomaly model are flags: 0 normal, 1 anomalous (``POST /v1/labels`` sets them
later). Samples labelled 1 never train; the validation reports the AUC of the scores on the
labelled validation samples when both kinds are there.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edgenode.ports import Spec
from edgenode.store import Samples
from federation.messages import ANOMALY_POINTS_MAX, ANOMALY_RANGES_MAX, AnomalyTrace, Validation

__all__ = ["SCORE", "FLAG", "AnomalyScorer", "is_reconstruction", "reconstruction_error", "auc",
           "evaluate_anomaly"]

SCORE, FLAG = "anomaly_score", "anomaly"
_BATCH = 256


@dataclass(frozen=True)
class _Out:
    name: str
    shape: tuple[int, ...]
    dtype: str


def is_reconstruction(inputs: Sequence[Spec], outputs: Sequence[Spec]) -> bool:
    """One float input and a first output of the same shape: a model that reconstructs its input."""
    if len(inputs) != 1 or not outputs:
        return False
    i, o = inputs[0], outputs[0]
    return (tuple(i.shape) == tuple(o.shape) and np.dtype(i.dtype).kind == "f"
            and np.dtype(o.dtype).kind == "f")


def reconstruction_error(x: np.ndarray, recon: np.ndarray) -> np.ndarray:
    """Mean squared error per sample (N,), float32; inf where the output is not finite."""
    n = x.shape[0]
    d = np.asarray(recon, np.float64).reshape(n, -1) - np.asarray(x, np.float64).reshape(n, -1)
    with np.errstate(over="ignore", invalid="ignore"):
        err = (d * d).mean(axis=1)
    return np.where(np.isfinite(err), err, np.inf).astype(np.float32)


def auc(scores: np.ndarray, flags: np.ndarray) -> float | None:
    """Area under the ROC curve of ``scores`` for ``flags`` (1 = anomalous), ties counted half;
    None unless both kinds are present."""
    s = np.asarray(scores, np.float64).reshape(-1)
    y = np.asarray(flags).reshape(-1) != 0
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return None
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


Forward = Callable[[dict[str, np.ndarray]], np.ndarray]  # inputs -> the model's first output


def _scores(forward: Forward, samples: Samples, input_name: str) -> np.ndarray:
    x = samples.inputs[input_name]
    parts = [reconstruction_error(x[lo:lo + _BATCH], forward({input_name: x[lo:lo + _BATCH]}))
             for lo in range(0, len(samples), _BATCH)]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def evaluate_anomaly(forward: Forward, samples: Samples, input_name: str, *,
                     version: int | None = None) -> Validation | None:
    """Validation of a reconstruction model: loss = mean reconstruction error of the normal
    samples (unlabelled or labelled 0), ``auc`` over the labelled ones (None without both kinds)."""
    if not len(samples):
        return None
    s = _scores(forward, samples, input_name)
    known = samples.known if samples.known is not None else np.ones(len(samples), bool)
    normal = ~known | (samples.labels.reshape(-1) == 0)
    if not normal.any():
        return None
    loss = float(np.mean(s[normal], dtype=np.float64))
    if not np.isfinite(loss):
        loss = float(np.finfo(np.float64).max)
    return Validation(loss=loss, samples=int(normal.sum()), model_version=version,
                      auc=auc(s[known], samples.labels.reshape(-1)[known]))


class AnomalyScorer:
    """Scores and flags inference outputs; learns its threshold from normal samples."""

    def __init__(self, input_name: str, output_name: str, *, percentile: float) -> None:
        self.input_name = input_name
        self.output_name = output_name
        self.percentile = float(percentile)
        self.threshold: float | None = None
        self.fitted_on = 0  # samples the threshold was computed from
        self.fitted_version: int | None = None
        self._lock = threading.Lock()
        # the live view in the node's status: the newest stream windows' scores, labelled faults
        self._scores: deque[tuple[float, float]] = deque(maxlen=ANOMALY_POINTS_MAX)
        self._labelled: deque[tuple[float, float]] = deque(maxlen=ANOMALY_RANGES_MAX)

    def observe(self, taken: np.ndarray, scores: np.ndarray) -> None:
        """Remember the scores of stream windows (taken at ``taken``, unix s) for :meth:`trace`."""
        with self._lock:
            for t, s in zip(np.asarray(taken, np.float64).tolist(), np.asarray(scores, np.float64).tolist(),
                            strict=True):
                if np.isfinite(t) and np.isfinite(s):
                    self._scores.append((t, s))

    def labelled_anomalous(self, since: float, until: float) -> None:
        """A time range labelled anomalous (a late label), shown with the scores."""
        if np.isfinite(since) and np.isfinite(until):
            with self._lock:
                self._labelled.append((float(since), float(until)))

    def trace(self) -> AnomalyTrace:
        with self._lock:
            t = self.threshold
            return AnomalyTrace(threshold=t if t is not None and np.isfinite(t) else None,
                                scores=list(self._scores), labelled=list(self._labelled))

    def specs(self, batch: int) -> list[_Out]:
        """The two outputs added to the model's (OIP metadata, requested-output checks)."""
        return [_Out(SCORE, (batch,), "float32"), _Out(FLAG, (batch,), "bool")]

    def score(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``anomaly_score`` and ``anomaly`` for a batch the model just answered."""
        s = reconstruction_error(np.asarray(inputs[self.input_name]), outputs[self.output_name])
        t = self.threshold
        return {SCORE: s, FLAG: (s > t) if t is not None else np.zeros(s.shape, bool)}

    def fit(self, forward: Forward, samples: Samples, version: int | None = None) -> float | None:
        """Set the threshold to the percentile of the scores of ``samples`` (normal ones)."""
        if not len(samples):
            return self.threshold
        s = _scores(forward, samples, self.input_name)
        s = s[np.isfinite(s)]
        if not s.size:
            return self.threshold
        with self._lock:
            self.threshold = float(np.percentile(s, self.percentile))
            self.fitted_on, self.fitted_version = int(s.size), version
        return self.threshold

    def as_targets(self, samples: Samples) -> Samples:
        """Training samples of a reconstruction model: the target is the input."""
        x = samples.inputs[self.input_name]
        return Samples(samples.inputs, np.ascontiguousarray(x, np.float32), samples.known)
