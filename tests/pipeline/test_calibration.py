"""Temperature scaling (pipeline/calibration.py): fitted on validation, folded into the classifier."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import Tensor, no_grad
from leaflens.pipeline import calibration
from leaflens.pipeline.models.student import StudentCNN
from leaflens.pipeline.report import metrics


def _drawn(n: int, k: int, scale: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Labels drawn from softmax(z), returned with the logits ``scale * z``: a model ``scale`` times too sure
    of itself (above 1) or not sure enough (below 1)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 2.0, (n, k))
    p = metrics.softmax(z)
    labels = np.array([rng.choice(k, p=row) for row in p])
    return scale * z, labels


@pytest.mark.parametrize("scale", [0.4, 1.0, 3.0])
def test_the_fitted_temperature_undoes_a_known_miscalibration(scale):
    logits, labels = _drawn(4000, 5, scale)
    t = calibration.fit_temperature(logits, labels)
    assert t == pytest.approx(scale, rel=0.08)
    before = metrics.expected_calibration_error(metrics.softmax(logits), labels)
    after = metrics.expected_calibration_error(metrics.softmax(logits / t), labels)
    assert after <= before + 0.005 and after < 0.03  # NLL, not ECE, is what is minimised: ties may move a little
    assert np.array_equal((logits / t).argmax(1), logits.argmax(1))  # no answer changes


def test_too_few_photos_or_classes_keep_the_logits_as_they_are():
    logits, labels = _drawn(calibration.MIN_PHOTOS - 1, 3, 3.0)
    assert calibration.fit_temperature(logits, labels) == 1.0
    assert calibration.fit_temperature(np.zeros((50, 1)), np.zeros(50, int)) == 1.0
    bad = np.ones((50, 3))
    bad[0, 0] = np.nan
    assert calibration.fit_temperature(bad, np.zeros(50, int)) == 1.0
    logits, labels = _drawn(200, 3, 2.0)
    labels[:100] = -1  # unlabelled rows are left out
    assert calibration.fit_temperature(logits, labels) == pytest.approx(
        calibration.fit_temperature(logits[100:], labels[100:]))
    assert calibration.not_fitted_reason(logits, labels) is None  # what report.json records for a fitted one


def test_the_reason_no_temperature_was_fitted_is_named():
    """report.json said "chosen_on: val" with a temperature of 1.0 when none had been fitted."""
    logits, labels = _drawn(calibration.MIN_PHOTOS - 1, 3, 3.0)
    assert calibration.not_fitted_reason(logits, labels) == (
        f"{calibration.MIN_PHOTOS - 1} labelled validation photos, fewer than the {calibration.MIN_PHOTOS} a "
        "temperature is fitted on")
    assert calibration.not_fitted_reason(np.zeros((50, 1)), np.zeros(50, int)) == "fewer than two classes"
    right = np.eye(3)[np.arange(30) % 3] * 2.0
    assert "0 wrong answers on validation" in calibration.not_fitted_reason(right, np.arange(30) % 3)


def test_folding_the_temperature_into_the_classifier_divides_the_logits():
    model = StudentCNN(4, widths=(4, 8), rng=np.random.default_rng(0)).eval()
    x = Tensor(np.random.default_rng(1).standard_normal((3, 16, 16, 3)).astype(np.float32))
    with no_grad():
        before = model(x).numpy()
        calibration.scale_classifier(model, 0.5)
        after = model(x).numpy()
    np.testing.assert_allclose(after, before / 0.5, rtol=1e-5, atol=1e-6)


def test_a_validation_split_with_no_mistakes_is_not_sharpened_to_the_bound():
    """Every answer right: the likelihood rises as T falls without end; the fit ran to 0.05 (logits x 20)."""
    rng = np.random.default_rng(3)
    labels = np.arange(60) % 3
    logits = rng.uniform(-0.2, 0.2, (60, 3))
    logits[np.arange(60), labels] += 1.0  # all right, none sure
    assert (logits.argmax(1) == labels).all() and calibration.fit_temperature(logits, labels) == 1.0
    logits[0] = np.roll(logits[0], 1)  # one mistake: still too few to weigh sharpening against
    assert (logits.argmax(1) != labels).sum() == 1 and calibration.fit_temperature(logits, labels) == 1.0
    far, labels = _drawn(2000, 4, 50.0)  # fifty times too sure: the bound, no further
    assert calibration.fit_temperature(far, labels) == pytest.approx(calibration.BOUNDS[1], rel=1e-3)
