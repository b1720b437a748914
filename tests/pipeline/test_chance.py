"""A kept model no better than guessing is said to be so (leaflens.pipeline.chance)."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.pipeline.chance import chance_warning, guessing_tail


@pytest.mark.parametrize("correct, n, p", [(6, 9, 1 / 3), (5, 9, 1 / 3), (40, 60, 0.5), (95, 100, 0.9)])
def test_the_binomial_tail_agrees_with_drawing_guesses(correct, n, p):
    draws = np.random.default_rng(0).binomial(n, p, 400_000)
    assert guessing_tail(correct, n, p) == pytest.approx(float(np.mean(draws >= correct)), abs=0.003)


def test_the_tail_at_its_ends():
    assert guessing_tail(0, 9, 0.3) == 1.0 and guessing_tail(10, 9, 0.3) == 0.0
    assert guessing_tail(9, 9, 0.5) == pytest.approx(0.5 ** 9)


def test_a_model_at_the_majority_rate_is_warned_about_and_a_learnt_one_is_not():
    balanced = np.repeat([0, 1, 2], 3)  # 9 validation photos
    said = chance_warning(3 / 9, balanced)
    assert said is not None and "right on 3 of 9 validation photos (33 %)" in said and "(33 %)" in said
    assert "train longer" in said
    assert chance_warning(5 / 9, balanced) is not None  # 14 % of guessers do as well: not told apart
    assert chance_warning(6 / 9, balanced) is None      # 4 %: told apart
    skewed = np.array([0] * 90 + [1] * 10)  # always "0" is right 90 % of the time
    assert "most common class (right on 90 % of them)" in chance_warning(0.9, skewed)
    assert chance_warning(0.97, skewed) is None
    assert chance_warning(0.5, np.array([], int)) is None
