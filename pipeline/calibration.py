"""Temperature scaling: the served probabilities made to mean what they say, chosen on validation.

A student trained with label smoothing, mixup and soft teacher targets comes out under-confident: the demo
student answered 54 % on average on test photos it got right 81 % of the time (expected calibration error
0.28); the iBeans student 90 % where it was right 96 % of the time; the fine-tuned teacher (label smoothing,
dropout, a running average of its weights) likewise, 91 % where it was right 96 %. The app shows those numbers as the
model's confidence, and the "ambiguous" rule reads them (a second class within 90 % of the first is a near
tie), so an under-confident model called clear answers coin flips.

One number fixes most of it (Guo et al. 2017, "On calibration of modern neural networks"): the logits divided
by a temperature T chosen to minimise the negative log-likelihood of the validation labels. The most likely class
never changes (the order of the classes is kept), only how sure the model says it is, and with it which answers
are near ties; the export folds it into the classifier's weights, so every runtime (onnxruntime, Triton) serves
the calibrated probabilities.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["BOUNDS", "MIN_MISTAKES", "MIN_PHOTOS", "fit_temperature", "not_fitted_reason", "scale_classifier",
           "scaled_classifier"]

MIN_PHOTOS = 20  # fewer validation photos than this: no temperature is fitted (1.0), too few to estimate one
# Fewer wrong validation photos than this: none is fitted either. With none, the likelihood only rises as T falls
# (every answer right: any sharpening looks better) and the search would run to its lower bound; one mistake is
# a single point to weigh all sharpening against.
MIN_MISTAKES = 2
# The logits are scaled by at most 4x either way: a validation split of a few hundred photos does not support
# more, and beyond it the near-tie rule (a second class within 90 % of the first) could hardly fire.
BOUNDS = (0.25, 4.0)


def _nll(logits: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    z = logits / temperature
    z = z - z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-log_p[np.arange(len(labels)), labels].mean())


def _labelled(logits: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    z = np.asarray(logits, np.float64)
    y = np.asarray(labels).astype(np.int64)
    keep = y >= 0
    return z[keep], y[keep]


def not_fitted_reason(logits: Any, labels: Any) -> str | None:
    """Why :func:`fit_temperature` fits no temperature on these photos (it returns 1.0), or None when it does."""
    z, y = _labelled(logits, labels)
    if z.ndim != 2 or z.shape[1] < 2:
        return "fewer than two classes"
    if len(y) < MIN_PHOTOS:
        return f"{len(y)} labelled validation photos, fewer than the {MIN_PHOTOS} a temperature is fitted on"
    if not np.isfinite(z).all():
        return "the validation logits are not all finite"
    wrong = int(np.sum(z.argmax(1) != y))
    if wrong < MIN_MISTAKES:
        return (f"{wrong} wrong answer{'' if wrong == 1 else 's'} on validation, fewer than {MIN_MISTAKES}: nothing "
                "to weigh a sharper temperature against")
    return None


def fit_temperature(logits: Any, labels: Any) -> float:
    """The temperature that minimises the mean negative log-likelihood of ``labels`` under
    ``softmax(logits / T)`` (float64), searched on a log scale within :data:`BOUNDS`; 1.0 with fewer than
    :data:`MIN_PHOTOS` labelled photos, fewer than :data:`MIN_MISTAKES` of them wrong, or fewer than two
    classes among the logits (:func:`not_fitted_reason` says which)."""
    if not_fitted_reason(logits, labels) is not None:
        return 1.0
    z, y = _labelled(logits, labels)
    lo, hi = (math.log(b) for b in BOUNDS)
    grid = np.linspace(lo, hi, 41)
    best = int(np.argmin([_nll(z, y, math.exp(t)) for t in grid]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(40):  # golden-section search within the grid step around the best point (NLL is convex in 1/T)
        c, d = b - golden * (b - a), a + golden * (b - a)
        if _nll(z, y, math.exp(c)) < _nll(z, y, math.exp(d)):
            b = d
        else:
            a = c
    return float(math.exp((a + b) / 2))


@contextlib.contextmanager
def scaled_classifier(model: Any, temperature: float) -> Iterator[Any]:
    """``model`` with its classifier scaled by :func:`scale_classifier` for the duration, then its own weights
    back exactly (the arrays themselves, not a division that rounds)."""
    layer = model.classifier
    weight, bias = layer.weight.data, None if getattr(layer, "bias", None) is None else layer.bias.data
    scale_classifier(model, temperature)
    try:
        yield model
    finally:
        layer.weight.data = weight
        if bias is not None:
            layer.bias.data = bias


def scale_classifier(model: Any, temperature: float) -> None:
    """Divide ``model.classifier``'s weights and bias by ``temperature`` in place: its logits become the
    calibrated ``logits / temperature`` with no node added to the exported graph."""
    if temperature == 1.0:
        return
    layer = model.classifier
    scale = np.float32(1.0 / temperature)
    layer.weight.data = layer.weight.data * scale
    if getattr(layer, "bias", None) is not None:
        layer.bias.data = layer.bias.data * scale
