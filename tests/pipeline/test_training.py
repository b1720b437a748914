"""The one training loop (leaflens.pipeline.training) and its rules, on a toy task and on the EfficientNet
teacher's fine-tune: the epoch kept (accuracy, then loss), early stopping, non-finite steps counted,
logged and fatal after a limit (never skipped silently), resume."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np
import pytest
from test_efficientnet import tiny_model

import leaflens.pipeline.training as training
from leaflens.engine import Tensor, nn, ops
from leaflens.engine.checkpoint import read_checkpoint_arrays
from leaflens.engine.optim import SGD, WarmupCosine
from leaflens.pipeline.config import load_config
from leaflens.pipeline.teachers.effnet import _fine_tune
from leaflens.pipeline.training import BatchLoss, LoopSettings, TrainingStopped, is_better_epoch, run_training

# the faults are induced on purpose: NumPy's overflow/invalid-value warnings are the expected symptoms
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class ToyBatch(NamedTuple):
    inputs: np.ndarray
    labels: np.ndarray
    indices: np.ndarray
    number: int


class ToyTask:
    """Two Gaussian blobs, a linear classifier; rows in ``poison`` have NaN inputs (a non-finite loss);
    ``val_scores`` (if given) replaces validation by a script of (accuracy, loss) per epoch."""

    def __init__(self, poison: tuple[int, ...] = (), val_scores: list[tuple[float, float]] | None = None,
                 n: int = 32, batch: int = 8, epochs: int = 4) -> None:
        rng = np.random.default_rng(0)
        self.y = (np.arange(n) % 2).astype(np.int64)
        self.x = (rng.standard_normal((n, 4)) + 2.0 * self.y[:, None]).astype(np.float32)
        self.x[list(poison)] = np.nan
        self.batch, self.val_scores, self.validated = batch, val_scores, 0
        self.model = nn.Linear(4, 2, rng=np.random.default_rng(1))
        self.optimizer = SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.steps_per_epoch = n // batch
        self.scheduler = WarmupCosine(self.optimizer, total_steps=epochs * self.steps_per_epoch)
        self.order = np.random.default_rng(2)
        self.generators = {"order": self.order}

    def batches(self, epoch: int):
        order = self.order.permutation(len(self.y))
        for b in range(self.steps_per_epoch):
            idx = order[b * self.batch:(b + 1) * self.batch]
            yield ToyBatch(self.x[idx], self.y[idx], idx, b)

    def batch_loss(self, batch: ToyBatch) -> BatchLoss:
        logits = self.model(Tensor(batch.inputs))
        return BatchLoss(ops.cross_entropy(logits, batch.labels), logits.data, {"ce": 0.0})

    def validate(self) -> tuple[float, float]:
        self.validated += 1
        if self.val_scores is not None:
            return self.val_scores[self.validated - 1]
        clean = np.isfinite(self.x).all(1)
        logits = self.model(Tensor(self.x[clean])).numpy()
        return training.validation_scores(logits, self.y[clean])

    def position(self, epoch: int) -> dict[str, Any]:
        return {"n": len(self.y)}

    def restore_position(self, state: dict[str, Any]) -> None:
        assert state == {"n": len(self.y)}


def _settings(**kw: Any) -> LoopSettings:
    return LoopSettings(**{"epochs": 4, "clip_grad_norm": 5.0, "max_bad_steps": 3, "progress": False, **kw})


def _rows(path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kept_epoch_is_the_best_by_accuracy_then_loss_and_patience_counts_from_it(tmp_path):
    scores = [(0.5, 0.9), (0.75, 0.8), (0.75, 0.6), (0.75, 0.7), (0.5, 0.5), (0.7, 0.1), (0.9, 0.1)]
    task = ToyTask(val_scores=scores, epochs=7)
    result = run_training(tmp_path, task, _settings(epochs=7, early_stopping_patience=2), {"who": "toy"})
    # epoch 3 ties epoch 2 on accuracy with a lower loss: it is kept, and patience counts from it
    assert result.best_epoch == 3 and result.best_val_accuracy == 0.75
    assert result.stopped_early and result.epochs_run == 5
    meta, _ = read_checkpoint_arrays(tmp_path / training.BEST)
    assert meta["epoch"] == 2 and meta["extra"]["who"] == "toy"
    rows = _rows(tmp_path / training.METRICS)
    assert [r["val_acc"] for r in rows] == [s[0] for s in scores[:5]]
    expected = {"lr", "val_loss", "train_loss", "train_ce", "train_acc", "skipped_steps", "amp_skipped_steps"}
    assert expected <= set(rows[0])
    assert is_better_epoch(0.75, 0.6, 0.75, 0.8) and not is_better_epoch(0.75, 0.8, 0.75, 0.8)


def test_an_epoch_with_a_non_finite_val_loss_never_beats_a_finite_one():
    """A diverging epoch (logits overflowed: val loss inf or NaN) must not become best.npz over a sound one,
    even with a higher accuracy; a sound epoch replaces a diverged best; with none yet, it still counts."""
    nan, inf = float("nan"), float("inf")
    assert not is_better_epoch(0.9, nan, 0.5, 0.7) and not is_better_epoch(0.9, inf, 0.5, 0.7)
    assert is_better_epoch(0.3, 0.9, 0.33, nan)
    assert is_better_epoch(0.33, nan, -1.0, inf)   # the first epoch counts whatever its loss
    assert is_better_epoch(0.5, nan, 0.33, nan)    # among diverged epochs, accuracy still decides


def test_non_finite_steps_are_counted_logged_and_left_out(tmp_path):
    task = ToyTask(poison=(5,))
    result = run_training(tmp_path, task, _settings(), {})
    faults = _rows(tmp_path / training.FAULTS)
    assert len(faults) == 4  # row 5 is in one batch of each of the 4 epochs
    assert all(5 in f["rows"] and ("non-finite" in f["error"] or "nan" in f["error"].lower()) for f in faults)
    assert [r["skipped_steps"] for r in result.history] == [1, 1, 1, 1]
    assert task.scheduler.last_step == 4 * (task.steps_per_epoch - 1)  # no optimiser step for a skipped batch
    assert all(np.isfinite(p.data).all() for p in task.model.parameters())
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]  # and training went on


@pytest.mark.parametrize("resumable", [True, False])
def test_repeated_non_finite_steps_stop_the_run_with_advice(tmp_path, resumable):
    task = ToyTask(poison=tuple(range(32)))
    with pytest.raises(TrainingStopped) as stop:
        run_training(tmp_path, task, _settings(label="toy", lr_setting="toy.lr", resumable=resumable), {})
    msg = str(stop.value)
    assert msg.startswith("toy: 3 consecutive non-finite") and "faults.jsonl" in msg and "toy.lr" in msg
    assert ("--resume" in msg) == resumable
    assert len(_rows(tmp_path / training.FAULTS)) == 3
    meta, arrays = read_checkpoint_arrays(tmp_path / training.LAST)  # sound weights are kept to resume from
    assert meta["epoch"] == -1 and all(np.isfinite(v).all() for v in arrays.values())


class ScheduledFaults(ToyTask):
    """ToyTask whose batches ``(epoch, number)`` in ``bad`` have a non-finite loss (NaN inputs), and whose
    validation loss overflows (NaN) after epoch ``nan_val`` (0-based), as a diverged model's does."""

    def __init__(self, bad: set[tuple[int, int]], nan_val: int | None = None) -> None:
        super().__init__()
        self.bad, self.nan_val, self.epoch = bad, nan_val, 0

    def batches(self, epoch: int):
        self.epoch = epoch
        for b in super().batches(epoch):
            yield b._replace(inputs=np.full_like(b.inputs, np.nan)) if (epoch, b.number) in self.bad else b

    def validate(self) -> tuple[float, float]:
        acc, loss = super().validate()
        return (acc, float("nan")) if self.epoch == self.nan_val else (acc, loss)


