"""Self-training of the fine-tuned teacher on unlabelled photos (pipeline/teachers/self_train.py): the
threshold chosen on val, pseudo-labels above it only, the second round kept only when not worse, what
teacher.json records, ``--no-self-train`` and datasets without unlabelled photos. Tiny random EfficientNet-Lite
and tiny synthetic datasets (seconds)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import make_class_folders, tiny_dataset
from test_teacher_finetune import SIZE, tiny_net

from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.engine.checkpoint import save_checkpoint
from leaflens.pipeline.cli import build_parser
from leaflens.pipeline.cli.teacher import flag_overrides
from leaflens.pipeline.config import ConfigError, load_config
from leaflens.pipeline.teachers.self_train import (
    choose_threshold,
    pseudo_labels,
    run_self_training,
    second_round_kept,
    softmax,
)
from leaflens.pipeline.teachers.stage import TeacherChoice, run_teacher_stage
from leaflens.pipeline.training import BEST


def test_threshold_is_the_lowest_confidence_whose_val_predictions_reach_the_target():
    conf = np.array([0.99, 0.95, 0.90, 0.80, 0.70, 0.60, 0.50])
    right = np.array([1, 1, 1, 0, 1, 1, 0], bool)
    # accuracy at or above each confidence: 1, 1, 1, .75, .8, .833, .714
    t = choose_threshold(conf, right, 0.8)
    assert t.value == pytest.approx(0.60) and t.val_above == 6 and t.val_accuracy_above == pytest.approx(5 / 6)
    assert choose_threshold(conf, right, 0.95).value == pytest.approx(0.90)
    assert choose_threshold(conf, right, 0.0).value == pytest.approx(0.50)
    # the most confident prediction is wrong: no threshold reaches 100 %
    assert choose_threshold(np.array([0.9, 0.8]), np.array([False, True]), 1.0).value is None


def test_tied_confidences_are_kept_or_dropped_together():
    conf = np.array([0.9, 0.7, 0.7, 0.5])
    right = np.array([True, True, False, True])
    t = choose_threshold(conf, right, 0.9)
    # cutting between the two 0.7s would read 100 %, but a threshold of 0.7 keeps both (2/3)
    assert t.value == pytest.approx(0.9) and t.val_above == 1


def test_pseudo_labels_only_at_or_above_the_threshold():
    logits = np.log(np.array([[0.9, 0.05, 0.05], [0.4, 0.35, 0.25], [0.1, 0.1, 0.8], [0.2, 0.7, 0.1]]))
    kept = pseudo_labels(logits, 0.65)
    assert kept.rows.tolist() == [0, 2, 3] and kept.labels.tolist() == [0, 2, 1]
    assert (kept.confidence >= 0.65).all() and softmax(logits)[1].max() < 0.65
    assert kept.per_class(["a", "b", "c"]) == {"a": 1, "b": 1, "c": 1}


def test_second_round_is_kept_only_when_not_worse_on_val():
    assert second_round_kept((0.90, 0.40), (0.92, 0.90))      # more accurate
    assert second_round_kept((0.90, 0.40), (0.90, 0.30))      # as accurate, lower loss
    assert second_round_kept((0.90, 0.40), (0.90, 0.40))      # the same: not worse
    assert not second_round_kept((0.90, 0.40), (0.88, 0.10))  # less accurate
    assert not second_round_kept((0.90, 0.40), (0.90, 0.41))  # as accurate, higher loss


def _history(acc: float, loss: float) -> list[dict]:
    return [{"epoch": 1, "val_acc": acc, "val_loss": loss}]


@pytest.mark.parametrize("worse", [True, False])
def test_a_worse_second_round_is_undone(tmp_path, worse):
    """The orchestration with a fake second round that changes the weights and reports val scores: a worse
    round leaves the first round's weights (its best.npz) in the model."""
    ds = load_dataset(tiny_dataset(tmp_path, per_class=8, size=16, unlabeled=6))
    teacher = load_config(None, ["teacher.self_train_target=0.0", "teacher.self_train_epochs=2"]).teacher
    net = tiny_net()
    net.reset_classifier(ds.num_classes, np.random.default_rng(0))
    _, back = net.split(1)
    first_weights = {k: v.copy() for k, v in back.state_dict().items()}
    save_checkpoint(tmp_path / "run" / BEST, back)
    first_round = {"fine_tune_history": _history(0.8, 0.5), "fine_tune_best_epoch": 1, "fine_tune_seconds": 1.0}
    seen = {}

    def make_task(kept, recipe):
        seen.update(rows=kept.rows, epochs=recipe.epochs)
        return "task"

    def run_fine_tune(task, model, recipe, progress, max_bad_steps, work_dir, label=""):
        for p in model.parameters():
            p.data += 1.0
        return {"fine_tune_history": _history(0.7 if worse else 0.85, 0.4), "fine_tune_best_epoch": 1,
                "fine_tune_seconds": 2.0}

    rng = np.random.default_rng(0)
    record = run_self_training(back, ds, teacher, first_round, rng.normal(size=(len(ds["val"]), 3)),
                               lambda: 8.0 * np.eye(3)[[0, 1, 2, 0, 1, 2]], make_task, run_fine_tune, tmp_path / "run",
                               progress=False, max_bad_steps=3)
    assert record["ran"] and seen["epochs"] == 2 and len(seen["rows"]) == 6  # all more confident than val
    assert record["kept_round"] == (1 if worse else 2)
    after = back.state_dict()
    same = all(np.array_equal(first_weights[k], after[k]) for k in first_weights)
    assert same == worse
    assert [r["val_acc"] for r in record["rounds"]] == [0.8, 0.7 if worse else 0.85]


