"""The shortcut check: can the file's metadata alone (size, aspect, format, EXIF, camera, orientation, colour
mode, JPEG quality) tell the classes apart?

When each class comes from a different source (one phone, one web site, one colleague's scanner), the
photos of a class share a size, a format, EXIF or none, and a model can learn the source instead of the
disease. The check measures how well those facts alone predict the class: a categorical naive Bayes
classifier on the binned metadata, stratified k-fold cross-validated, scored by balanced accuracy (the
mean recall over classes, so chance is 1/K whatever the class sizes). Naive Bayes on bins rather than a
linear model because a source shows as any pattern of sizes (a class of 256 px photos between classes
of 128 and 512 px is not linearly separable in size), and because fitting is counting (fast).

A warning is due when the balanced accuracy is above chance by ``MIN_MARGIN`` and by ``NULL_SIGMAS`` (5)
times ``null_sd``, the largest standard deviation a balanced accuracy can have when the predictions do not
depend on the labels: ``sqrt(sum_k 1 / (4 n_k)) / K`` (each class's recall is then a binomial proportion
over its ``n_k`` photos). Small sets are noisy, so the margin grows as they shrink. Measured on 6,000
made-up datasets of random metadata and random labels (10-400 photos, 2-8 classes; sizes drawn from a
range or a few values, rare formats, unbalanced classes): the score reached 3.9 ``null_sd`` (0.35 in
balanced accuracy, on 45 photos) above chance, never 5; tests/data_prep/test_data_report.py shuffles the
labels of a real shortcut and of random metadata and expects no warning. When the warning is due, each
feature group is scored alone against the same threshold, so the warning names the ones that carry the
signal, with what differs between the classes.

A source behind ONE class of many hides in that score: when the metadata tells one class from the rest and
nothing else, the balanced accuracy rises to about 2/K, under the threshold once K is large or the classes
small (8 classes, one of them all PNG: 0.25 against a threshold of 0.26). So each class is also scored
against the rest (the same classifier on two labels, chance 0.5, the same 5 ``null_sd`` rule for those two
groups), and the class that stands out most is named.

A set too small for that rule (its threshold above a perfect score: 12 + 12 photos) can still show a clean
split: a class whose photos share no value of a feature with any other photo (every 'healthy' photo from one
phone, every 'rust' one from another). Its chance under random labels is exact (:func:`_chance_of_separation`:
the ways the feature's groups of equal values can make up the class, over all ways of drawing it); below
``EXACT_ALPHA`` over the number of features and classes tried, it warns.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FEATURES", "MIN_MARGIN", "NULL_SIGMAS", "PhotoMeta", "ShortcutResult", "check_shortcuts",
           "photo_meta"]

# The extensions each decoded format is normally saved under (".jpg" holding a PNG is a mismatch).
_EXTENSIONS = {"JPEG": {".jpg", ".jpeg", ".jfif", ".jpe"}, "MPO": {".jpg", ".jpeg"}, "PNG": {".png"},
               "WEBP": {".webp"}, "BMP": {".bmp"}, "TIFF": {".tif", ".tiff"}, "HEIF": {".heic", ".heif"},
               "AVIF": {".avif", ".heic", ".heif"}}
# Feature groups, as warnings name them.
FEATURES = ("image size", "aspect ratio", "file format", "format vs extension", "EXIF", "camera",
            "EXIF orientation", "colour mode", "JPEG quality")
MIN_MARGIN = 0.10  # balanced accuracy above chance, at the least, before a warning
NULL_SIGMAS = 5.0  # ... and by this many null_sd (see the module docstring)
FOLDS = 5
_MAX_CATEGORIES = 12  # a numeric feature with more distinct values is cut into quantile bins
_QUANTILE_BINS = 8
MIN_PHOTOS = 10
MIN_PER_SIDE = 5  # photos a class (and the rest) needs for its one-against-the-rest score


@dataclass(frozen=True)
class PhotoMeta:
    """What a photo's file says about its source: declared size, real format, extension match, EXIF."""

    width: int
    height: int
    format: str
    ext_matches: bool
    exif: bool
    mode: str = "RGB"  # Pillow's colour mode as stored (L, RGB, RGBA, P, CMYK...)
    camera: str = ""  # EXIF make and model
    orientation: int = 1  # EXIF orientation tag
    jpeg_q: int = 0  # mean of the luminance quantisation table (0: not a JPEG); lower is a higher quality


