"""Whether a model has learnt anything: its validation accuracy against always answering the commonest class.

A run that trained too briefly, on shuffled labels or on photos that do not show the classes still ends
with a "kept" model, and every verdict it gives looks as sure as a good model's. This says so in words
before anyone serves it: the kept model's correct validation answers are compared with what answering the
most common validation class every time would get, by the exact one-sided binomial test (no SciPy): when
guessing would get as many right at least ``ALPHA`` of the time, the model is "no better than chance".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ALPHA = 0.05  # the chance of guessing as well, above which the model is not told apart from guessing
# 9 validation photos of 3 balanced classes: 6 right (67 %) is told apart (4.2 %), 5 right (56 %) is not (14.5 %)


def guessing_tail(correct: int, n: int, p: float) -> float:
    """P(X >= correct) for X ~ Binomial(n, p): how often guessing at rate ``p`` is right this often or more."""
    if correct <= 0:
        return 1.0
    if correct > n:
        return 0.0
    return float(min(1.0, sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(correct, n + 1))))


def chance_warning(val_accuracy: float, val_labels: Sequence[int] | np.ndarray, what: str = "the kept model",
                   alpha: float = ALPHA) -> str | None:
    """A warning when ``val_accuracy`` on the validation photos ``val_labels`` cannot be told apart from always
    answering their most common class; None when the model is clearly better (or there is nothing to judge)."""
    labels = np.asarray(val_labels)
    n = len(labels)
    if n == 0:
        return None
    majority = float(np.bincount(labels).max() / n)
    correct = int(round(val_accuracy * n))
    tail = guessing_tail(correct, n, majority)
    if tail <= alpha:
        return None
    return (f"{what} is right on {correct} of {n} validation photos ({100 * val_accuracy:.0f} %); a model that "
            f"always gave the most common class (right on {100 * majority:.0f} % of them) would score that well "
            f"{100 * tail:.0f} % of the time by chance: "
            "nothing shows it has learnt to tell the classes apart, and its answers would look sure all the same. "
            "Before serving it, check the photos and their folders (rejected.jsonl, data_report.json), train longer "
            "(--set train.epochs=...) or add photos (more validation photos also make this check surer)")
