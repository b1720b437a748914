"""Self-training of the fine-tuned teacher on the dataset's unlabelled photos (``teacher.self_train``).

Noisy Student (Xie et al. 2020) and FixMatch in the form a CPU affords: after the first fine-tune the
teacher labels every unlabelled photo (the plain centre crop, as it sees val), keeps the confident ones and
is fine-tuned again on the labelled photos plus these pseudo-labelled ones, with noise (fresh random-resized
crops, flips, dropout) on the model being trained only; the labels came from clean photos.

Which photos are confident is decided on the validation split, whose labels are known: the threshold is the
lowest confidence at which the teacher's val predictions at or above it are at least
``teacher.self_train_target`` accurate (:func:`choose_threshold`). The second round starts from the first
round's weights, runs ``teacher.self_train_epochs`` epochs with a new warm-up + cosine, keeps its best epoch
by the usual rule (val accuracy, then val loss) and replaces the first round only when that epoch is not
worse than the first round's by the same rule (:func:`second_round_kept`). Everything is recorded for
teacher.json (:func:`run_self_training`'s dict): both rounds, the threshold, how many photos were kept per
class and which rows with which labels, so that a benchmark that withheld the labels can score them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from leaflens.engine.checkpoint import load_checkpoint
from leaflens.engine.nn import Module
from leaflens.pipeline.config import TeacherSection
from leaflens.pipeline.report import metrics
from leaflens.pipeline.training import BEST, is_better_epoch, warn_all_warmup

SELF_TRAIN_DIR = "self_train"  # the second round's run folder, inside the first round's


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (confidences compared against a threshold must not depend on rounding)."""
    return metrics.softmax(np.asarray(logits, np.float64))


@dataclass(frozen=True)
class Threshold:
    """The confidence threshold chosen on val: ``value`` None when no threshold reaches ``target``."""

    value: float | None
    target: float
    val_photos: int           # val photos in all
    val_above: int            # val photos at or above the threshold
    val_accuracy_above: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"threshold": self.value, "target": self.target, "val_photos": self.val_photos,
                "val_above": self.val_above, "val_accuracy_above": self.val_accuracy_above}


def choose_threshold(confidence: np.ndarray, correct: np.ndarray, target: float) -> Threshold:
    """The lowest confidence ``t`` among the val predictions' own such that the predictions with confidence
    >= ``t`` are at least ``target`` accurate (photos of equal confidence are kept or dropped together)."""
    confidence, correct = np.asarray(confidence, np.float64), np.asarray(correct, bool)
    n = len(confidence)
    if n == 0:
        return Threshold(None, target, 0, 0, None)
    order = np.argsort(-confidence, kind="stable")
    conf, hits = confidence[order], correct[order]
    accuracy = np.cumsum(hits) / np.arange(1, n + 1)
    cut_ok = np.r_[conf[1:] < conf[:-1], True]  # a threshold at conf[k] keeps every photo tied with it
    ok = np.flatnonzero(cut_ok & (accuracy >= target))
    if not len(ok):
        return Threshold(None, target, n, 0, None)
    k = int(ok.max())
    return Threshold(float(conf[k]), target, n, k + 1, float(accuracy[k]))


@dataclass(frozen=True)
class PseudoLabels:
    """The unlabelled photos kept: their ``rows`` in the unlabelled split, the teacher's ``labels`` and
    ``confidence``."""

    rows: np.ndarray
    labels: np.ndarray
    confidence: np.ndarray

    def per_class(self, classes: list[str] | tuple[str, ...]) -> dict[str, int]:
        counts = np.bincount(self.labels, minlength=len(classes))
        return {name: int(c) for name, c in zip(classes, counts)}


def pseudo_labels(logits: np.ndarray, threshold: float) -> PseudoLabels:
    """The teacher's labels of the unlabelled photos whose confidence (top softmax probability) is at least
    ``threshold``."""
    probs = softmax(logits)
    conf, labels = probs.max(axis=1), probs.argmax(axis=1)
    rows = np.flatnonzero(conf >= threshold)
    return PseudoLabels(rows.astype(np.int64), labels[rows].astype(np.int64), conf[rows])


def second_round_kept(first: tuple[float, float], second: tuple[float, float]) -> bool:
    """Whether the second round's (val accuracy, val loss) is not worse than the first's: the first is not
    better by the rule that picks epochs (higher accuracy; at equal accuracy lower loss)."""
    return not is_better_epoch(first[0], first[1], second[0], second[1])


def best_scores(history: list[dict[str, Any]], best_epoch: int) -> tuple[float, float]:
    """(val accuracy, val loss) of a run's kept epoch (1-based ``best_epoch``)."""
    row = history[best_epoch - 1]
    return float(row["val_acc"]), float(row["val_loss"])


# What the caller (pipeline/teachers/effnet.py) brings: the fine-tune run function, and a task maker that
# trains ``back`` on the labelled photos plus the pseudo-labelled ones with the given recipe.
RunFineTune = Callable[..., dict[str, Any]]
MakeTask = Callable[[PseudoLabels, TeacherSection], Any]


