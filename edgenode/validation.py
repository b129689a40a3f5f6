"""The validation share of a node's samples, and the evaluation on it.

A sample is *validation* when a hash of its stored bytes (inputs and label) falls below the
share: the same sample is always on the same side, across restarts and on every node, with no
state to keep; changing the share moves only the samples between the old and the new threshold.
The store keeps each row's :func:`split_key` (defined there) so counting and selecting a side is
one query.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edgenode.store import Samples, split_key
from federation.messages import Validation

__all__ = ["split_key", "evaluate", "EVAL_BATCH", "DIVERGED"]

EVAL_BATCH = 256  # samples per inference call while evaluating
DIVERGED = float(np.finfo(np.float64).max)  # the loss reported when the model's outputs are not finite


def evaluate(forward: Callable[[dict[str, np.ndarray]], np.ndarray], samples: Samples, *, loss: str,
             version: int | None = None, batch: int = EVAL_BATCH) -> Validation | None:
    """Loss (and accuracy for ``loss="ce"``, classification) of ``forward`` (inputs -> the model's
    first output) on ``samples``; None when there are none. ``loss`` is the training module's:
    ``ce`` = mean cross-entropy of the logits, ``mse`` = mean squared error."""
    n = len(samples)
    if n == 0:
        return None
    total, correct = 0.0, 0
    for lo in range(0, n, batch):
        inputs = {k: v[lo:lo + batch] for k, v in samples.inputs.items()}
        y = samples.labels[lo:lo + batch]
        out = np.asarray(forward(inputs), np.float64)
        if loss == "ce":
            z = out - out.max(axis=1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            idx = y.astype(np.int64).reshape(-1)
            total += float(-logp[np.arange(idx.size), idx].sum())
            finite = np.isfinite(out).all(axis=1)  # a diverged row is wrong, whatever argmax says
            correct += int(((out.argmax(axis=1) == idx) & finite).sum())
        else:
            diff = out.reshape(out.shape[0], -1) - np.asarray(y, np.float64).reshape(out.shape[0], -1)
            total += float((diff**2).mean(axis=1).sum())
    # A diverged model reports the largest finite loss (NaN is not JSON): worse than anything.
    mean = total / n if np.isfinite(total) else DIVERGED
    return Validation(loss=mean, accuracy=correct / n if loss == "ce" else None, samples=n,
                      model_version=version)