def photo_meta(header: Mapping[str, Any], path: str) -> PhotoMeta:
    """The metadata of a photo from what the decoder read in its header (``decode_image(header=...)``:
    real format, declared size before EXIF rotation, EXIF block present) and its file name's extension.
    TIFF files keep their tags outside an EXIF block and count as without."""
    fmt = str(header.get("format") or "unknown").upper()
    ext = os.path.splitext(path)[1].lower()
    return PhotoMeta(int(header.get("width", 0)), int(header.get("height", 0)), fmt,
                     ext in _EXTENSIONS.get(fmt, {ext}), bool(header.get("exif")), str(header.get("mode") or "RGB"),
                     str(header.get("camera") or ""), int(header.get("orientation") or 1),
                     int(header.get("jpeg_q") or 0))


@dataclass(frozen=True)
class ShortcutResult:
    """Cross-validated balanced accuracy of the metadata (all features, and each alone) against chance."""

    balanced_accuracy: float
    chance: float
    warn_at: float
    null_sd: float
    per_feature: dict[str, float]  # each feature group alone (computed only when the warning is due)
    flagged: tuple[str, ...]
    folds: int
    evidence: dict[str, str]
    one_class: str | None = None  # the class told from the rest, when the check found one (not all at once)

    @property
    def warns(self) -> bool:
        return self.balanced_accuracy >= self.warn_at


def _codes(values: np.ndarray) -> np.ndarray:
    """Small integer codes of one feature: its distinct values, or quantile bins when there are many."""
    uniq, inverse = np.unique(values, return_inverse=True)
    if len(uniq) <= _MAX_CATEGORIES:
        return inverse.astype(np.int64)
    edges = np.unique(np.quantile(values, np.linspace(0, 1, _QUANTILE_BINS + 1)[1:-1]))
    return np.searchsorted(edges, values, side="right").astype(np.int64)