def run_self_training(back: Module, ds: Any, teacher: TeacherSection, first_round: dict[str, Any],
                      val_logits: np.ndarray, unlabeled_logits: Callable[[], np.ndarray], make_task: MakeTask,
                      run_fine_tune: RunFineTune, work_dir: Path, progress: bool, max_bad_steps: int,
                      test_accuracy: Callable[[], float | None] | None = None) -> dict[str, Any]:
    """Self-train the fine-tuned ``back`` (whose first round ran in ``work_dir``; ``first_round`` is what it
    returned) and return teacher.json's ``self_train`` record. ``back`` ends with the kept round's weights.

    ``val_logits``: the first round's logits of the val photos; ``unlabeled_logits()`` computes those of the
    unlabelled photos (only called when self-training can run). ``test_accuracy()``, when given, scores the
    weights ``back`` has on the labelled test split: each round's is recorded (never used to choose).
    """
    record: dict[str, Any] = {"enabled": teacher.self_train, "ran": False, "reason": None,
                              "target": teacher.self_train_target, "epochs": teacher.self_train_epochs}
    n_unlabeled = len(ds["unlabeled"]) if "unlabeled" in ds.splits else 0
    record["unlabeled_photos"] = n_unlabeled
    if not teacher.self_train:
        record["reason"] = "off (teacher.self_train = false)"
        return record
    if n_unlabeled == 0:
        record["reason"] = "the dataset has no unlabelled photos"
        return record
    t0 = time.perf_counter()
    val_y = np.asarray(ds["val"].labels)
    probs = softmax(val_logits)
    threshold = choose_threshold(probs.max(axis=1), probs.argmax(axis=1) == val_y, teacher.self_train_target)
    record.update(threshold.to_dict())
    record["threshold_of"] = "round 1"  # the val_* figures are the first fine-tune's, which labels the photos
    if threshold.value is None:
        record["reason"] = (f"no confidence threshold gives val predictions at least {teacher.self_train_target} "
                            "accurate (teacher.self_train_target)")
        return record
    kept = pseudo_labels(unlabeled_logits(), threshold.value)
    record.update({"kept": len(kept.rows), "kept_per_class": kept.per_class(ds.classes),
                   # the labels of the unlabelled photos are withheld in a dataset: benchmarks that know them
                   # score these rows (never the product)
                   "pseudo_labels": {"rows": kept.rows.tolist(), "labels": kept.labels.tolist()}})
    if progress:
        tqdm.write(f"teacher self-training: threshold {threshold.value:.4f} (val {threshold.val_above}/"
                   f"{threshold.val_photos} at or above it, {threshold.val_accuracy_above:.3f} accurate); kept "
                   f"{len(kept.rows)} of {n_unlabeled} unlabelled photos {record['kept_per_class']}",
                   file=sys.stderr)
    if not len(kept.rows):
        record["reason"] = "no unlabelled photo reaches the threshold"
        return record
    first = best_scores(first_round["fine_tune_history"], first_round["fine_tune_best_epoch"])
    first_test = test_accuracy() if test_accuracy is not None else None
    second_recipe = replace(teacher, epochs=teacher.self_train_epochs)
    warn_all_warmup("teacher.warmup_epochs", teacher.warmup_epochs, teacher.self_train_epochs,
                    "teacher self-training (teacher.self_train_epochs)")
    task = make_task(kept, second_recipe)
    second_round = run_fine_tune(task, back, second_recipe, progress, max_bad_steps, work_dir / SELF_TRAIN_DIR,
                                 label="teacher self-training")
    second = best_scores(second_round["fine_tune_history"], second_round["fine_tune_best_epoch"])
    second_test = test_accuracy() if test_accuracy is not None else None
    keep = second_round_kept(first, second)
    if not keep:
        load_checkpoint(work_dir / BEST, back)  # the first round's best epoch
    record.update({
        "ran": True, "kept_round": 2 if keep else 1, "train_photos": int(len(ds["train"])) + len(kept.rows),
        "rounds": [
            {"round": 1, "val_acc": first[0], "val_loss": first[1], "best_epoch": first_round["fine_tune_best_epoch"],
             "seconds": first_round["fine_tune_seconds"], "test_acc": first_test},
            {"round": 2, "val_acc": second[0], "val_loss": second[1],
             "best_epoch": second_round["fine_tune_best_epoch"], "seconds": second_round["fine_tune_seconds"],
             "test_acc": second_test, "history": second_round["fine_tune_history"]}],
        "seconds": round(time.perf_counter() - t0, 1)})
    if progress:
        tqdm.write(f"teacher self-training: round 2 val acc {second[0]:.4f} loss {second[1]:.4f} vs round 1 "
                   f"{first[0]:.4f} / {first[1]:.4f}: keeping round {record['kept_round']}",
                   file=sys.stderr)
    return record
