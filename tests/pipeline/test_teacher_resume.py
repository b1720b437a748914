"""An interrupted EfficientNet fine-tune goes on with --resume (pipeline/teachers/stage.py), on a tiny random
EfficientNet-Lite and a tiny synthetic dataset (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import crash_after_checkpoints, tiny_dataset
from test_teacher_finetune import SIZE
from test_teacher_self_train import leaf_dataset_with_unlabelled_leaves

from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.config import load_config
from leaflens.pipeline.teachers import effnet
from leaflens.pipeline.teachers.stage import (
    RESUME_RECORD,
    TeacherChoice,
    TeacherSettingError,
    TeacherStageError,
    finetune_work_dir,
    run_teacher_stage,
)

SETS = [f"teacher.input_size={SIZE}", "teacher.batch_size=8", "teacher.epochs=3", "teacher.min_steps=0",
        "teacher.finetune_from_block=2"]


def interrupt_in_epoch(monkeypatch, epoch: int) -> None:
    """Ctrl-C while epoch ``epoch`` (1-based) is validated: the epochs before it are checkpointed."""
    real = effnet.run_training

    def once(work_dir, task, settings, *args, **kwargs):
        validate, calls = task.validate, []

        def validate_then_stop():
            calls.append(1)
            if len(calls) == epoch:
                raise KeyboardInterrupt
            return validate()

        task.validate = validate_then_stop
        monkeypatch.setattr(effnet, "run_training", real)  # the next run is not interrupted
        return real(work_dir, task, settings, *args, **kwargs)

    monkeypatch.setattr(effnet, "run_training", once)


def count_validations(monkeypatch) -> list[int]:
    """The number of epochs each fine-tune round validates from now on (one per epoch it trains)."""
    real, counts = effnet.run_training, []

    def counted(work_dir, task, settings, *args, **kwargs):
        validate = task.validate
        counts.append(0)

        def validate_counted():
            counts[-1] += 1
            return validate()

        task.validate = validate_counted
        return real(work_dir, task, settings, *args, **kwargs)

    monkeypatch.setattr(effnet, "run_training", counted)
    return counts


def features(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: np.load(p) for p in sorted(folder.glob("*.npy"))}


@pytest.mark.parametrize("augment", ["rrc", "cached"])
def test_an_interrupted_fine_tune_resumes_to_the_same_teacher(tmp_path, tiny_lite0, monkeypatch, augment):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    cfg = load_config(None, [*SETS, f'teacher.augment="{augment}"'])
    run_teacher_stage(ds_dir, tmp_path / "whole", cfg, progress=False)
    assert not finetune_work_dir(tmp_path / "whole").exists()  # written: nothing left to resume

    out = tmp_path / "t"
    interrupt_in_epoch(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_teacher_stage(ds_dir, out, cfg, progress=False)
    work = finetune_work_dir(out)
    assert (work / "last.npz").exists() and not out.exists()
    validated = count_validations(monkeypatch)
    run_teacher_stage(ds_dir, out, cfg, progress=False, resume=True)
    assert validated == [2]  # epochs 2 and 3: epoch 1 was not trained again
    assert not work.exists()
    mine, whole = features(out), features(tmp_path / "whole")
    assert mine.keys() == whole.keys() and len(mine) >= 6
    for name in mine:
        np.testing.assert_array_equal(mine[name], whole[name], err_msg=name)
    stage = json.loads((out / "teacher.json").read_text())["stage"]
    assert [row["epoch"] for row in stage["fine_tune_history"]] == [1, 2, 3]
    assert "resumed_with_changes" not in stage  # the same rates throughout


def test_resume_refuses_another_recipe_but_takes_a_lower_learning_rate(tmp_path, tiny_lite0, monkeypatch):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    out = tmp_path / "t"
    interrupt_in_epoch(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_teacher_stage(ds_dir, out, load_config(None, SETS), progress=False)
    work = finetune_work_dir(out)
    before = (work / "last.npz").read_bytes()
    with pytest.raises(TeacherStageError, match=r"another teacher\.dropout"):
        run_teacher_stage(ds_dir, out, load_config(None, [*SETS, "teacher.dropout=0.5"]), progress=False, resume=True)
    assert (work / "last.npz").read_bytes() == before  # refused: the checkpoints are untouched
    record = work / RESUME_RECORD  # as if the dataset had been preprocessed again: said in words, not a key name
    saved = record.read_text()
    record.write_text(json.dumps({**json.loads(saved), "dataset_manifest_sha256": "sha256:another"}))
    with pytest.raises(TeacherStageError, match=r"another dataset \(preprocess was run again since\);"):
        run_teacher_stage(ds_dir, out, load_config(None, SETS), progress=False, resume=True)
    record.write_text(saved)
    run_teacher_stage(ds_dir, out, load_config(None, [*SETS, "teacher.lr=0.0001"]), progress=False, resume=True)
    assert (out / "teacher.json").exists() and not work.exists()
    stage = json.loads((out / "teacher.json").read_text())["stage"]
    # the epoch before the resume ran at the default rate: teacher.json says so, not only the last rate
    default_lr = load_config(None, SETS).teacher.lr
    assert [r["changed"] for r in stage["resumed_with_changes"]] == [{"teacher.lr": [default_lr, 0.0001]}]


def test_resume_of_a_finished_teacher_changes_nothing_and_a_new_run_starts_over(tmp_path, tiny_lite0, monkeypatch):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    out, cfg = tmp_path / "t", load_config(None, SETS)
    run_teacher_stage(ds_dir, out, cfg, progress=False)
    written = (out / "teacher.json").read_bytes()
    with pytest.raises(TeacherStageError, match="finished teacher"):
        run_teacher_stage(ds_dir, out, cfg, progress=False, resume=True)
    assert (out / "teacher.json").read_bytes() == written
    with pytest.raises(TeacherSettingError, match="--resume"):  # a frozen teacher is not trained
        run_teacher_stage(ds_dir, out, load_config(None, [*SETS, "teacher.frozen=true"]), progress=False,
                          resume=True)
    # an interrupted fine-tune's checkpoints are dropped by a run without --resume, which trains from epoch 1
    interrupt_in_epoch(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_teacher_stage(ds_dir, out, cfg, progress=False)
    assert (finetune_work_dir(out) / "last.npz").exists()
    validated = count_validations(monkeypatch)
    run_teacher_stage(ds_dir, out, cfg, progress=False)
    assert validated == [3]
    assert len(json.loads((out / "teacher.json").read_text())["stage"]["fine_tune_history"]) == 3
    assert not finetune_work_dir(out).exists()


def test_the_command_says_how_to_go_on_after_ctrl_c(tmp_path, tiny_lite0, monkeypatch, capsys):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    args = ["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--quiet",
            *[a for s in SETS for a in ("--set", s)]]
    interrupt_in_epoch(monkeypatch, 2)
    assert cli(args) == 130
    err = capsys.readouterr().err
    assert "checkpoints are kept in" in err and "--resume" in err
    assert cli([*args, "--resume"]) == 0
    assert cli([*args, "--resume"]) == 1  # finished: nothing to continue
    assert "finished teacher" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_a_fine_tune_stopped_on_faults_goes_on_at_a_lower_rate(tmp_path, tiny_lite0, capsys):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    args = ["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--quiet",
            *[a for s in SETS for a in ("--set", s)], "--set", "train.max_bad_steps=2"]
    assert cli([*args, "--set", "teacher.lr=1e30", "--set", "teacher.head_lr=1e30"]) == 3
    err = capsys.readouterr().err
    assert "teacher.lr" in err and "rerun with --resume" in err and "Traceback" not in err
    assert (finetune_work_dir(tmp_path / "t") / "last.npz").exists()
    assert cli([*args, "--resume"]) == 0
    stage = json.loads((tmp_path / "t" / "teacher.json").read_text())["stage"]
    history = stage["fine_tune_history"]  # resumed from the rewound sound state: every kept epoch finite
    assert [row["epoch"] for row in history][-1] == 3 and np.isfinite(history[-1]["val_loss"])


def test_a_fine_tune_interrupted_in_its_self_training_round_resumes_there(tmp_path, tiny_lite0, monkeypatch):
    ds_dir = leaf_dataset_with_unlabelled_leaves(tmp_path)
    cfg = load_config(None, [*SETS, "teacher.self_train=true", "teacher.self_train_target=0.0",
                             "teacher.self_train_epochs=2"])
    run_teacher_stage(ds_dir, tmp_path / "whole", cfg, progress=False)
    record = json.loads((tmp_path / "whole" / "teacher.json").read_text())["stage"]["self_train"]
    assert record["ran"], record
    out = tmp_path / "t"
    real = effnet.run_training

    def second_round_stops(work_dir, task, settings, *args, **kwargs):
        if Path(work_dir).name == "self_train":  # the second round: Ctrl-C as its second epoch is validated
            validate, calls = task.validate, []

            def validate_then_stop():
                calls.append(1)
                if len(calls) == 2:
                    raise KeyboardInterrupt
                return validate()

            task.validate = validate_then_stop
        return real(work_dir, task, settings, *args, **kwargs)

    monkeypatch.setattr(effnet, "run_training", second_round_stops)
    with pytest.raises(KeyboardInterrupt):
        run_teacher_stage(ds_dir, out, cfg, progress=False)
    validated = count_validations(monkeypatch)
    run_teacher_stage(ds_dir, out, cfg, progress=False, resume=True)
    assert validated == [0, 1]  # the first round was finished, the second goes on from its first epoch
    mine, whole = features(out), features(tmp_path / "whole")
    for name in whole:
        np.testing.assert_array_equal(mine[name], whole[name], err_msg=name)


def test_an_interrupted_train_cnn_teacher_resumes_to_the_same_teacher(tmp_path, monkeypatch):
    import leaflens.pipeline.training as training  # noqa: PLC0415

    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    cfg = load_config(None, ["teacher.cnn_epochs=3", "teacher.cnn_widths=[8, 16]", "train.batch_size=4"])
    run_teacher_stage(ds_dir, tmp_path / "whole", cfg, TeacherChoice(train_cnn=True), progress=False)
    crash_after_checkpoints(monkeypatch, 1)  # Ctrl-C once epoch 1 is checkpointed
    out = tmp_path / "t"
    with pytest.raises(KeyboardInterrupt):
        run_teacher_stage(ds_dir, out, cfg, TeacherChoice(train_cnn=True), progress=False)
    work = finetune_work_dir(out, train_cnn=True)
    assert (work / "last.npz").exists()
    with pytest.raises(TeacherStageError, match=r"another teacher\.cnn_widths"):
        run_teacher_stage(ds_dir, out, load_config(None, ["teacher.cnn_epochs=3", "teacher.cnn_widths=[8, 32]",
                                                          "train.batch_size=4"]),
                          TeacherChoice(train_cnn=True), progress=False, resume=True)
    resumed_at: list[int] = []
    real_resume = training._resume

    def spy_resume(*args, **kwargs):
        resumed_at.append(real_resume(*args, **kwargs))
        return resumed_at[-1]

    monkeypatch.setattr(training, "_resume", spy_resume)
    run_teacher_stage(ds_dir, out, cfg, TeacherChoice(train_cnn=True), progress=False, resume=True)
    assert resumed_at == [1]  # went on at epoch 2 (0-based 1): epoch 1 was not trained again
    assert not work.exists()
    mine, whole = features(out), features(tmp_path / "whole")
    for name in whole:
        np.testing.assert_array_equal(mine[name], whole[name], err_msg=name)


def test_a_refused_run_leaves_nothing_to_resume_and_the_output_is_said(tmp_path, tiny_lite0, monkeypatch, capsys):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    out = tmp_path / "t"
    args = ["teacher", "--dataset", str(ds_dir), "--out", str(out), *[a for s in SETS for a in ("--set", s)]]
    assert cli([*args, "--set", "teacher.finetune_from_block=99"]) == 2  # a setting that cannot be run
    assert "finetune_from_block" in capsys.readouterr().err
    assert not finetune_work_dir(out).exists()  # no fake "interrupted fine-tune" for --resume to trip on
    interrupt_in_epoch(monkeypatch, 1)  # before any epoch was checkpointed
    assert cli([*args, "--quiet"]) == 130
    assert "nothing to resume" in capsys.readouterr().err and not finetune_work_dir(out).exists()
    assert cli([*args, "--json"]) == 0  # progress lines on stderr: stdout is the one JSON object
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["self_train"]["ran"] is False and "epoch 1/3" in captured.err
    interrupt_in_epoch(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_teacher_stage(ds_dir, out, load_config(None, SETS), progress=True)
    capsys.readouterr()
    assert cli(args) == 0  # without --resume: the checkpoints go, and the finished teacher is replaced: both said
    err = capsys.readouterr().err
    assert "is discarded: this run starts over" in err and f"the teacher in {out} is replaced" in err