def _stopped(run_dir, task: ToyTask, resume: bool = False) -> str:
    with pytest.raises(TrainingStopped) as stop:
        run_training(run_dir, task, _settings(), {}, resume=resume)
    return str(stop.value)


# (faulty batches as (epoch, batch), epoch whose validation loss is NaN, epoch whose end a stop rewinds to)
REWINDS = {
    "first epoch: the initial state": ({(0, 2), (0, 3), (1, 0)}, None, -1),
    "later epoch: its start": ({(2, 0), (2, 1), (2, 2)}, None, 1),
    "streak across an epoch end: the end before it": ({(1, 3), (2, 0), (2, 1)}, None, 0),
    "a streak that ended does not hold the point back": ({(0, 3), (2, 0), (2, 1), (2, 2)}, None, 1),
    "an epoch with a NaN validation loss is passed over": ({(2, 0), (2, 1), (2, 2)}, 1, 0),
}


@pytest.mark.parametrize("bad,nan_val,expected", REWINDS.values(), ids=REWINDS.keys())
def test_a_stop_rewinds_last_to_the_last_sound_state_before_the_faults(tmp_path, bad, nan_val, expected):
    """The steps before a divergence's first non-finite loss leave finite but enormous weights: a stop puts
    back the last epoch end that came before the faults began (with a finite validation loss), or the
    initial state, says which, and a resumed run goes on from there."""
    msg = _stopped(tmp_path, ScheduledFaults(bad, nan_val))
    where = "the initial state" if expected < 0 else f"the state at the end of epoch {expected + 1}, the last sound"
    assert f"--resume, which starts from {where}" in msg, msg
    meta, arrays = read_checkpoint_arrays(tmp_path / training.LAST)
    assert meta["epoch"] == expected and all(np.isfinite(v).all() for v in arrays.values())
    assert meta["step"] == 4 * (expected + 1) - sum(e <= expected for e, _ in bad)  # no step from after it
    assert len(meta["extra"]["train_state"]["history"]) == expected + 1
    assert not (tmp_path / training.REWIND).exists()
    task = ToyTask()  # the cause fixed
    result = run_training(tmp_path, task, _settings(), {}, resume=True)
    assert task.validated == 3 - expected and result.epochs_run == 4
    assert len(_rows(tmp_path / training.METRICS)) == 4 and not (tmp_path / training.REWIND).exists()


