"""The centre crop a student keeps: which crops are tried, the sign test, and the rule that asks a crop to beat
the whole photo by more than chance (leaflens.pipeline.centre_crop)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from leaflens.pipeline.centre_crop import (
    SIGNIFICANCE,
    CropChoice,
    choose_crop,
    crop_shares,
    sign_test_p,
    untried_reason,
)


def test_crops_are_tried_whole_first_then_larger_first_and_never_blown_up():
    assert crop_shares([0.75, 0.875, 0.9375, 0.875], 128, 64) == [None, 0.9375, 0.875, 0.75]
    assert crop_shares([0.75, 0.5, 0.4], 128, 64) == [None, 0.75, 0.5]  # 0.4 keeps 51 px < 64
    assert crop_shares([0.9], 64, 64) == [None]  # a student at the stored size has nothing to crop
    assert crop_shares([], 128, 64) == [None]


def test_the_sign_test_is_the_binomial_tail():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(1, 0) == 0.5 and sign_test_p(0, 1) == 1.0
    assert sign_test_p(3, 2) == pytest.approx(sum(math.comb(5, k) for k in range(3, 6)) / 32)  # 0.5
    assert sign_test_p(21, 6) == pytest.approx(0.002963, abs=1e-6)
    assert sign_test_p(10, 0) == pytest.approx(1 / 1024)


def _correct(n: int, whole_right: set[int], **crops: set[int]) -> dict:
    def mask(right: set[int]) -> np.ndarray:
        m = np.zeros(n, bool)
        m[list(right)] = True
        return m

    out = {None: mask(whole_right)}
    out.update({float(k.replace("c", "0.")): mask(v) for k, v in crops.items()})
    return out


def test_a_crop_that_gains_a_photo_or_two_is_chance_and_the_whole_photo_stays():
    base = set(range(120))  # 120 of 133 right on the whole photo
    correct = _correct(133, base, c9375=base | {120}, c875=(base - {0, 1}) | {120, 121, 122}, c75=base)
    choice = choose_crop(correct)
    assert choice.share is None and choice.best == 0.9375  # best: 121 right, the first tried of the ties
    assert (choice.gained, choice.lost) == (1, 0) and choice.p_value == 0.5
    assert choice.level == pytest.approx(SIGNIFICANCE / 3)
    assert "gained 1 validation photo and lost 0" in choice.why and "within chance" in choice.why


def test_a_crop_right_on_many_more_photos_replaces_the_whole_photo():
    whole = set(range(100))
    crop = (whole - set(range(6))) | set(range(100, 121))  # +21, -6: the demo scratch student's 0.75
    choice = choose_crop(_correct(181, whole, c9375=whole, c75=crop))
    assert choice == CropChoice(0.75, 0.75, 21, 6, sign_test_p(21, 6), SIGNIFICANCE / 2, choice.why)
    assert choice.why.startswith("the centre 0.75 gained 21 validation photos and lost 6")


def test_no_crop_better_than_the_whole_photo_or_none_tried():
    whole = set(range(50))
    worse = choose_crop(_correct(60, whole, c875=whole - {3}))
    assert worse.share is None and "no centre crop is right on more" in worse.why
    alone = choose_crop(_correct(60, whole))
    assert alone.share is None and alone.best is None and alone.why == "no centre crop was tried"
    # distill says why none was: photos stored at the input size leave no crop with enough pixels
    assert crop_shares((0.9375, 0.75), 64, 64) == [None]
    assert "stored at 64 px" in untried_reason((0.9375, 0.75), 64, 64) and "--size 128" in \
        untried_reason((0.9375, 0.75), 64, 64)
    assert untried_reason((), 128, 64) == "no centre crop was tried (distill.centre_crops is empty)"
    assert CropChoice.from_dict(worse.to_dict()) == worse
