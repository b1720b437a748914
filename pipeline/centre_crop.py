"""Which centre crop of its photos a trained student is judged and served on, chosen on validation.

Students train on random crops of half to all of a photo's area, so an object looks larger to them in
training than in a whole frame ("FixRes", Touvron et al. 2019); scoring them on the centre of each photo can
undo that. Distill scores each student on the validation photos whole and at each share of
``[distill] centre_crops`` (leaflens.data_prep.contract.centre_crop), and a crop replaces the whole photo
only when it is right on significantly more validation photos:

- the candidate is the crop with the best validation accuracy (ties: the larger share, the smaller change);
- it is kept when the photos it gets right and the whole photo gets wrong outnumber the reverse beyond
  chance: the exact one-sided sign test on those discordant photos (McNemar's test), at
  :data:`SIGNIFICANCE` shared by the crops tried (Bonferroni), since the best of several crops on a few
  hundred photos beats the whole photo by a photo or two by chance alone.

Why the test: choosing the best crop alone (the first version) picked a crop for three of the four iBeans
students of two seeds, each gaining 1 to 3 of 133 validation photos and losing 0 to 2 (sign-test p 0.5), and
the kept student's test accuracy fell by 2 and 4 photos; the scratch demo student's 0.75 crop gained 21
validation photos and lost 6 (p = 0.003). The 5 % level is the usual one, not tuned on any of these.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from leaflens.data_prep.contract import crop_side
from leaflens.records import Record

__all__ = ["SIGNIFICANCE", "CropChoice", "choose_crop", "crop_shares", "sign_test_p"]

SIGNIFICANCE = 0.05  # family-wise, over the crops tried


def crop_shares(centre_crops: Iterable[float], stored: int, input_size: int) -> list[float | None]:
    """The centre crops a student is scored at, the whole photo (None) first, then the larger shares first (the
    order ties are broken in); shares that would keep fewer pixels than the input size are left out."""
    shares = sorted({float(c) for c in centre_crops if crop_side(stored, c) >= input_size}, reverse=True)
    return [None, *shares]


def sign_test_p(gained: int, lost: int) -> float:
    """One-sided exact sign test: the chance of ``gained`` or more of ``gained + lost`` discordant photos going
    the crop's way if either way were equally likely (1.0 with no discordant photo)."""
    n = gained + lost
    if n == 0:
        return 1.0
    return float(sum(math.comb(n, k) for k in range(gained, n + 1)) / 2 ** n)


@dataclass(frozen=True)
class CropChoice(Record):
    """The crop a student keeps (``share``; None: the whole photo) and why: the best crop on validation
    (``best``; None when none was tried), the validation photos it got right that the whole photo got wrong
    (``gained``) and the reverse (``lost``), the sign test's ``p_value`` and the level it had to be under."""

    share: float | None
    best: float | None
    gained: int
    lost: int
    p_value: float
    level: float
    why: str


def untried_reason(centre_crops: Iterable[float], stored: int, input_size: int) -> str:
    """Why :func:`crop_shares` gives no crop to try: none asked, or the photos are stored too small for any."""
    if not list(centre_crops):
        return "no centre crop was tried (distill.centre_crops is empty)"
    return (f"no centre crop was tried: the photos are stored at {stored} px, so every crop asked would keep fewer "
            f"pixels than the {input_size} px input (preprocess --size {2 * input_size} stores them large enough)")


def choose_crop(correct: Mapping[float | None, np.ndarray], untried: str = "no centre crop was tried") -> CropChoice:
    """Choose among ``correct`` (crop -> per-photo right/wrong on validation, in :func:`crop_shares`' order,
    the whole photo under None) by the rule of the module docstring; ``untried``: why, when only the whole
    photo was scored (:func:`untried_reason`)."""
    whole = np.asarray(correct[None], bool)
    crops = [c for c in correct if c is not None]
    if not crops:
        return CropChoice(None, None, 0, 0, 1.0, SIGNIFICANCE, untried)
    accuracy = {c: float(np.mean(correct[c])) for c in crops}
    best = next(c for c in crops if accuracy[c] == max(accuracy.values()))
    right = np.asarray(correct[best], bool)
    gained, lost = int(np.sum(right & ~whole)), int(np.sum(~right & whole))
    p, level = sign_test_p(gained, lost), SIGNIFICANCE / len(crops)
    if gained <= lost:
        why = f"no centre crop is right on more validation photos than the whole photo (best: {best:g})"
        return CropChoice(None, best, gained, lost, p, level, why)
    tally = f"the centre {best:g} gained {gained} validation photo{'' if gained == 1 else 's'} and lost {lost}"
    if p >= level:
        return CropChoice(None, best, gained, lost, p, level, f"{tally}: p = {p:.3f}, not under {level:.4g}, "
                                                              "within chance")
    why = f"{tally}: p = {p:.3g} < {level:.4g}"
    return CropChoice(best, best, gained, lost, p, level, why)

