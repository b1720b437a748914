"""The student training run: teacher targets follow the loader's rows (looked up by the batch's dataset
indices, whatever the shuffle order), including after a resume; the same recipe gives the same student
bit for bit whatever ran before in the process."""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_helpers import crash_after_checkpoints

import leaflens.pipeline.train_student as ts
import leaflens.pipeline.training as training
from leaflens.engine import random as erandom
from leaflens.pipeline.config import load_config

N, SIZE, STEP = 40, 8, 4  # image i is flat grey at i * STEP: its pixels name its row
REAL_LOSS = ts.distill_loss


def _cfg(epochs: int = 2, *extra: str):
    sets = [f"train.epochs={epochs}", "train.min_steps=0",
            "train.batch_size=8", "model.widths=[4]", "train.warmup_epochs=0",
            "train.lr=0.01", "train.device=cpu", "train.mixed_precision=off", "augment.brightness=0.0",
            "augment.contrast=0.0", "distill.kd_weight=1.0"]
    return load_config(None, sets + list(extra))


def _data() -> tuple[ts.TrainData, np.ndarray, np.ndarray]:
    rows = np.arange(N)
    images = np.broadcast_to((rows * STEP).astype(np.uint8)[:, None, None, None], (N, SIZE, SIZE, 3)).copy()
    labels = (rows % 3).astype(np.int64)
    features = np.stack([rows, -rows], axis=1).astype(np.float32)  # (N, 2): column 0 is the row
    logits = np.stack([rows, np.zeros(N), -rows], axis=1).astype(np.float32) / N
    val = images[:6].copy(), labels[:6].copy()
    return ts.TrainData(images, labels, features, logits), *val


def _run(tmp, monkeypatch, resume: bool = False) -> list[np.ndarray]:
    """Train, recording for every batch the row each image shows and the rows its teacher targets are for."""
    seen: list[np.ndarray] = []

    def recording_loss(model, x, y, feats, tlogits, *args, **kwargs):
        shown = np.rint(np.asarray(x)[:, 0, 0, 0] * 255.0 / STEP).astype(int)  # mean 0, std 1: pixel / 255
        np.testing.assert_array_equal(np.asarray(feats)[:, 0], shown)  # the features are this image's
        np.testing.assert_allclose(np.asarray(tlogits)[:, 0] * N, shown, atol=1e-4)  # and so are the logits
        np.testing.assert_array_equal(np.asarray(y), shown % 3)
        seen.append(shown)
        return REAL_LOSS(model, x, y, feats, tlogits, *args, **kwargs)

    monkeypatch.setattr(ts, "distill_loss", recording_loss)
    data, xv, yv = _data()
    ts.train_run(tmp, _cfg(), data, xv, yv, np.zeros(3, np.float32), np.ones(3, np.float32), 3, {},
                 resume=resume, progress=False)
    return seen


