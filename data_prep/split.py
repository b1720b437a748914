"""Train/val/test assignment: stratified, seeded, and duplicate-aware.

Items with the same key never end up in two different splits: with automatic splitting a group is
placed as one unit; with a given split the copies in a later split (train < val < test) are dropped
and reported, so the official split is otherwise kept. The ingest's keys: for the automatic split, its
group of exact or near copies (:mod:`leaflens.data_prep.near_dup`); for a given split, the file's
SHA-256 and class (a copy under another class is a label conflict, reported rather than dropped).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

SPLIT_ORDER = ("train", "val", "test")
# A class with this many photos gets at least one in each split the ratios give a share.
MIN_PER_CLASS = 3


def parse_ratios(text: str) -> tuple[float, float, float]:
    """'70/15/15' (percentages) or '0.7,0.15,0.15' (fractions) -> fractions summing to 1.

    Shares that add up to neither 100 nor 1 are refused rather than rescaled: '70/20/20' is a typo
    more often than a wish for 63.6/18.2/18.2.
    """
    parts = [p.strip() for p in text.replace("/", ",").replace(":", ",").split(",") if p.strip()]
    if len(parts) != 3:
        raise ValueError(f"--split needs three shares train/val/test, e.g. 70/15/15; got {text!r}")
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split needs three numbers train/val/test, e.g. 70/15/15; got {text!r}") from None
    if not all(math.isfinite(v) and v >= 0 for v in vals) or vals[0] <= 0:
        raise ValueError(f"--split shares must be 0 or more, with train above 0; got {text!r}")
    total = sum(vals)
    if not (math.isclose(total, 100, abs_tol=1) or math.isclose(total, 1, abs_tol=0.01)):
        raise ValueError(f"--split shares must add up to 100 (percentages) or 1 (fractions); {text!r} adds up to "
                         f"{total:g}")
    return (vals[0] / total, vals[1] / total, vals[2] / total)


def assign_auto(labels: Sequence[int], hashes: Sequence[Hashable], ratios: tuple[float, float, float],
                seed: int) -> list[str]:
    """Split per class with a seeded shuffle of duplicate groups; returns one split name per item.

    A class of ``MIN_PER_CLASS`` photos or more gets at least one validation and one test photo (when
    their ratios are not 0 and its groups allow it) and always keeps one for training; a smaller class
    stays in train. A group goes to test or val only while that brings the split nearer its share, so
    one large group of look-alike photos cannot take a whole class out of training: it stays in train.
    """
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, h in enumerate(hashes):
        groups[h].append(i)
    units_by_class: dict[int, list[list[int]]] = defaultdict(list)
    for members in groups.values():  # insertion order = item order, so deterministic
        units_by_class[int(labels[members[0]])].append(members)
    out = [""] * len(labels)
    for cls in sorted(units_by_class):
        units = units_by_class[cls]
        n = sum(len(u) for u in units)
        n_test = int(round(n * ratios[2]))
        n_val = int(round(n * ratios[1]))
        if n >= MIN_PER_CLASS:  # every class can then be chosen on and reported, however small
            n_test = max(n_test, 1 if ratios[2] > 0 else 0)
            n_val = max(n_val, 1 if ratios[1] > 0 else 0)
        while n_test + n_val >= n and (n_test or n_val):  # keep at least one training image
            if n_test >= n_val and n_test:
                n_test -= 1
            else:
                n_val -= 1
        rng = np.random.default_rng([seed, cls])
        order = rng.permutation(len(units))
        want = {"test": n_test, "val": n_val}
        got = {"test": 0, "val": 0, "train": 0}
        left = n
        for k in order:
            unit = units[k]
            left -= len(unit)
            split = "train"
            if left > 0 or got["train"] > 0:  # the last group goes to train if train has none yet
                # nearer its share with the group than without: a single photo or a pair always is
                split = next((s for s in ("test", "val") if got[s] < want[s] and len(unit) <= 2 * (want[s] - got[s])),
                             "train")
            got[split] += len(unit)
            for i in unit:
                out[i] = split
    return out


def resolve_given(splits: Sequence[str], hashes: Sequence[Hashable]) -> list[int]:
    """Indices to drop so no duplicate group spans two given splits (the earliest split keeps it)."""
    first: dict[Hashable, str] = {}
    for s, h in zip(splits, hashes):
        if h not in first or SPLIT_ORDER.index(s) < SPLIT_ORDER.index(first[h]):
            first[h] = s
    return [i for i, (s, h) in enumerate(zip(splits, hashes)) if s != first[h]]
