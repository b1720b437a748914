"""Mixup of the student's batches (``distill.mixup``): the images and every target (cross-entropy, the
teacher's probabilities, the teacher's features) mixed with one draw, unlabelled photos never taught a
label, the draw reproducible from the seed, alpha 0 the unmixed recipe, no host read added to a step."""

from __future__ import annotations

import numpy as np
import pytest

import leaflens.pipeline.train_student as ts
from leaflens.engine import Tensor, no_grad
from leaflens.engine.data import Batch
from leaflens.pipeline.config import ConfigError, load_config
from leaflens.pipeline.host_syncs import measure_host_syncs
from leaflens.pipeline.models.student import StudentSpec

C, D, B, SIZE = 3, 5, 6, 8


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _unit(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def _ce(logits: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Per-row cross-entropy of logits against target probabilities (NumPy reference)."""
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return -(probs * logp).sum(1)


def _setup(*sets: str):
    rng = np.random.default_rng(3)
    cfg = load_config(None, ["model.widths=[4, 8]", "distill.kd_weight=1.0", *sets])
    model = StudentSpec.from_recipe(cfg.model, C).build(np.random.default_rng(0), D)
    model.eval()  # no dropout: the same input gives the same outputs
    x = rng.normal(size=(B, SIZE, SIZE, 3)).astype(np.float32)
    y = np.array([0, -1, 2, -1, 1, -1])
    feats = rng.normal(size=(B, D)).astype(np.float32)
    tlogits = rng.normal(size=(B, C)).astype(np.float32) * 3
    return cfg, model, x, y, feats, tlogits


def test_mixup_batch_mixes_rows_with_one_draw_and_is_reproducible():
    x = np.random.default_rng(0).normal(size=(B, SIZE, SIZE, 3)).astype(np.float32)
    mixed, mix = ts.mixup_batch(x, 0.4, np.random.default_rng([7, 1, 2]))
    assert mix is not None and 0.0 < mix.lam < 1.0
    assert sorted(mix.perm) == list(range(B))
    np.testing.assert_allclose(mixed, mix.lam * x + (1 - mix.lam) * x[mix.perm], rtol=1e-6, atol=1e-6)
    assert mixed.dtype == np.float32
    again, mix2 = ts.mixup_batch(x, 0.4, np.random.default_rng([7, 1, 2]))
    np.testing.assert_array_equal(again, mixed)
    assert mix2.lam == mix.lam and np.array_equal(mix2.perm, mix.perm)
    _, other = ts.mixup_batch(x, 0.4, np.random.default_rng([7, 1, 3]))
    assert other.lam != mix.lam


def test_alpha_zero_is_no_mixup():
    x = np.ones((B, SIZE, SIZE, 3), np.float32)
    out, mix = ts.mixup_batch(x, 0.0, np.random.default_rng(0))
    assert out is x and mix is None
    # a draw that keeps every row's own image (lam 1) gives exactly the unmixed loss
    cfg, model, x, y, feats, tlogits = _setup()
    plain, parts, _ = ts.distill_loss(model, x, y, feats, tlogits, cfg.distill, 0.0)
    same, parts1, _ = ts.distill_loss(model, x, y, feats, tlogits, cfg.distill, 0.0,
                                      mix=ts.Mix(np.arange(B)[::-1].copy(), 1.0))
    assert float(plain.data) == pytest.approx(float(same.data), rel=1e-6)
    for key in parts:
        assert float(parts[key]) == pytest.approx(float(parts1[key]), rel=1e-6, abs=1e-7)


def test_targets_are_mixed_with_the_images_lambda():
    cfg, model, x, y, feats, tlogits = _setup("distill.temperature=2.0")
    mixed, mix = ts.mixup_batch(x, 0.4, np.random.default_rng(11))
    lam, perm, t = mix.lam, mix.perm, 2.0
    loss, parts, logits = ts.distill_loss(model, mixed, y, feats, tlogits, cfg.distill, 0.0, mix=mix)
    with no_grad():
        _, proj = model.forward_with_projection(Tensor(mixed))
    # KD: against lam p(teacher | x_i) + (1 - lam) p(teacher | x_perm(i)) at temperature t
    soft = lam * _softmax(tlogits / t) + (1 - lam) * _softmax(tlogits[perm] / t)
    kd = t * t * _ce(logits / t, soft).mean()
    entropy = -(soft * np.log(soft)).sum(1).mean()
    assert float(parts["kd"]) == pytest.approx(kd - t * t * entropy, rel=1e-4)
    # features: the mix of the pair's unit features, made unit again
    target = _unit(lam * _unit(feats) + (1 - lam) * _unit(feats[perm]))
    feat = ((_unit(proj.numpy()) - target) ** 2).sum(1).mean()
    assert float(parts["feature"]) == pytest.approx(feat, rel=1e-4)
    # cross-entropy: lam CE(y) + (1 - lam) CE(y[perm]), each over its labelled rows
    onehot = np.eye(C)
    per_row = lambda labels: _ce(logits[labels >= 0], onehot[labels[labels >= 0]]).mean()  # noqa: E731
    assert float(parts["ce"]) == pytest.approx(lam * per_row(y) + (1 - lam) * per_row(y[perm]), rel=1e-4)
    total = cfg.distill.feature_weight * feat + cfg.distill.alpha * float(parts["ce"]) + cfg.distill.kd_weight * kd
    assert float(loss.data) == pytest.approx(total, rel=1e-4)


def test_unlabelled_rows_never_get_a_cross_entropy_term():
    # rows 0/1 labelled and paired with each other; rows 2-5 unlabelled, paired among themselves
    y = np.array([0, 2, -1, -1, -1, -1])
    mix = ts.Mix(np.array([1, 0, 3, 2, 5, 4]), 0.7)
    logits = Tensor(np.random.default_rng(0).normal(size=(B, C)).astype(np.float32), requires_grad=True)
    ce = ts._cross_entropy(logits, y, 0.0, mix)
    ce.backward()
    grad = logits.grad
    np.testing.assert_array_equal(grad[2:], 0.0)  # an unlabelled pair is taught no label
    assert np.abs(grad[:2]).sum() > 0
    # a labelled row paired with an unlabelled one: its own label, at its own share only
    y2 = np.array([0, -1, -1, -1, -1, -1])
    mix2 = ts.Mix(np.array([1, 0, 2, 3, 4, 5]), 0.7)
    logits2 = Tensor(logits.data.copy(), requires_grad=True)
    ts._cross_entropy(logits2, y2, 0.0, mix2).backward()
    np.testing.assert_array_equal(logits2.grad[2:], 0.0)
    p = _softmax(logits.data.astype(np.float64))
    # row 0 gets lam * CE(y=0), row 1 (unlabelled, its partner labelled 0) gets (1 - lam) * CE(y=0)
    np.testing.assert_allclose(logits2.grad[0], 0.7 * (p[0] - np.eye(C)[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits2.grad[1], 0.3 * (p[1] - np.eye(C)[0]), rtol=1e-5, atol=1e-6)


def test_host_batches_carry_the_mix_and_repeat_it_for_the_same_seed():
    rng = np.random.default_rng(0)
    n = 8
    data = ts.TrainData(images=rng.integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8),
                        labels=np.array([0, 1, -1, -1, 2, -1, 0, -1]),
                        features=rng.normal(size=(n, D)).astype(np.float32),
                        logits=rng.normal(size=(n, C)).astype(np.float32))
    idx = np.array([5, 2, 7, 0, 1, 3])
    x = rng.normal(size=(len(idx), SIZE, SIZE, 3)).astype(np.float32)
    batch = Batch(x, data.labels[idx], idx, 4)
    a = ts._host_batch(data, batch, seed=0, epoch=2, size=SIZE, mixup=0.3)
    b = ts._host_batch(data, batch, seed=0, epoch=2, size=SIZE, mixup=0.3)
    assert a.mix_perm is not None and np.array_equal(a.mix_perm, b.mix_perm) and a.mix_lam == b.mix_lam
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_allclose(a.images, a.mix_lam * x + (1 - a.mix_lam) * x[a.mix_perm], rtol=1e-6, atol=1e-6)
    # the targets stay per row (the loss mixes them with the same draw); the labels too
    np.testing.assert_array_equal(a.features, data.features[idx])
    np.testing.assert_array_equal(a.labels, data.labels[idx])
    c = ts._host_batch(data, batch, seed=1, epoch=2, size=SIZE, mixup=0.3)
    assert c.mix_lam != a.mix_lam
    off = ts._host_batch(data, batch, seed=0, epoch=2, size=SIZE, mixup=0.0)
    assert off.mix_perm is None and off.images is x


def test_mixed_training_is_deterministic(tmp_path):
    rng = np.random.default_rng(0)
    n = 32
    data = ts.TrainData(images=rng.integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8),
                        labels=np.where(np.arange(n) % 3 == 0, -1, np.arange(n) % C),
                        features=rng.normal(size=(n, D)).astype(np.float32),
                        logits=rng.normal(size=(n, C)).astype(np.float32))
    cfg = load_config(None, ["train.epochs=2", "train.min_steps=0",
                             "train.batch_size=8", "model.widths=[4]", "train.warmup_epochs=0",
                             "train.device=cpu", "train.mixed_precision=off", "distill.mixup=0.4"])
    runs = []
    for k in range(2):
        r = ts.train_run(tmp_path / f"r{k}", cfg, data, data.images[:6], np.arange(6) % C,
                         np.zeros(3, np.float32), np.ones(3, np.float32), C, {}, progress=False)
        runs.append([(h["train_loss"], h["val_loss"]) for h in r.history])
    assert runs[0] == runs[1]
    assert all(np.isfinite(v) for pair in runs[0] for v in pair)


@pytest.mark.parametrize("value", ["-0.2", "nan", "inf"])
def test_a_bad_mixup_alpha_is_refused_with_its_name(value):
    with pytest.raises(ConfigError, match=r"distill.mixup=.*mixup is the alpha of the Beta"):
        load_config(None, [f"distill.mixup={value}"])


def test_a_mixed_step_reads_the_device_no_more_than_an_unmixed_one():
    report = measure_host_syncs("adamw", True, epochs=1, log_every=4, batches_per_epoch=6,
                                overrides=["distill.mixup=0.4"])
    assert report.max_per_step <= 2, report.per_step
    assert min(report.steady) == 1, report.per_step


def test_view_bank_views_are_mixed_with_their_own_teacher_targets():
    from leaflens.engine.data import Augment, sample_view_boxes

    rng = np.random.default_rng(1)
    n, k = 8, 4
    data = ts.TrainData(images=rng.integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8),
                        labels=np.array([0, 1, -1, -1, 2, -1, 0, -1]), features=None, logits=None,
                        views=sample_view_boxes(n, k, Augment(crop="resized", scale=(0.5, 1.0)), rng),
                        view_features=rng.normal(size=(n, k, D)).astype(np.float32),
                        view_logits=rng.normal(size=(n, k, C)).astype(np.float32))
    data.features = data.view_features[:, 0]
    idx = np.array([6, 1, 3, 0, 7, 2])
    x = rng.normal(size=(len(idx), SIZE, SIZE, 3)).astype(np.float32)
    batch = Batch(x, data.labels[idx], idx, 1)
    plain = ts._host_batch(data, batch, seed=0, epoch=3, size=SIZE, mixup=0.0)
    mixed = ts._host_batch(data, batch, seed=0, epoch=3, size=SIZE, mixup=0.4)
    # the same views as without mixup, their targets untouched (the loss mixes them with the draw) ...
    np.testing.assert_array_equal(mixed.features, plain.features)
    np.testing.assert_array_equal(mixed.logits, plain.logits)
    # ... and the images are those views, mixed
    lam, perm = mixed.mix_lam, mixed.mix_perm
    np.testing.assert_allclose(mixed.images, lam * plain.images + (1 - lam) * plain.images[perm], rtol=1e-5, atol=1e-5)
