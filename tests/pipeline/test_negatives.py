"""Outlier exposure: the generated negatives and their loss (train.outlier_exposure, off by default)."""

from __future__ import annotations

import numpy as np
import pytest

import leaflens.pipeline.train_student as ts
from leaflens.engine import Tensor
from leaflens.pipeline.config import load_config
from leaflens.pipeline.models.student import StudentSpec
from leaflens.pipeline.negatives import make_negatives


def _batch(n: int = 6, size: int = 16) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, size, size, 3)).astype(np.float32)


def test_negatives_are_shaped_like_the_batch_and_reproducible():
    x = _batch()
    a = make_negatives(x, 7, np.random.default_rng(3))
    b = make_negatives(x, 7, np.random.default_rng(3))
    assert a.shape == (7, 16, 16, 3) and a.dtype == np.float32 and np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, make_negatives(x, 7, np.random.default_rng(4)))
    with pytest.raises(ValueError, match="NHWC"):
        make_negatives(x[0], 2, np.random.default_rng(0))


def test_each_kind_keeps_what_it_should_of_its_photo():
    x = _batch(1)
    neg = make_negatives(x, 3, np.random.default_rng(1))  # kinds in turn: tiles, channels, blobs
    # shuffled tiles: the same pixel values, another arrangement
    np.testing.assert_array_equal(np.sort(neg[0].ravel()), np.sort(x[0].ravel()))
    assert not np.array_equal(neg[0], x[0])
    # permuted channels: every channel is one of the photo's channels, not in the same order
    chans = [x[0][..., c] for c in range(3)]
    found = [next(i for i, ch in enumerate(chans) if np.array_equal(neg[1][..., c], ch)) for c in range(3)]
    assert sorted(found) == [0, 1, 2] and found != [0, 1, 2]
    # blobs: smooth (neighbouring pixels close) where the photo is noise
    assert np.abs(np.diff(neg[2], axis=0)).mean() < 0.5 * np.abs(np.diff(x[0], axis=0)).mean()


def test_outlier_exposure_loss_is_cross_entropy_to_uniform():
    z = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]], np.float32)
    got = ts._outlier_exposure(Tensor(z)).item()
    lse = np.log(np.exp(z).sum(1))
    assert got == pytest.approx(float(np.mean(lse - z.mean(1))), rel=1e-6)
    assert ts._outlier_exposure(Tensor(z[1:])).item() == pytest.approx(np.log(3), rel=1e-6)  # uniform: its minimum


def test_the_loss_adds_the_weighted_negatives_term_and_keeps_the_batch_logits():
    cfg = load_config(None, ["model.widths=[4]"])
    model = StudentSpec(num_classes=3, widths=(4,)).build(np.random.default_rng(0)).eval()
    x, y = _batch(4), np.array([0, 1, 2, 0])
    neg = make_negatives(x, 2, np.random.default_rng(0))
    plain, parts0, logits0 = ts.distill_loss(model, x, y, None, None, cfg.distill, 0.0)
    loss, parts, logits = ts.distill_loss(model, x, y, None, None, cfg.distill, 0.0, neg, 0.5)
    assert "oe" not in parts0 and parts["ce"] == pytest.approx(parts0["ce"], rel=1e-5)
    assert loss.item() == pytest.approx(parts["ce"] + 0.5 * parts["oe"], rel=1e-5)
    assert np.asarray(logits).shape == (4, 3)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits0), rtol=1e-5, atol=1e-6)


def test_a_run_with_outlier_exposure_trains_and_logs_the_term(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (24, 8, 8, 3), dtype=np.uint8)
    labels = (np.arange(24) % 3).astype(np.int64)
    cfg = load_config(None, ["train.epochs=1", "train.min_steps=0",
                             "train.batch_size=8", "model.widths=[4]", "train.warmup_epochs=0",
                             "train.device=cpu", "train.mixed_precision=off", "train.outlier_exposure=0.5"])
    result = ts.train_run(tmp_path / "run", cfg, ts.TrainData(images, labels), images[:6], labels[:6],
                          np.full(3, 0.5, np.float32), np.full(3, 0.25, np.float32), 3, {}, progress=False)
    assert result.epochs_run == 1
    line = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1]
    assert '"train_oe"' in line