def test_a_run_killed_inside_a_streak_of_faults_resumes_it_and_still_rewinds_past_it(tmp_path, monkeypatch):
    """Killed right after an epoch that ended inside a streak: the resumed run counts the streak on and a
    stop still rewinds to the state from before it, as the uninterrupted run does."""
    bad = {(1, 3), (2, 0), (2, 1)}
    real = training.save_checkpoint
    calls = {"n": 0}

    def dying_save(path, *a, **k):
        real(path, *a, **k)
        if path.name == training.LAST:
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt("simulated crash after epoch 2")

    monkeypatch.setattr(training, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run_training(tmp_path, ScheduledFaults(bad), _settings(), {})
    monkeypatch.setattr(training, "save_checkpoint", real)
    assert read_checkpoint_arrays(tmp_path / training.REWIND)[0]["epoch"] == 0  # last.npz is inside the streak
    msg = _stopped(tmp_path, ScheduledFaults(bad), resume=True)
    assert msg.startswith("model: 3 consecutive non-finite losses/gradients (last at epoch 3, batch 1;"), msg
    assert read_checkpoint_arrays(tmp_path / training.LAST)[0]["epoch"] == 0 and "end of epoch 1," in msg


@pytest.mark.parametrize("ema_decay", [0.0, 0.9])
def test_resume_continues_exactly(tmp_path, monkeypatch, ema_decay):
    full = run_training(tmp_path / "full", ToyTask(), _settings(ema_decay=ema_decay), {})
    real = training.save_checkpoint
    calls = {"n": 0}

    def dying_save(path, *a, **k):
        real(path, *a, **k)
        if path.name == training.LAST:
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt("simulated crash after epoch 2")

    monkeypatch.setattr(training, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run_training(tmp_path / "cut", ToyTask(), _settings(ema_decay=ema_decay), {})
    monkeypatch.setattr(training, "save_checkpoint", real)
    task = ToyTask()
    resumed = run_training(tmp_path / "cut", task, _settings(ema_decay=ema_decay), {}, resume=True)
    timing = {"images_per_s", "peak_rss_mb", "epoch_seconds"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in resumed.history] == \
        [{k: v for k, v in r.items() if k not in timing} for r in full.history]
    assert task.validated == 2  # only epochs 3 and 4 ran again
    a, b = read_checkpoint_arrays(tmp_path / "full" / training.LAST)[1], read_checkpoint_arrays(
        tmp_path / "cut" / training.LAST)[1]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert any(k.startswith("ema/") for k in a) == bool(ema_decay)


def test_a_run_resumed_with_a_weight_average_it_began_without_starts_one_from_the_resumed_weights(tmp_path,
                                                                                                   monkeypatch, capsys):
    real = training.save_checkpoint

    def dying_save(path, *a, **k):
        real(path, *a, **k)
        if path.name == training.LAST and k.get("epoch") == 1:
            raise KeyboardInterrupt("simulated crash after epoch 2")

    monkeypatch.setattr(training, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run_training(tmp_path, ToyTask(), _settings(), {})
    monkeypatch.setattr(training, "save_checkpoint", real)
    resumed = read_checkpoint_arrays(tmp_path / training.LAST)[1]
    task = ToyTask()
    for g in task.optimizer.param_groups:  # the resumed steps leave the weights where they are
        g["lr"] = g["initial_lr"] = 0.0
    run_training(tmp_path, task, _settings(ema_decay=0.9), {}, resume=True)
    assert "holds no weight average" in capsys.readouterr().err  # progress notes go to stderr
    meta, arrays = read_checkpoint_arrays(tmp_path / training.LAST)
    assert meta["ema"]["updates"] == 2 * task.steps_per_epoch
    for k in task.model.state_dict():
        np.testing.assert_array_equal(arrays[f"model/{k}"], resumed[f"model/{k}"], err_msg=k)
        # an average of the resumed weights alone, not of the run's initial weights
        np.testing.assert_allclose(arrays[f"ema/{k}"], resumed[f"model/{k}"], rtol=0, atol=1e-6, err_msg=k)


class WatchedTask(ToyTask):
    """Records the weights each validation judged."""

    def __init__(self) -> None:
        super().__init__(epochs=4)
        self.judged: list[dict[str, np.ndarray]] = []

    def validate(self) -> tuple[float, float]:
        self.judged.append(self.model.state_dict())
        return super().validate()


def test_with_a_weight_average_validation_and_best_judge_it_and_training_goes_on_from_the_live_weights(tmp_path):
    plain, averaged = WatchedTask(), WatchedTask()
    run_training(tmp_path / "plain", plain, _settings(), {})
    result = run_training(tmp_path / "ema", averaged, _settings(ema_decay=0.9), {})
    best = read_checkpoint_arrays(tmp_path / "ema" / training.BEST)[1]
    last = read_checkpoint_arrays(tmp_path / "ema" / training.LAST)[1]
    live = averaged.model.state_dict()
    for k in live:
        # the same steps: the live weights are those of the run without an average
        np.testing.assert_array_equal(live[k], plain.model.state_dict()[k], err_msg=k)
        np.testing.assert_array_equal(last[f"model/{k}"], live[k], err_msg=k)
        # what validation judged at the end is the average, saved in last.npz beside the live weights
        np.testing.assert_array_equal(last[f"ema/{k}"], averaged.judged[-1][k], err_msg=k)
        assert not np.allclose(averaged.judged[-1][k], live[k]), k
        assert not np.allclose(averaged.judged[-1][k], averaged.judged[0][k]), k  # the average follows the steps
        np.testing.assert_array_equal(best[f"model/{k}"], averaged.judged[result.best_epoch - 1][k], err_msg=k)
    assert not any(k.startswith("ema/") for k in read_checkpoint_arrays(tmp_path / "plain" / training.LAST)[1])


# ---- the EfficientNet teacher's fine-tune runs on the same loop ----------------------------------------------
class _Split:
    def __init__(self, labels):
        self.labels = labels


def _fine_tune_setup(poison_rows: tuple[int, ...] | str = ()):
    """A tiny EfficientNet back on random 'front outputs' of 24 train / 9 val photos of 3 classes."""
    net, _ = tiny_model()
    net.reset_classifier(3, np.random.default_rng(0))
    k = net.num_blocks - 1
    _, back = net.split(k)
    shape = net.split_shape(k, 16)
    rng = np.random.default_rng(3)
    y, yv = np.arange(24) % 3, np.arange(9) % 3
    fronts = {"train": rng.standard_normal((24, *shape)).astype(np.float16),
              "val": rng.standard_normal((9, *shape)).astype(np.float16)}
    rows = list(range(24)) if poison_rows == "all" else list(poison_rows)
    fronts["train"][rows] = np.inf
    ds = {"train": _Split(y), "val": _Split(yv)}
    recipe = load_config(None, ["teacher.epochs=3", "teacher.batch_size=8", "teacher.warmup_epochs=0"]).teacher
    return back, fronts, ds, recipe


def test_fine_tune_counts_and_logs_non_finite_batches_and_keeps_the_best_epoch(tmp_path):
    back, fronts, ds, recipe = _fine_tune_setup(poison_rows=(4,))
    extra = _fine_tune(back, fronts, None, ds, recipe, False, 5, tmp_path)
    history = extra["fine_tune_history"]
    assert [r["skipped_steps"] for r in history] == [1, 1, 1]  # never skipped silently
    assert all(4 in f["rows"] for f in _rows(tmp_path / training.FAULTS))
    best = min(history, key=lambda r: (-r["val_acc"], r["val_loss"], r["epoch"]))
    assert extra["fine_tune_best_epoch"] == best["epoch"] and extra["fine_tune_val_acc"] == best["val_acc"]
    kept = read_checkpoint_arrays(tmp_path / training.BEST)[1]
    for name, value in back.state_dict().items():  # the back holds the kept epoch's weights
        np.testing.assert_array_equal(value, kept[f"model/{name}"], err_msg=name)


def test_fine_tune_stops_on_repeated_non_finite_batches(tmp_path):
    back, fronts, ds, recipe = _fine_tune_setup(poison_rows="all")
    with pytest.raises(TrainingStopped, match=r"teacher fine-tune: 2 consecutive non-finite.*teacher\.lr"):
        _fine_tune(back, fronts, None, ds, recipe, False, 2, tmp_path)


def test_teacher_stage_reports_a_stopped_training_with_exit_3(tmp_path, capsys):
    """The --train-cnn teacher trains on the same loop; a divergence ends the stage with exit 3 and advice
    that fits it (a lower train.lr, then --resume), never a traceback; resumed at a sane rate, it finishes."""
    from pipeline_helpers import tiny_dataset  # noqa: PLC0415

    from leaflens.pipeline.cli import main as cli  # noqa: PLC0415

    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    code = cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--train-cnn", "--quiet",
                "--set", "train.lr=1e8", "--set", "train.batch_size=4", "--set", "teacher.cnn_epochs=3",
                "--set", "teacher.cnn_widths=[8, 16]"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "leaflens teacher: stopped: teacher: the weights became non-finite" in err and "train.lr" in err
    assert "rerun with --resume" in err and "Traceback" not in err
    assert not (tmp_path / "t").exists()
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--train-cnn", "--quiet",
                "--set", "train.lr=0.01", "--set", "train.batch_size=4", "--set", "teacher.cnn_epochs=3",
                "--set", "teacher.cnn_widths=[8, 16]", "--resume"]) == 0
    assert (tmp_path / "t" / "teacher.json").exists() and not (tmp_path / ".t.cnn-work").exists()


def test_peak_rss_is_in_mib_on_linux_and_macos_and_none_without_resource(monkeypatch):
    import builtins
    import resource
    import types

    usage = types.SimpleNamespace(ru_maxrss=300 * 1024)  # Linux reports KiB
    monkeypatch.setattr(resource, "getrusage", lambda who: usage)
    monkeypatch.setattr(training.sys, "platform", "linux")
    assert training.peak_rss_mb() == 300.0
    usage.ru_maxrss = 300 * 1024 * 1024  # macOS reports bytes
    monkeypatch.setattr(training.sys, "platform", "darwin")
    assert training.peak_rss_mb() == 300.0
    real_import = builtins.__import__

    def no_resource(name, *args, **kwargs):
        if name == "resource":
            raise ImportError("no module named 'resource' (Windows)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_resource)
    assert training.peak_rss_mb() is None


def test_a_resume_leaves_metrics_that_are_json_lines_even_after_a_torn_line(tmp_path):
    """A kill while an epoch's line was written left half a line, which stayed in the finished run's
    metrics.jsonl after --resume: tools reading it failed at that line."""
    import json as _json

    from leaflens.pipeline.training import _rewrite_metrics

    path = tmp_path / "metrics.jsonl"
    history = [{"epoch": e, "val_acc": 0.5} for e in (1, 2, 3, 4)]
    lines = [_json.dumps(row) for row in history]
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:15] + "\n" + lines[3] + "\n")
    _rewrite_metrics(path, history[:3])  # resumed from epoch 3's checkpoint: its line was the torn one
    assert [_json.loads(x) for x in path.read_text().splitlines()] == history[:3]
    path.write_text("".join(x + "\n" for x in lines))
    _rewrite_metrics(path, history[:2])
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"  # the lines as written, nothing after
