"""The out-of-domain threshold: at most ``budget`` of genuine new photos flagged, with ``confidence``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from leaflens.apps import model_info
from leaflens.apps.model_card import ModelCard, OODCheck, flag_confidence
from leaflens.data_prep.contract import PreprocessContract
from leaflens.pipeline import ood


def test_flag_confidence_is_the_binomial_tail() -> None:
    # P(Binomial(n, p) > k), written out for small n
    n, p = 20, 0.1
    for k in range(4):
        below = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
        assert flag_confidence(n, k, p) == pytest.approx(1 - below, abs=1e-12)
    assert flag_confidence(133, 0, 0.03) == pytest.approx(1 - 0.97 ** 133)
    assert flag_confidence(0, 0, 0.03) == 0.0


def test_flags_allowed_is_the_largest_count_that_keeps_the_confidence() -> None:
    for n in (10, 75, 76, 133, 500, 5000):
        k = ood.flags_allowed(n, 0.03, 0.9)
        if k > 0:
            assert flag_confidence(n, k, 0.03) >= 0.9
        assert k == 0 or flag_confidence(n, k + 1, 0.03) < 0.9
    assert ood.flags_allowed(75, 0.03, 0.9) == 0 and ood.flags_allowed(133, 0.03, 0.9) == 1
    need = ood.photos_for_confidence(0.03, 0.9)
    assert need == 76 and flag_confidence(need, 0, 0.03) >= 0.9 > flag_confidence(need - 1, 0, 0.03)
    # many photos: close to the budget's share, always under it
    assert 0.02 < ood.flags_allowed(5000, 0.03, 0.9) / 5000 < 0.03


def test_threshold_sits_between_the_scores_it_separates() -> None:
    scores = np.arange(133, dtype=np.float64)  # one allowed above: between 131 and 132
    assert ood.threshold_for(scores, 0.03, 0.9) == pytest.approx(131.5)
    small = np.arange(40, dtype=np.float64)  # too few photos for 0.9: a hair above all of them
    t = ood.threshold_for(small, 0.03, 0.9)
    assert 39.0 < t < 39.01


def test_new_photos_flagged_stay_within_the_budget_with_the_confidence() -> None:
    """Draw validation and new in-domain scores from one heavy-tailed distribution many times: the share of
    new photos above the threshold exceeds the budget in at most 1 - confidence of the draws (plus Monte
    Carlo slack), where the old rule (the budget's share of validation photos let through) exceeds it about
    half the time."""
    rng = np.random.default_rng(0)
    budget, confidence, n, trials = 0.03, 0.9, 133, 2000
    over_new, over_old = 0, 0
    for _ in range(trials):
        val = rng.standard_t(3, n)
        t_new = ood.threshold_for(val, budget, confidence)
        s = np.sort(val)
        t_old = s[n - 1 - int(np.floor(budget * n))]
        # the exact share of the t(3) distribution above each threshold, not a second sample
        over_new += _t3_tail(t_new) > budget
        over_old += _t3_tail(t_old) > budget
    assert over_new / trials <= 1 - confidence + 0.02
    assert over_old / trials > 0.35


def _t3_tail(x: float) -> float:
    """P(T > x) for Student's t with 3 degrees of freedom (closed form)."""
    th = math.atan(x / math.sqrt(3))
    return 0.5 - (th + math.sin(th) * math.cos(th)) / math.pi


def _check(confidence: float | None, flagged: float = 1 / 133) -> OODCheck:
    return OODCheck(method=ood.METHOD, threshold=21.7, budget=0.03, val_photos=133, val_flagged=flagged,
                    train_photos=1034, blocks=8, confidence=confidence)


def test_fit_records_the_confidence_and_cards_without_it_still_read() -> None:
    rng = np.random.default_rng(1)
    train = [rng.normal(size=(200, 6))]
    val = [rng.normal(size=(133, 6))]
    _, check, scores = ood.fit_ood_head(train, rng.integers(0, 3, 200), val, 3)
    assert check.budget == ood.DEFAULT_BUDGET
    assert np.sum(scores > check.threshold) == ood.flags_allowed(133, check.budget, ood.DEFAULT_CONFIDENCE) == 1
    # the record holds the confidence the threshold has (the Model tab's figure), at least the 0.9 asked
    assert check.confidence == check.achieved_confidence == pytest.approx(flag_confidence(133, 1, 0.03))
    assert check.achieved_confidence >= ood.DEFAULT_CONFIDENCE
    contract = PreprocessContract(stored_size=64, input_size=64, mean=(0.5,) * 3, std=(0.25,) * 3)
    meta = ModelCard(classes=("a", "b", "c"), contract=contract, ood=check).to_metadata()
    assert ModelCard.from_metadata(meta, "m.onnx").ood == check
    old = ModelCard(classes=("a", "b", "c"), contract=contract, ood=_check(None)).to_metadata()
    assert "confidence" not in old["leaflens.ood"]
    assert ModelCard.from_metadata(old, "m.onnx").ood.confidence is None
    with pytest.raises(ValueError, match="confidence"):
        _check(1.0)


def test_too_few_validation_photos_record_the_confidence_that_holds() -> None:
    """30 validation photos cannot back a 3 % budget with 90 % confidence (76 can): the file said 0.9 all the same,
    while the console and the Model tab said 60 %; a Triton client reads the file."""
    rng = np.random.default_rng(2)
    _, check, scores = ood.fit_ood_head([rng.normal(size=(200, 6))], rng.integers(0, 3, 200),
                                        [rng.normal(size=(30, 6))], 3)
    assert not np.any(scores > check.threshold)  # above every validation photo: the most a threshold can do
    assert check.confidence == pytest.approx(1 - 0.97 ** 30) == pytest.approx(check.achieved_confidence)


def test_the_model_tab_says_what_the_threshold_promises() -> None:
    contract = PreprocessContract(stored_size=64, input_size=64, mean=(0.5,) * 3, std=(0.25,) * 3)
    new = model_info._ood_line(ModelCard(classes=("a", "b"), contract=contract, ood=_check(0.9)), "en")
    assert "at most 3.0% of genuine new photos" in new and "91.1% confidence" in new and "0.8%" in new
    old = model_info._ood_line(ModelCard(classes=("a", "b"), contract=contract, ood=_check(None)), "en")
    assert "to flag at most 3.0% of them" in old and "confidence" not in old
    zh = model_info._ood_line(ModelCard(classes=("a", "b"), contract=contract, ood=_check(0.9)), "zh")
    assert "置信度 91.1%" in zh