def _categories(values: Sequence[str]) -> np.ndarray:
    """Codes of a categorical feature: its most common values, the rarest lumped together beyond
    ``_MAX_CATEGORIES``."""
    uniq, inverse, counts = np.unique(np.asarray(values), return_inverse=True, return_counts=True)
    if len(uniq) <= _MAX_CATEGORIES:
        return inverse.astype(np.int64)
    rank = np.empty(len(uniq), np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(len(uniq))
    return np.minimum(rank[inverse], _MAX_CATEGORIES - 1).astype(np.int64)


def _jpeg_only(q: np.ndarray) -> np.ndarray:
    """The JPEG quantisation column with the other formats' photos at the JPEGs' median, so that it tells
    qualities apart, not formats ("file format" does that)."""
    jpeg = q > 0
    return np.where(jpeg, q, np.median(q[jpeg]) if jpeg.any() else 0.0)


def _feature_columns(metas: Sequence[PhotoMeta]) -> dict[str, np.ndarray]:
    """Feature group -> (n, columns) int codes."""
    w = np.array([m.width for m in metas], np.float64)
    h = np.array([m.height for m in metas], np.float64)
    fmt = np.array([m.format for m in metas])
    return {
        "image size": np.stack([_codes(w), _codes(h)], axis=1),
        "aspect ratio": _codes(np.round(w / np.maximum(h, 1), 3))[:, None],
        "file format": _codes(fmt)[:, None],
        "format vs extension": np.array([[0 if m.ext_matches else 1] for m in metas], np.int64),
        "EXIF": np.array([[1 if m.exif else 0] for m in metas], np.int64),
        "camera": _categories([m.camera for m in metas])[:, None],
        "EXIF orientation": _categories([str(m.orientation) for m in metas])[:, None],
        "colour mode": _categories([m.mode for m in metas])[:, None],
        "JPEG quality": _codes(_jpeg_only(np.array([m.jpeg_q for m in metas], np.float64)))[:, None],
    }


def _stratified_folds(y: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    folds = np.empty(len(y), np.int64)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        folds[rng.permutation(idx)] = np.arange(len(idx)) % k
    return folds


def _cv_balanced_accuracy(x: np.ndarray, y: np.ndarray, n_classes: int, k: int, seed: int) -> float:
    """Stratified k-fold balanced accuracy of categorical naive Bayes (Laplace smoothing, equal class
    priors, so the decision favours no class for its size)."""
    folds = _stratified_folds(y, k, np.random.default_rng(seed))
    bins = x.max(axis=0) + 1
    pred = np.empty(len(y), np.int64)
    for f in range(k):
        test, train = folds == f, folds != f
        if not test.any():
            continue
        score = np.zeros((int(test.sum()), n_classes))
        for col in range(x.shape[1]):
            b = int(bins[col])
            counts = np.bincount(y[train] * b + x[train, col], minlength=n_classes * b).reshape(n_classes, b)
            logp = np.log((counts + 1.0) / (counts.sum(axis=1, keepdims=True) + bins[col]))
            score += logp[:, x[test, col]].T
        pred[test] = score.argmax(axis=1)
    recalls = [float((pred[y == c] == c).mean()) for c in range(n_classes) if (y == c).any()]
    return float(np.mean(recalls))


def null_sd(class_counts: Sequence[int] | np.ndarray) -> float:
    """The largest standard deviation of a balanced accuracy whose predictions ignore the labels."""
    counts = np.asarray(class_counts, np.float64)
    return float(np.sqrt(np.sum(1.0 / (4.0 * counts))) / len(counts))


def _share_gap(flags: np.ndarray, y: np.ndarray, classes: Sequence[str]) -> tuple[str, float, float]:
    """The class whose share of ``flags`` differs most from the other classes' share."""
    best = ("", 0.0, 0.0)
    for c, name in enumerate(classes):
        mine, others = flags[y == c], flags[y != c]
        if not len(mine) or not len(others):
            continue
        a, b = float(mine.mean()), float(others.mean())
        # the largest gap; on a tie, the class that has the trait rather than the one that lacks it
        if (abs(a - b), a > b) > (abs(best[1] - best[2]), best[1] > best[2]):
            best = (name, a, b)
    return best


def _evidence(metas: Sequence[PhotoMeta], y: np.ndarray, classes: Sequence[str]) -> dict[str, str]:
    """Feature group -> what differs between the classes, in words."""
    out: dict[str, str] = {}
    present = range(len(classes))
    width = np.array([m.width for m in metas])
    height = np.array([m.height for m in metas])
    sizes = [f"'{classes[c]}' {int(np.median(width[y == c]))}x{int(np.median(height[y == c]))}" for c in present]
    out["image size"] = "typical (median) size: " + ", ".join(sizes)
    ratio = width / np.maximum(height, 1)
    aspects = [f"'{classes[c]}' {np.median(ratio[y == c]):.2f}" for c in present]
    out["aspect ratio"] = "median width/height: " + ", ".join(aspects)
    fmts = np.array([m.format for m in metas])
    best = ("", "", 0.0, 0.0)
    uniq, counts = np.unique(fmts, return_counts=True)
    # rarest first, JPEG (the usual photo format) last, so that a tie names the odd format out
    for f in sorted(uniq, key=lambda f: (int(counts[list(uniq).index(f)]), f == "JPEG")):
        name, a, b = _share_gap(fmts == f, y, classes)
        if name and abs(a - b) > abs(best[2] - best[3]):
            best = (name, str(f), a, b)
    if best[0]:
        out["file format"] = (f"{100 * best[2]:.0f} % of the '{best[0]}' photos are {best[1]} against "
                              f"{100 * best[3]:.0f} % of the others")
    name, a, b = _share_gap(np.array([not m.ext_matches for m in metas]), y, classes)
    if name:
        out["format vs extension"] = (f"{100 * a:.0f} % of the '{name}' photos are saved in another format than "
                                      f"their extension says, against {100 * b:.0f} % of the others")
    name, a, b = _share_gap(np.array([m.exif for m in metas]), y, classes)
    if name:
        out["EXIF"] = f"{100 * a:.0f} % of the '{name}' photos carry EXIF against {100 * b:.0f} % of the others"
    for feature, values, what in (("camera", [m.camera or "no camera" for m in metas], "come from"),
                                  ("EXIF orientation", [f"orientation {m.orientation}" for m in metas], "have"),
                                  ("colour mode", [f"mode {m.mode}" for m in metas], "are stored in")):
        found = _value_gap(np.asarray(values), y, classes)
        if found is not None:
            name, value, a, b = found
            out[feature] = (f"{100 * a:.0f} % of the '{name}' photos {what} {value} against {100 * b:.0f} % of "
                            "the others")
    q = np.array([m.jpeg_q for m in metas], np.float64)
    if (q > 0).any():
        jpegs = [(c, q[(y == c) & (q > 0)]) for c in present]
        medians = [f"'{classes[c]}' {np.median(v):.0f}" for c, v in jpegs if len(v)]
        out["JPEG quality"] = "median JPEG quantisation step (lower is a higher quality): " + ", ".join(medians)
    return out


def _value_gap(values: np.ndarray, y: np.ndarray, classes: Sequence[str]) -> tuple[str, str, float, float] | None:
    """(class, value, its share of the class, of the others) for the value whose share differs most."""
    best: tuple[str, str, float, float] | None = None
    for v in np.unique(values):
        name, a, b = _share_gap(values == v, y, classes)
        # the largest gap; on a tie, the value the class has rather than the one it lacks
        if name and (best is None or (abs(a - b), a > b) > (abs(best[2] - best[3]), best[2] > best[3])):
            best = (name, str(v), a, b)
    return best


def check_shortcuts(metas: Sequence[PhotoMeta], labels: Sequence[int] | np.ndarray, classes: Sequence[str],
                    seed: int = 0) -> ShortcutResult | str:
    """Score the metadata of labelled photos against their classes; a string says why it could not run."""
    present, y = np.unique(np.asarray(labels, np.int64), return_inverse=True)
    y = y.astype(np.int64)
    names = [classes[int(c)] for c in present]  # classes without photos take no part
    if len(present) < 2:
        return "fewer than 2 classes with photos"
    if len(y) < MIN_PHOTOS:
        return f"only {len(y)} photos (the check needs {MIN_PHOTOS})"
    # Stratified folds: as many as the second smallest class allows, so every class but one is in each.
    per_class = np.sort(np.bincount(y))
    k = int(min(FOLDS, max(2, per_class[1])))
    n_classes = len(present)
    chance = 1.0 / n_classes
    sd = null_sd(np.bincount(y))
    warn_at = chance + max(MIN_MARGIN, NULL_SIGMAS * sd)
    cols = _feature_columns(metas)
    if warn_at >= 1.0:  # not even a perfect score could stand out from what chance gives so few photos ...
        separated = _exact_separation(cols, y, names)  # ... but a class no other shares a value with can
        if separated is None:
            return f"only {len(y)} photos in {n_classes} classes: too few to tell metadata from chance"
        feature, c = separated
        told = None if n_classes == 2 else names[c]  # one class told from the rest, or the two from each other
        return ShortcutResult(1.0, 0.5 if told else chance, 1.0, round(sd, 4), {feature: 1.0}, (feature,), 0,
                              _evidence(metas, y, names), told)
    x_all = np.concatenate(list(cols.values()), axis=1)
    x_all = x_all[:, x_all.max(axis=0) > 0]  # a feature with one value for every photo tells nothing
    # the same metadata on every photo cannot predict anything: no need to fit
    real = _cv_balanced_accuracy(x_all, y, n_classes, k, seed) if x_all.shape[1] else chance
    one_class, y_all = None, y
    if real < warn_at and n_classes > 2 and x_all.shape[1]:  # one class told from the rest (module docstring)
        stood_out = _one_against_the_rest(x_all, y, names, seed)
        if stood_out is not None:
            one_class, y, n_classes, k, real, chance, warn_at, sd = stood_out
    per_feature: dict[str, float] = {}
    flagged: tuple[str, ...] = ()
    if real >= warn_at:  # name the features that carry the signal, each scored alone
        per_feature = {name: _cv_balanced_accuracy(x, y, n_classes, k, seed) if x.max() > 0 else chance
                       for name, x in cols.items()}
        flagged = tuple(n for n in FEATURES if per_feature[n] >= warn_at)
        if not flagged:  # only the combination predicts: name the strongest ones
            flagged = tuple(sorted(FEATURES, key=lambda n: -per_feature[n])[:2])
    return ShortcutResult(round(real, 4), round(chance, 4), round(warn_at, 4), round(sd, 4),
                          {n: round(v, 4) for n, v in per_feature.items()}, flagged, k,
                          _evidence(metas, y_all, names) if flagged else {}, one_class)


# A separation rarer than this under random labels warns, counting one test per feature and class (Bonferroni).
EXACT_ALPHA = 1e-4


def _chance_of_separation(group_sizes: Sequence[int], n_c: int) -> float:
    """The chance that n_c photos drawn at random are a union of whole groups of equal feature values (so that no
    photo outside them shares a value with them): the number of sets of groups holding n_c photos in all, over
    C(n, n_c). Two groups of 12 photos: 2 in 2.7 million; photos that each have a size of their own: 1."""
    ways = [1] + [0] * n_c  # ways[s]: sets of groups seen so far holding s photos
    for g in group_sizes:
        for total in range(n_c, g - 1, -1):
            ways[total] += ways[total - g]
    return ways[n_c] / math.comb(sum(group_sizes), n_c)


def _exact_separation(cols: Mapping[str, np.ndarray], y: np.ndarray, names: Sequence[str]
                      ) -> tuple[str, int] | None:
    """For sets too small for the cross-validated rule: (feature, class) when some class's photos share no value
    of that feature with any other photo (every iPhone photo is 'healthy', every Samsung photo 'rust') and a
    random labelling would do that less often than ``EXACT_ALPHA`` allows; the rarest such, or None."""
    tests = len(cols) * len(names)
    best: tuple[float, str, int] | None = None
    for feature, x in cols.items():
        rows = [tuple(r) for r in x.tolist()]
        groups = list(Counter(rows).values())
        for c in range(len(names)):
            mine = {r for r, label in zip(rows, y) if label == c}
            if any(r in mine for r, label in zip(rows, y) if label != c):
                continue
            p = tests * _chance_of_separation(groups, int((y == c).sum()))
            if p < EXACT_ALPHA and (best is None or p < best[0]):
                best = (p, feature, c)
    return None if best is None else (best[1], best[2])


def _one_against_the_rest(x: np.ndarray, y: np.ndarray, names: Sequence[str], seed: int
                          ) -> tuple[str, np.ndarray, int, int, float, float, float, float] | None:
    """The class the metadata tells from all the others, scored as a two-label problem: (its name, the two
    labels (1: the class), 2, folds, balanced accuracy, chance 0.5, threshold, null_sd) for the class furthest
    above its threshold, or None when none reaches it."""
    best = None
    for c, name in enumerate(names):
        mine = y == c
        n_c, n_rest = int(mine.sum()), int((~mine).sum())
        if min(n_c, n_rest) < MIN_PER_SIDE:
            continue
        k = int(min(FOLDS, n_c, n_rest))
        sd = null_sd([n_rest, n_c])
        warn_at = 0.5 + max(MIN_MARGIN, NULL_SIGMAS * sd)
        score = _cv_balanced_accuracy(x, mine.astype(np.int64), 2, k, seed)
        if score >= warn_at and (best is None or score - warn_at > best[4] - best[6]):
            best = (name, mine.astype(np.int64), 2, k, score, 0.5, warn_at, sd)
    return best