def leaf_dataset_with_unlabelled_leaves(tmp: Path, per_class: int = 8) -> Path:
    """The three colour classes, and unlabelled photos of the same classes (other photos, their class in the
    file name as the iBeans benchmark names them): photos a teacher can be confident about."""
    src = make_class_folders(tmp / "photos", per_class=per_class)
    unl = tmp / "unlabeled_photos"
    unl.mkdir()
    for f in sorted(make_class_folders(tmp / "more", per_class=4, seed=1).glob("*/*")):
        (unl / f"{f.parent.name}__{f.name}").write_bytes(f.read_bytes())
    ingest(src, tmp / "dataset", IngestOptions(size=16), unlabeled=unl, workers=1, log=lambda s: None)
    return tmp / "dataset"


def _stage(tmp_path: Path, ds_dir: Path, *sets: str) -> dict:
    cfg = load_config(None, [f"teacher.input_size={SIZE}", "teacher.batch_size=8", "teacher.epochs=1",
                             "teacher.min_steps=0",
                             "teacher.self_train_epochs=1", "teacher.finetune_from_block=2", *sets])
    run_teacher_stage(ds_dir, tmp_path / "t", cfg, TeacherChoice(), progress=False)
    return json.loads(Path(tmp_path / "t" / "teacher.json").read_text())["stage"]


def test_teacher_json_records_both_rounds_the_threshold_and_the_kept_photos(tmp_path, tiny_lite0):
    ds_dir = leaf_dataset_with_unlabelled_leaves(tmp_path)
    stage = _stage(tmp_path, ds_dir, "teacher.self_train_target=0.0")
    st = stage["self_train"]
    assert st["ran"] and st["unlabeled_photos"] == 12 and st["target"] == 0.0
    # target 0: the threshold is the least confident val prediction, so the kept photos are those at least
    # as confident as that
    assert st["threshold"] is not None and st["val_above"] == st["val_photos"] == len(load_dataset(ds_dir)["val"])
    assert st["threshold_of"] == "round 1"  # the val figures are those of the teacher that labelled the photos
    assert 1 <= st["kept"] <= 12 and sum(st["kept_per_class"].values()) == st["kept"]
    assert len(st["pseudo_labels"]["rows"]) == st["kept"] and set(st["pseudo_labels"]["labels"]) <= {0, 1, 2}
    assert [r["round"] for r in st["rounds"]] == [1, 2] and st["kept_round"] in (1, 2)
    assert len(st["rounds"][1]["history"]) == 1
    assert st["train_photos"] == len(load_dataset(ds_dir)["train"]) + st["kept"]
    assert st["rounds"][0]["val_acc"] == stage["fine_tune_val_acc"]
    # each round's test accuracy is recorded (the tiny dataset has a labelled test split)
    assert all(0.0 <= r["test_acc"] <= 1.0 for r in st["rounds"])


def test_cached_mode_self_trains_too(tmp_path, tiny_lite0):
    ds_dir = leaf_dataset_with_unlabelled_leaves(tmp_path)
    st = _stage(tmp_path, ds_dir, "teacher.self_train_target=0.0", "teacher.augment=\"cached\"")["self_train"]
    assert st["ran"] and st["kept"] >= 1 and len(st["rounds"]) == 2


def test_no_self_training_when_turned_off_or_without_unlabelled_photos(tmp_path, tiny_lite0):
    with_unlabeled = tiny_dataset(tmp_path / "a", per_class=8, size=16, unlabeled=6)
    st = _stage(tmp_path / "a", with_unlabeled, "teacher.self_train=false")["self_train"]
    assert not st["ran"] and "off" in st["reason"] and "rounds" not in st
    without = tiny_dataset(tmp_path / "b", per_class=8, size=16)
    st = _stage(tmp_path / "b", without, "teacher.self_train_target=0.0")["self_train"]
    assert not st["ran"] and "no unlabelled photos" in st["reason"] and st["unlabeled_photos"] == 0


class _SplitsOnly:
    """A dataset with a labelled val split and three unlabelled photos, nothing else."""

    splits = ("train", "val", "unlabeled")
    classes = ["a", "b"]

    def __getitem__(self, name: str):
        return {"val": argparse.Namespace(labels=np.array([1, 0])), "unlabeled": [0, 1, 2]}[name]


def test_a_target_no_threshold_reaches_skips_the_second_round():
    teacher = load_config(None, ["teacher.self_train_target=1.0"]).teacher
    # the most confident val prediction is wrong: nothing can reach 100 %
    val_logits = np.array([[3.0, 0.0], [0.0, 1.0]])
    record = run_self_training(None, _SplitsOnly(), teacher, {}, val_logits, lambda: pytest.fail("labelled nothing"),
                               None, None, Path("unused"), progress=False, max_bad_steps=1)
    assert not record["ran"] and "self_train_target" in record["reason"] and record["threshold"] is None


def test_cli_flag_and_config_key():
    parser = build_parser(only="teacher")
    assert ("teacher.self_train=false", "--no-self-train") in flag_overrides(
        parser.parse_args(["teacher", "--no-self-train"]))
    assert ("teacher.self_train=true", "--self-train") in flag_overrides(parser.parse_args(["teacher", "--self-train"]))
    assert not any("self_train" in s for s, _ in flag_overrides(parser.parse_args(["teacher"])))
    assert load_config().teacher.self_train is True
    assert load_config(None, ["teacher.self_train=false"]).teacher.self_train is False
    with pytest.raises(ConfigError, match="self_train_target"):
        load_config(None, ["teacher.self_train_target=1.5"])
