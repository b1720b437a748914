"""Evaluation metrics for a trained classifier: confusion matrix, per-class precision/recall/F1,
accuracy with a Wilson confidence interval, expected calibration error, and the confidence threshold
below which a prediction is flagged "uncertain".

Pure NumPy on host arrays (the distill stage evaluates once per run, so speed is not the point;
clear errors and no NaN in the outputs are). Every function validates its inputs and names the
argument at fault, because a shape mix-up here silently produces a plausible but wrong report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

#: Threshold used when the validation split is too small to choose one (same default as leaflens.apps.model_card).
DEFAULT_UNCERTAIN_THRESHOLD = 0.5


# ---- input checks --------------------------------------------------------------------------------
def _labels(name: str, y: Any, num_classes: int | None = None) -> np.ndarray:
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of class indices, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold integer class indices, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if num_classes is not None and arr.size and (arr.min() < 0 or arr.max() >= num_classes):
        raise ValueError(f"{name} holds class indices outside [0, {num_classes}): "
                         f"min {arr.min()}, max {arr.max()}")
    return arr


def _probs(name: str, probs: Any) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-D (N, num_classes) array of probabilities, got shape {p.shape}")
    if not np.all(np.isfinite(p)):
        raise ValueError(f"{name} contains NaN or infinite values")
    if p.size and (p.min() < -1e-6 or p.max() > 1 + 1e-6 or np.abs(p.sum(axis=1) - 1).max() > 1e-3):
        raise ValueError(f"{name} rows must be probabilities summing to 1 (apply softmax to logits first); "
                         f"row sums range {p.sum(axis=1).min():.4g}..{p.sum(axis=1).max():.4g}")
    return p


def _aligned(probs: np.ndarray, y: np.ndarray, pname: str, yname: str) -> None:
    if probs.shape[0] != y.shape[0]:
        raise ValueError(f"{pname} has {probs.shape[0]} rows but {yname} has {y.shape[0]} labels")


# ---- confusion matrix and per-class scores -------------------------------------------------------
def softmax(logits: Any) -> np.ndarray:
    """Rows of logits -> rows of probabilities (float64-safe: the row maximum is subtracted first)."""
    z = np.asarray(logits)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def confusion_matrix(y_true: Any, y_pred: Any, num_classes: int) -> np.ndarray:
    """(C, C) int64 counts; ``cm[i, j]`` = images of true class ``i`` predicted as ``j`` (rows = true)."""
    if int(num_classes) < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    c = int(num_classes)
    t = _labels("y_true", y_true, c)
    p = _labels("y_pred", y_pred, c)
    if t.shape != p.shape:
        raise ValueError(f"y_true has {t.size} labels but y_pred has {p.size}")
    return np.bincount(t * c + p, minlength=c * c).reshape(c, c).astype(np.int64)


def _check_cm(cm: Any) -> np.ndarray:
    m = np.asarray(cm)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"confusion matrix must be square (C, C), got shape {m.shape}")
    if m.size and (m.min() < 0 or not np.all(m == np.round(m))):
        raise ValueError("confusion matrix must hold non-negative integer counts")
    return m.astype(np.int64)


def per_class_prf(cm: Any) -> list[dict[str, float | int]]:
    """Precision, recall, F1 and support of every class from a confusion matrix (rows = true).

    A score whose denominator is zero is reported as 0.0, never NaN: a class that is never predicted
    has precision 0, a class absent from the labels has recall 0 (and support 0), and F1 is 0 when
    precision + recall is 0. That is the convention of scikit-learn's ``zero_division=0``.
    """
    m = _check_cm(cm)
    tp = np.diag(m).astype(np.float64)
    support = m.sum(axis=1)
    predicted = m.sum(axis=0)
    out: list[dict[str, float | int]] = []
    for i in range(m.shape[0]):
        precision = tp[i] / predicted[i] if predicted[i] else 0.0
        recall = tp[i] / support[i] if support[i] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
        out.append({"precision": float(precision), "recall": float(recall), "f1": float(f1),
                    "support": int(support[i]), "predicted": int(predicted[i])})
    return out


# ---- accuracy with a confidence interval ---------------------------------------------------------
def accuracy_ci(correct: int, total: int, level: float = 0.95) -> tuple[float, float, float]:
    """``(accuracy, low, high)``: accuracy with its Wilson score interval at confidence ``level``.

    Wilson rather than the normal ("Wald") interval because test splits are small and accuracies
    near 1: Wald collapses to zero width at 100 % and can leave [0, 1]; Wilson does neither.
    """
    correct, total = int(correct), int(total)
    if total <= 0:
        raise ValueError(f"accuracy_ci needs at least one evaluated image, got total={total}")
    if not 0 <= correct <= total:
        raise ValueError(f"correct must be in [0, total={total}], got {correct}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = correct / total
    z2n = z * z / total
    centre = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / total + z2n / (4 * total))
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    # Exact end points where rounding would leave them a hair off (0/n has low 0; n/n has high 1).
    if correct == 0:
        lo = 0.0
    if correct == total:
        hi = 1.0
    return p, lo, hi


# ---- calibration ---------------------------------------------------------------------------------
def calibration_bins(probs: Any, y_true: Any, bins: int = 15) -> list[dict[str, float | int]]:
    """Reliability-diagram data: for each of ``bins`` equal-width confidence bins, the number of
    predictions whose top probability falls in it, their mean confidence and their accuracy.

    Bin ``b`` holds confidences in ``[b/bins, (b+1)/bins)``; a confidence of exactly 1 goes to the last bin.
    Empty bins are reported with count 0 and confidence/accuracy 0.
    """
    p = _probs("probs", probs)
    y = _labels("y_true", y_true, p.shape[1])
    _aligned(p, y, "probs", "y_true")
    if int(bins) < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    bins = int(bins)
    conf = p.max(axis=1) if p.size else np.zeros(0)
    correct = (p.argmax(axis=1) == y).astype(np.float64) if p.size else np.zeros(0)
    idx = np.minimum((conf * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins)
    sum_conf = np.bincount(idx, weights=conf, minlength=bins)
    sum_acc = np.bincount(idx, weights=correct, minlength=bins)
    out = []
    for b in range(bins):
        n = int(count[b])
        out.append({"low": b / bins, "high": (b + 1) / bins, "count": n,
                    "confidence": float(sum_conf[b] / n) if n else 0.0,
                    "accuracy": float(sum_acc[b] / n) if n else 0.0})
    return out


def expected_calibration_error(probs: Any, y_true: Any, bins: int = 15) -> float:
    """ECE: the count-weighted mean gap ``|accuracy - confidence|`` over equal-width confidence bins
    (Guo et al. 2017), with the top-class probability as the confidence. 0 = perfectly calibrated."""
    table = calibration_bins(probs, y_true, bins)
    total = sum(b["count"] for b in table)
    if total == 0:
        raise ValueError("expected_calibration_error needs at least one prediction")
    return float(sum(b["count"] * abs(b["accuracy"] - b["confidence"]) for b in table) / total)


# Share of validation photos the "ambiguous" rule may leave unanswered (on new photos about as many: the
# least confident k of n validation photos put (k+1)/(n+1) of new ones below the threshold on average).
# The out-of-domain check flags at most 3 % of genuine new photos with 0.9 confidence
# (leaflens.pipeline.ood.DEFAULT_BUDGET, DEFAULT_CONFIDENCE): together under the 5 % a field tool can afford.
# Near ties (leaflens.apps.model_card.TIE_RATIO) are "ambiguous" on top of this budget, whatever their share:
# few on a strong model (none of the iBeans student's 133 validation photos), more on a weak many-class one
# (the demo's: 5 of 180), where they are coin flips better not answered.
AMBIGUOUS_BUDGET = 0.015


# ---- the "uncertain" threshold -------------------------------------------------------------------
def choose_uncertain_threshold(
    probs_val: Any,
    y_val: Any,
    target_precision: float = 0.95,
    min_samples: int = 20,
    min_kept: int = 10,
    default: float = DEFAULT_UNCERTAIN_THRESHOLD,
    max_flagged: float | None = AMBIGUOUS_BUDGET,
) -> dict[str, Any]:
    """Choose the top-probability threshold below which a prediction is shown as "ambiguous" ("uncertain").

    Rule (on the validation split): sort predictions by confidence (top probability); "kept" are the
    predictions at or above a cut.

    - ``max_flagged`` given (the default, ``"budget"``): flag the least confident ``max_flagged`` share
      of the validation predictions (fewer when ties straddle the cut): the photos the model is least
      able to decide between its classes, whatever its accuracy. A weak model then does not leave a
      third of the photos unanswered to reach a target, and a strong one still names its coin flips;
      the least confident photos are where its mistakes gather, so the answered ones are at least as
      accurate as all of them. ``reached`` says whether the kept ones reach ``target_precision``.
      At least one photo is flagged when the share is under one photo (fewer than 67 validation photos
      at 1.5 %): otherwise a model trained on a small dataset would never say "unsure", where it is
      most often wrong (few-label teachers, small validation splits drawn from their validation photos:
      the photos it leaves unanswered among the rest were wrong answers 50-87 % of the time, against
      14-24 % of all of them; ``benchmarks/ambiguous_small_val.py``).
    - ``max_flagged=None`` (``"target"``): among the cuts that keep at least ``min_kept`` predictions and
      whose kept predictions are at least ``target_precision`` accurate, take the one that keeps the
      most (highest coverage). The threshold is then placed midway between the least
    confident kept prediction and the most confident flagged one (or ``1/C``, the lowest possible top
    probability, when none is flagged): any value in that gap gives the same validation figures, and
    the midpoint leaves a margin on both sides for unseen photos.

    Fall-backs, reported in ``method``:

    - ``"default"``: no validation prediction, or (target rule) fewer than ``min_samples``, too few to
      choose anything; the threshold is ``default`` (0.5, the apps' default).
    - ``"best_effort"`` (target rule): no cut reaches the target; the cut with the highest kept accuracy
      (ties: more kept) is used and ``reached`` is False.

    Returns ``{"threshold", "coverage", "accuracy", "kept", "n_val", "target", "reached", "method"}``
    where coverage and accuracy are those of the kept validation predictions at the threshold
    (a prediction with top probability ``p`` is uncertain when ``p < threshold``, as in leaflens.apps.predictor).
    """
    p = _probs("probs_val", probs_val)
    y = _labels("y_val", y_val, p.shape[1])
    _aligned(p, y, "probs_val", "y_val")
    if not 0 < target_precision <= 1:
        raise ValueError(f"target_precision must be in (0, 1], got {target_precision}")
    n = int(y.size)
    num_classes = p.shape[1]

    def result(threshold: float, reached: bool, method: str) -> dict[str, Any]:
        from leaflens.apps.model_card import unsure  # noqa: PLC0415  (the served rule: threshold and near ties)

        conf = p.max(axis=1) if n else np.zeros(0)
        keep = conf >= threshold
        kept = int(keep.sum())
        acc = float((p[keep].argmax(axis=1) == y[keep]).mean()) if kept else 0.0
        answered = ~unsure(p, threshold) if n else np.zeros(0, bool)
        n_answered = int(answered.sum())
        return {"threshold": float(threshold), "coverage": kept / n if n else 0.0, "accuracy": acc,
                "kept": kept, "n_val": n, "target": float(target_precision), "reached": bool(reached),
                "method": method, "max_flagged": max_flagged,
                # what the served rule answers: the threshold and the near-tie rule together
                "answered": n_answered / n if n else 0.0,
                "answered_accuracy": float((p[answered].argmax(axis=1) == y[answered]).mean()) if n_answered
                else 0.0}

    # The budget rule needs no minimum: it flags the least confident photo(s) of however many there are. A fixed
    # 0.5 below 20 photos made a weak many-class model "unsure" of every photo (16 of 16 on validation).
    if n < (1 if max_flagged is not None else max(1, int(min_samples))):
        return result(default, False, "default")

    conf = p.max(axis=1)
    correct = p.argmax(axis=1) == y
    order = np.argsort(-conf, kind="stable")
    conf_sorted, correct_sorted = conf[order], correct[order]
    kept_count = np.arange(1, n + 1)
    kept_acc = np.cumsum(correct_sorted) / kept_count
    # A cut can only fall after the last of a run of equal confidences (ties are kept or flagged together).
    is_cut = np.append(conf_sorted[1:] < conf_sorted[:-1], True)
    valid = is_cut & (kept_count >= min(int(min_kept), n))
    if max_flagged is not None:
        if not 0 <= max_flagged < 1:
            raise ValueError(f"max_flagged must be in [0, 1), got {max_flagged}")
        flags = max(1.0, np.floor(max_flagged * n + 1e-9)) if max_flagged > 0 else 0.0
        allowed = is_cut & (n - kept_count <= flags)  # min_kept is the target rule's: here the budget bounds it
        k = int(np.flatnonzero(allowed)[0]) if allowed.any() else n - 1  # the most flagged within the budget
        below = conf_sorted[k + 1] if k + 1 < n else 1.0 / num_classes
        threshold = (conf_sorted[k] + min(below, conf_sorted[k])) / 2
        return result(threshold, bool(kept_acc[k] >= target_precision - 1e-12), "budget")
    meets = valid & (kept_acc >= target_precision - 1e-12)
    if meets.any():
        k = int(np.flatnonzero(meets)[-1])  # the most predictions kept
        reached, method = True, "target"
    else:
        cand = np.flatnonzero(valid)
        best = kept_acc[cand].max()
        k = int(cand[kept_acc[cand] >= best - 1e-12][-1])
        reached, method = False, "best_effort"
    below = conf_sorted[k + 1] if k + 1 < n else 1.0 / num_classes
    threshold = (conf_sorted[k] + min(below, conf_sorted[k])) / 2
    return result(threshold, reached, method)


# ---- hardest mistakes ----------------------------------------------------------------------------
def hardest_misclassified(probs: Any, y_true: Any, k: int = 32) -> np.ndarray:
    """Indices of up to ``k`` misclassified images, most confidently wrong first (for a contact sheet)."""
    p = _probs("probs", probs)
    y = _labels("y_true", y_true, p.shape[1])
    _aligned(p, y, "probs", "y_true")
    if not p.size:
        return np.zeros(0, dtype=np.int64)
    pred = p.argmax(axis=1)
    wrong = np.flatnonzero(pred != y)
    conf = p[wrong, pred[wrong]]
    return wrong[np.argsort(-conf, kind="stable")][: max(0, int(k))].astype(np.int64)


# ---- one JSON-ready summary ----------------------------------------------------------------------
def evaluation_summary(probs: Any, y_true: Any, classes: Sequence[str], level: float = 0.95,
                       bins: int = 15) -> dict[str, Any]:
    """Everything report.json and report.md show about one split, as plain JSON types.

    Keys: ``n``, ``correct``, ``accuracy``, ``accuracy_ci`` ([low, high]), ``ci_level``, ``classes``,
    ``per_class`` (list of {"class", "precision", "recall", "f1", "support", "predicted"}),
    ``macro_precision``, ``macro_recall``, ``macro_f1`` (unweighted means over the classes with photos: a class
    without any has no recall to average, and a field set often holds only some classes), ``macro_classes`` (how
    many classes they average), ``confusion_matrix``
    (list of lists, rows = true), ``ece``, ``calibration`` (the bins of :func:`calibration_bins`).
    """
    p = _probs("probs", probs)
    classes = [str(c) for c in classes]
    if p.shape[1] != len(classes):
        raise ValueError(f"probs has {p.shape[1]} columns but {len(classes)} class names were given")
    y = _labels("y_true", y_true, len(classes))
    _aligned(p, y, "probs", "y_true")
    if y.size == 0:
        raise ValueError("evaluation_summary needs at least one labelled image")
    pred = p.argmax(axis=1)
    cm = confusion_matrix(y, pred, len(classes))
    prf = per_class_prf(cm)
    correct = int((pred == y).sum())
    acc, lo, hi = accuracy_ci(correct, int(y.size), level)
    per_class = [{"class": name, **scores} for name, scores in zip(classes, prf)]
    present = [sc for sc in prf if sc["support"] > 0]  # not empty: y has at least one label
    return {
        "n": int(y.size),
        "correct": correct,
        "accuracy": acc,
        "accuracy_ci": [lo, hi],
        "ci_level": float(level),
        "classes": classes,
        "per_class": per_class,
        "macro_precision": float(np.mean([s["precision"] for s in present])),
        "macro_recall": float(np.mean([s["recall"] for s in present])),
        "macro_f1": float(np.mean([s["f1"] for s in present])),
        "macro_classes": len(present),
        "confusion_matrix": cm.tolist(),
        "ece": expected_calibration_error(p, y, bins),
        "calibration": calibration_bins(p, y, bins),
    }