def test_teacher_targets_belong_to_the_images_they_are_paired_with(tmp_path, monkeypatch):
    seen = _run(tmp_path / "run", monkeypatch)
    assert len(seen) == 2 * (N // 8)
    epochs = [np.concatenate(seen[:5]), np.concatenate(seen[5:])]
    for shown in epochs:  # every row once per epoch, in a shuffled order that differs between epochs
        assert sorted(shown) == list(range(N))
    assert not np.array_equal(epochs[0], np.arange(N)) and not np.array_equal(epochs[0], epochs[1])


def test_resumed_run_pairs_targets_with_images_too(tmp_path, monkeypatch):
    full = _run(tmp_path / "full", monkeypatch)
    crash_after_checkpoints(monkeypatch, 1)  # after epoch 1
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "cut", monkeypatch)
    resumed = _run(tmp_path / "cut", monkeypatch, resume=True)
    assert len(resumed) == N // 8  # only the second epoch ran again
    for a, b in zip(full[N // 8:], resumed):
        np.testing.assert_array_equal(a, b)  # the same rows in the same order as the uninterrupted run


class _Trap:
    """Stands in for the engine's interactive fallback stream: any draw from it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the pipeline drew from the engine's default generator ({name})")


def _train_student(run_dir, seed: int = 0) -> dict[str, np.ndarray]:
    """A small distilled student with dropout (so the generator draws during training too): its last.npz."""
    data, xv, yv = _data()
    cfg = _cfg(2, "model.dropout=0.3", "model.widths=[4, 8]", f"train.seed={seed}")
    ts.train_run(run_dir, cfg, data, xv, yv, np.full(3, 0.4, np.float32), np.full(3, 0.2, np.float32), 3, {},
                 progress=False)
    with np.load(run_dir / training.LAST) as ck:
        return {k: ck[k] for k in ck.files if k != "meta"}


def test_the_same_recipe_gives_the_same_student_whatever_ran_before(tmp_path, monkeypatch):
    first = _train_student(tmp_path / "first")
    # What may run earlier in a process: draws from NumPy's global stream and from the engine's default one,
    # and another training run with its own seed.
    np.random.seed(123)
    np.random.random(1000)
    erandom.seed(5)
    erandom.default_generator().random(1000)
    other = _train_student(tmp_path / "other", seed=7)
    assert not np.array_equal(other["model/classifier.weight"], first["model/classifier.weight"])
    again = _train_student(tmp_path / "again")
    monkeypatch.setattr(erandom, "_default", _Trap())  # and the pipeline never draws from the default stream
    trapped = _train_student(tmp_path / "trapped")
    for run in (again, trapped):
        assert run.keys() == first.keys()
        for k in first:
            np.testing.assert_array_equal(run[k], first[k], err_msg=k)


def test_train_ema_gives_the_run_a_weight_average(tmp_path):
    """``train.ema``: the student's loop keeps a weight average (saved beside the live weights in last.npz,
    judged by validation and kept in best.npz); 0, the default, keeps none."""
    data, xv, yv = _data()
    mean, std = np.zeros(3, np.float32), np.ones(3, np.float32)
    for ema, run in ((0.0, "plain"), (0.9, "ema")):
        task, settings, _ = ts.student_run(_cfg(2, f"train.ema={ema}"), data, xv, yv, mean, std, 3, progress=False)
        assert settings.ema_decay == ema
        training.run_training(tmp_path / run, task, settings, {})
        meta, arrays = training.read_checkpoint_arrays(tmp_path / run / training.LAST)
        assert any(k.startswith("ema/") for k in arrays) == bool(ema)
        assert ("ema" in meta) == bool(ema)
    assert load_config(None, []).train.ema == 0.0


def test_few_training_photos_raise_the_epochs_and_the_patience_to_the_fewest_steps(capsys):
    """40 photos at batch 8 are 5 steps an epoch: train.min_steps = 23 asks for 5 epochs where 2 were given, and
    the early-stopping patience grows with them; enough steps, or 0, leave the recipe as given."""
    data, xv, yv = _data()
    mean, std = np.zeros(3, np.float32), np.ones(3, np.float32)
    _, settings, _ = ts.student_run(_cfg(2, "train.min_steps=23", "train.early_stopping_patience=3"), data, xv, yv,
                                    mean, std, 3, label="scratch", progress=False)
    assert (settings.epochs, settings.early_stopping_patience) == (5, 8)  # ceil(23 / 5); ceil(3 * 5 / 2)
    err = capsys.readouterr().err
    assert "scratch: 40 training photos make 5 steps an epoch; it trains 5 epochs instead of 2" in err
    for given in ("train.min_steps=10", "train.min_steps=0"):
        _, settings, _ = ts.student_run(_cfg(2, given, "train.early_stopping_patience=3"), data, xv, yv, mean, std,
                                        3, progress=False)
        assert (settings.epochs, settings.early_stopping_patience) == (2, 3)
    assert "train.min_steps" not in capsys.readouterr().err
    assert training.epochs_for_steps(8, 0, 128) == 128  # fewer photos than a batch: one step an epoch
    from leaflens.pipeline.config import DEFAULT_CONFIG  # noqa: PLC0415

    assert load_config(None, []).train.min_steps == 240  # the recipe's: 60 epochs of 256 photos (README)
    assert load_config(DEFAULT_CONFIG.parent / "distill_demo.toml").train.min_steps == 0  # the demo's time budget


def test_a_warm_up_as_long_as_the_run_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    """``train.warmup_epochs`` not below the epochs the run takes: the learning rate never decays, which a
    quick ``--set train.epochs=2`` beside the default warm-up of 2 does without a word otherwise."""
    data, xv, yv = _data()
    mean, std = np.zeros(3, np.float32), np.ones(3, np.float32)
    ts.student_run(_cfg(2, "train.warmup_epochs=2"), data, xv, yv, mean, std, 3, label="scratch", progress=False)
    err = capsys.readouterr().err
    assert "scratch: train.warmup_epochs = 2 is not below its 2 epochs" in err
    assert "--set train.warmup_epochs=0" in err
    ts.student_run(_cfg(3, "train.warmup_epochs=2"), data, xv, yv, mean, std, 3, label="scratch", progress=False)
    ts.student_run(_cfg(2, "train.warmup_epochs=2", "train.min_steps=23"), data, xv, yv, mean, std, 3,
                   progress=False)  # raised to 5 epochs: the warm-up is 2 of them
    assert "warmup_epochs" not in capsys.readouterr().err
    assert not training.warn_all_warmup("teacher.warmup_epochs", 1, 8, "teacher fine-tune")
    assert training.warn_all_warmup("teacher.warmup_epochs", 4, 4, "teacher self-training")
    assert "teacher self-training: teacher.warmup_epochs = 4 is not below its 4 epochs" in capsys.readouterr().err


def test_a_diverging_run_says_so_in_the_loop_s_words_not_numpy_s(tmp_path):
    """A learning rate far too high: the run stops with the loop's message; NumPy's overflow warnings (nine,
    with the engine's source lines, before it) are off while the loop runs, and on again after."""
    import warnings  # noqa: PLC0415

    data, xv, yv = _data()
    mean, std = np.zeros(3, np.float32), np.ones(3, np.float32)
    task, settings, _ = ts.student_run(_cfg(3, "train.lr=1e8", "train.clip_grad_norm=1e30"), data, xv, yv, mean,
                                       std, 3, label="scratch", progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(training.TrainingStopped, match="non-finite"):
            training.run_training(tmp_path, task, settings, {})
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.float32(1e30) * np.float32(1e30)
    assert caught  # NumPy's settings are the caller's again


def test_a_diverging_run_stays_quiet_when_something_resets_numpy_s_error_settings_mid_run(tmp_path):
    """np.errstate is a context variable: a generator left holding one, collected half-way through the run,
    sets it back to NumPy's defaults (warn). The loop's filter keeps the raw warnings out even then."""
    import warnings  # noqa: PLC0415

    def holds_errstate():
        with np.errstate(over="warn", invalid="warn", divide="warn"):
            yield

    data, xv, yv = _data()
    mean, std = np.zeros(3, np.float32), np.ones(3, np.float32)
    task, settings, _ = ts.student_run(_cfg(3, "train.lr=1e8", "train.clip_grad_norm=1e30"), data, xv, yv, mean,
                                       std, 3, label="scratch", progress=False)
    loss_of = task.batch_loss
    clobber = holds_errstate()
    next(clobber)  # entered before the run: closing it mid-run restores NumPy's defaults
    steps = []

    def reset_then_loss(batch):
        if len(steps) == 1:
            clobber.close()
            assert np.geterr()["over"] == "warn"  # the loop's errstate is gone for the rest of the run
        steps.append(1)
        return loss_of(batch)

    task.batch_loss = reset_then_loss
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(training.TrainingStopped, match="non-finite"):
            training.run_training(tmp_path, task, settings, {})
    assert len(steps) > 1
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
