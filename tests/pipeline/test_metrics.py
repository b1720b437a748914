"""pipeline.report.metrics against hand-computed cases, published Wilson intervals and brute-force re-derivations."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leaflens.pipeline.report import metrics


def probs_from(conf: list[float], correct: list[bool], y: list[int], num_classes: int = 3) -> np.ndarray:
    """Probability rows whose top class has probability ``conf[i]`` and is ``y[i]`` iff ``correct[i]``."""
    rows = []
    for c, ok, label in zip(conf, correct, y):
        assert c > 1 / num_classes
        row = np.full(num_classes, (1 - c) / (num_classes - 1))
        row[label if ok else (label + 1) % num_classes] = c
        rows.append(row)
    return np.array(rows)


# ---- confusion matrix and per-class scores ------------------------------------------------------------
def test_confusion_matrix_hand_case_rows_are_true_classes() -> None:
    cm = metrics.confusion_matrix([0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 0, 1], 3)
    assert cm.dtype == np.int64
    np.testing.assert_array_equal(cm, [[1, 1, 0], [0, 2, 0], [1, 1, 0]])


def test_per_class_prf_with_a_class_never_predicted_and_one_never_present() -> None:
    cm = metrics.confusion_matrix([0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 0, 1], 4)
    prf = metrics.per_class_prf(cm)
    assert prf[0] == pytest.approx({"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2,
                                    "predicted": 2})
    assert prf[1] == pytest.approx({"precision": 0.5, "recall": 1.0, "f1": 2 / 3, "support": 2,
                                    "predicted": 4})
    # class 2 is never predicted: precision undefined -> 0, recall 0 of 2
    assert prf[2] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 2, "predicted": 0}
    # class 3 never occurs and is never predicted: everything 0, no NaN
    assert prf[3] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0, "predicted": 0}


def test_confusion_matrix_rejects_bad_labels() -> None:
    with pytest.raises(ValueError, match="y_pred holds class indices outside"):
        metrics.confusion_matrix([0, 1], [0, 3], 3)
    with pytest.raises(ValueError, match="y_true has 2 labels but y_pred has 3"):
        metrics.confusion_matrix([0, 1], [0, 1, 1], 3)
    with pytest.raises(ValueError, match="integer class indices"):
        metrics.confusion_matrix([0.5, 1], [0, 1], 3)
    with pytest.raises(ValueError, match="square"):
        metrics.per_class_prf(np.zeros((2, 3)))


# ---- Wilson interval -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("correct", "total", "lo", "hi"),
    [  # published 95 % Wilson score intervals (e.g. Newcombe 1998, Table I; Brown, Cai & DasGupta 2001)
        (8, 10, 0.4902, 0.9433),
        (0, 10, 0.0, 0.2775),
        (10, 10, 0.7225, 1.0),
        (50, 100, 0.4038, 0.5962),
        (81, 263, 0.2553, 0.3662),
    ],
)
def test_wilson_interval_known_values(correct: int, total: int, lo: float, hi: float) -> None:
    acc, got_lo, got_hi = metrics.accuracy_ci(correct, total)
    assert acc == correct / total
    assert got_lo == pytest.approx(lo, abs=6e-5)
    assert got_hi == pytest.approx(hi, abs=6e-5)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))),
       st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_wilson_end_points_solve_the_score_equation(case: tuple[int, int], level: float) -> None:
    """Each interior end point pi satisfies |p - pi| = z * sqrt(pi (1 - pi) / n), the Wilson definition."""
    correct, n = case
    p, lo, hi = metrics.accuracy_ci(correct, n, level)
    assert 0 <= lo <= p <= hi <= 1
    z = {0.8: 1.2815516, 0.9: 1.6448536, 0.95: 1.9599640, 0.99: 2.5758293}[level]
    for end in (lo, hi):
        if 0 < end < 1:
            assert abs(p - end) == pytest.approx(z * math.sqrt(end * (1 - end) / n), rel=1e-6, abs=1e-12)


def test_wilson_interval_narrows_with_more_images_and_rejects_nonsense() -> None:
    widths = [metrics.accuracy_ci(int(0.9 * n), n)[2] - metrics.accuracy_ci(int(0.9 * n), n)[1]
              for n in (10, 100, 1000)]
    assert widths[0] > widths[1] > widths[2]
    with pytest.raises(ValueError, match="at least one evaluated image"):
        metrics.accuracy_ci(0, 0)
    with pytest.raises(ValueError, match="correct must be in"):
        metrics.accuracy_ci(11, 10)


# ---- calibration ---------------------------------------------------------------------------------------
def test_ece_hand_case_one_prediction_per_bin() -> None:
    probs = np.array([[0.93, 0.07], [0.62, 0.38], [0.85, 0.15], [0.26, 0.74]])
    y = np.array([0, 1, 0, 1])  # the second prediction (0.62 for class 0) is wrong
    ece = metrics.expected_calibration_error(probs, y, bins=10)
    assert ece == pytest.approx((0.07 + 0.62 + 0.15 + 0.26) / 4)


def test_ece_hand_case_shared_bin_averages_before_the_gap() -> None:
    probs = np.array([[0.93, 0.07], [0.62, 0.38], [0.85, 0.15], [0.26, 0.74]])
    y = np.array([0, 1, 0, 1])
    # two bins: all four confidences fall in [0.5, 1): |3/4 - mean(0.93, 0.62, 0.85, 0.74)|
    assert metrics.expected_calibration_error(probs, y, bins=2) == pytest.approx(abs(0.75 - 3.14 / 4))
    table = metrics.calibration_bins(probs, y, bins=2)
    assert [b["count"] for b in table] == [0, 4]


def test_ece_is_zero_for_a_perfectly_calibrated_model_and_rejects_logits() -> None:
    # 10 predictions at confidence 0.8, 8 of them right
    probs = np.tile([0.8, 0.2], (10, 1))
    y = np.array([0] * 8 + [1] * 2)
    assert metrics.expected_calibration_error(probs, y) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="apply softmax"):
        metrics.expected_calibration_error(np.array([[2.0, -1.0]]), [0])


# ---- uncertain threshold -------------------------------------------------------------------------------
def _val_set() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """40 validation predictions: the 30 most confident are right, the 10 least alternate wrong/right."""
    conf = list(np.linspace(0.99, 0.70, 30)) + list(np.linspace(0.65, 0.40, 10))
    correct = [True] * 30 + [i % 2 == 1 for i in range(10)]
    y = [i % 3 for i in range(40)]
    probs = probs_from(conf, correct, y)
    return probs, np.array(y), np.array(conf)


def test_threshold_keeps_the_largest_set_reaching_the_target() -> None:
    probs, y, conf = _val_set()
    out = metrics.choose_uncertain_threshold(probs, y, target_precision=0.95, max_flagged=None)
    # by hand: keeping 31 gives 30/31, 32 gives 31/32 = 0.969, 33 gives 31/33 = 0.939 < 0.95
    assert out["method"] == "target" and out["reached"]
    assert out["kept"] == 32 and out["coverage"] == pytest.approx(32 / 40)
    assert out["accuracy"] == pytest.approx(31 / 32)
    assert conf[32] < out["threshold"] <= conf[31]
    # the threshold sits midway in the gap between the last kept and the first flagged confidence
    assert out["threshold"] == pytest.approx((conf[31] + conf[32]) / 2)
    json.dumps(out)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.5, 1.0))
def test_threshold_matches_brute_force_over_all_cuts(seed: int, target: float) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 80))
    conf = np.round(rng.uniform(0.34, 1.0, n), 2)  # rounded: ties happen
    correct = rng.random(n) < conf  # roughly calibrated
    y = rng.integers(0, 3, n)
    probs = probs_from(list(conf), list(correct), list(y))
    out = metrics.choose_uncertain_threshold(probs, y, target_precision=target, min_kept=10, max_flagged=None)
    # brute force: every distinct confidence as a cut, kept = conf >= cut
    top = probs.max(axis=1)
    ok = probs.argmax(axis=1) == y
    cuts = [(t, ok[top >= t].mean(), int((top >= t).sum())) for t in np.unique(top)]
    cuts = [c for c in cuts if c[2] >= 10]
    meeting = [c for c in cuts if c[1] >= target - 1e-12]
    if meeting:
        expect = max(meeting, key=lambda c: c[2])
        assert out["reached"]
    else:
        best = max(c[1] for c in cuts)
        expect = max((c for c in cuts if c[1] >= best - 1e-12), key=lambda c: c[2])
        assert not out["reached"] and out["method"] == "best_effort"
    assert out["kept"] == expect[2]
    assert out["accuracy"] == pytest.approx(expect[1])
    np.testing.assert_array_equal(top >= out["threshold"], top >= expect[0])


def test_higher_target_never_lowers_the_threshold() -> None:
    probs, y, _ = _val_set()
    results = [metrics.choose_uncertain_threshold(probs, y, target_precision=t, max_flagged=None)
               for t in (0.8, 0.9, 0.95, 1.0)]
    thresholds = [r["threshold"] for r in results]
    coverages = [r["coverage"] for r in results]
    assert thresholds == sorted(thresholds)
    assert coverages == sorted(coverages, reverse=True)
    assert results[-1]["kept"] == 30 and results[-1]["accuracy"] == 1.0


def test_the_budget_rule_flags_the_least_confident_share() -> None:
    probs, y, conf = _val_set()  # sorted by confidence, most confident first
    out = metrics.choose_uncertain_threshold(probs, y, target_precision=0.95, max_flagged=0.05)
    assert out["method"] == "budget" and out["kept"] == 38 and out["max_flagged"] == 0.05  # 2 of 40 flagged
    assert out["threshold"] == pytest.approx((conf[37] + conf[38]) / 2)
    assert out["accuracy"] == pytest.approx(34 / 38) and not out["reached"]
    # a budget below one photo still flags the least confident one (else a small validation split would
    # never give "ambiguous"); a budget of 0 flags none: the threshold sits under the least confident prediction
    one = metrics.choose_uncertain_threshold(probs, y, max_flagged=0.01)
    assert one["kept"] == 39 and one["threshold"] == pytest.approx((conf[38] + conf[39]) / 2)
    none = metrics.choose_uncertain_threshold(probs, y, max_flagged=0.0)
    assert none["kept"] == 40 and 1 / 3 < none["threshold"] <= conf[-1]
    # ties are flagged or kept together, never beyond the budget
    tied = probs_from([0.9] * 20 + [0.6] * 20, [True] * 40, [i % 3 for i in range(40)])
    assert metrics.choose_uncertain_threshold(tied, [i % 3 for i in range(40)], max_flagged=0.1)["kept"] == 40
    # the default budget is the module's AMBIGUOUS_BUDGET
    default = metrics.choose_uncertain_threshold(probs, y)
    assert default["max_flagged"] == metrics.AMBIGUOUS_BUDGET
    assert default["n_val"] - default["kept"] == max(1, np.floor(metrics.AMBIGUOUS_BUDGET * 40))
    with pytest.raises(ValueError, match="max_flagged"):
        metrics.choose_uncertain_threshold(probs, y, max_flagged=1.0)


def test_threshold_when_everything_is_right_keeps_all_and_when_nothing_is_unreachable() -> None:
    conf = list(np.linspace(0.95, 0.6, 25))
    y = [i % 3 for i in range(25)]
    all_right = metrics.choose_uncertain_threshold(probs_from(conf, [True] * 25, y), y, max_flagged=None)
    assert all_right["coverage"] == 1.0 and all_right["reached"]
    # between the lowest possible top probability (1/3) and the least confident prediction
    assert 1 / 3 < all_right["threshold"] <= 0.6
    all_wrong = metrics.choose_uncertain_threshold(probs_from(conf, [False] * 25, y), y, max_flagged=None)
    assert all_wrong["method"] == "best_effort" and not all_wrong["reached"] and all_wrong["accuracy"] == 0.0


def test_a_tiny_validation_split_still_flags_only_its_least_confident_photo() -> None:
    """Under 20 validation photos the threshold was a fixed 0.5: a weak model with 8 classes (top probabilities
    0.2-0.4) was "unsure" of all 16 of its validation photos, and of every photo in the app. The budget rule
    flags the least confident one whatever their number; the target rule still needs 20."""
    y = [0, 1, 2, 0, 1]
    out = metrics.choose_uncertain_threshold(probs_from([0.9, 0.8, 0.7, 0.6, 0.45], [True] * 5, y), y)
    assert out["method"] == "budget" and out["n_val"] == 5 and out["kept"] == 4  # 0.45 flagged, the rest kept
    assert 0.45 < out["threshold"] <= 0.6
    weak = metrics.choose_uncertain_threshold(probs_from([0.48, 0.45, 0.42, 0.4, 0.36], [True] * 5, y), y)
    assert weak["kept"] == 4 and weak["threshold"] < 0.4  # was 0.5: all five unsure
    target = metrics.choose_uncertain_threshold(probs_from([0.9, 0.8, 0.7, 0.6, 0.45], [True] * 5, y), y,
                                                max_flagged=None)
    assert target["method"] == "default" and target["threshold"] == metrics.DEFAULT_UNCERTAIN_THRESHOLD
    empty = metrics.choose_uncertain_threshold(np.zeros((0, 3)), np.zeros(0, np.int64))
    assert empty["method"] == "default"


# ---- hardest mistakes and the summary -------------------------------------------------------------------
def test_hardest_misclassified_most_confident_mistakes_first() -> None:
    probs = probs_from([0.9, 0.6, 0.95, 0.7, 0.8], [True, False, True, False, False], [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(metrics.hardest_misclassified(probs, [0, 1, 2, 0, 1], k=2), [4, 3])
    assert metrics.hardest_misclassified(probs, [0, 1, 2, 0, 1]).tolist() == [4, 3, 1]


def test_evaluation_summary_is_consistent_and_json_ready() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 200)
    logits = rng.normal(size=(200, 4))
    logits[np.arange(200), y] += 2.0
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    classes = ["healthy", "rust", "spot", "mildew"]
    s = metrics.evaluation_summary(probs, y, classes)
    text = json.dumps(s)  # plain JSON types only
    assert "NaN" not in text
    pred = probs.argmax(axis=1)
    assert s["accuracy"] == pytest.approx((pred == y).mean()) and s["n"] == 200
    assert s["accuracy_ci"][0] < s["accuracy"] < s["accuracy_ci"][1]
    cm = np.array(s["confusion_matrix"])
    assert cm.sum() == 200 and np.trace(cm) == s["correct"]
    assert [c["class"] for c in s["per_class"]] == classes
    assert s["macro_f1"] == pytest.approx(np.mean([c["f1"] for c in s["per_class"]]))
    assert 0 <= s["ece"] <= 1
    with pytest.raises(ValueError, match="4 columns but 3 class names"):
        metrics.evaluation_summary(probs, y, classes[:3])
    with pytest.raises(ValueError, match="200 rows but y_true has 199"):
        metrics.evaluation_summary(probs, y[:199], classes)


def test_the_threshold_choice_says_what_the_served_rule_answers_near_ties_included() -> None:
    """report.md said the threshold "keeps 98.9 % of the images" while the page, which also calls near ties
    ambiguous, answered 91.7 % of them: the choice now records both."""
    probs = np.array([[0.9, 0.05, 0.05], [0.5, 0.46, 0.04], [0.8, 0.1, 0.1], [0.2, 0.75, 0.05]])
    y = np.array([0, 1, 0, 1])
    out = metrics.choose_uncertain_threshold(probs, y, target_precision=0.5, min_samples=1, min_kept=1,
                                             max_flagged=None)
    assert out["coverage"] == 1.0  # the threshold alone keeps every photo
    assert out["answered"] == pytest.approx(3 / 4) and out["answered_accuracy"] == 1.0  # 0.46 / 0.5: a near tie
