"""The SERVED model on photo files: what `leaflens evaluate` and the export stage's served check measure.

The model is an exported ONNX file run by onnxruntime through the apps' Predictor, and its input is
the raw photo files, decoded, resized and normalised by the preprocessing contract the model carries
(leaflens.data_prep.contract): the figures are the ones users meet, not the engine's on the
preprocessed arrays. Photos come either from class folders (``DIR/<class>/*.jpg``, the folder names
must be classes the model knows) or from a dataset split's original files (the export's check).

An unreadable photo gets no answer: it is listed with its reason and left out of the figures. This
module does not import the training engine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from leaflens.apps.predictor import Predictor
from leaflens.data_prep.scan import UNLABELED, ScanError, scan_source
from leaflens.pipeline.report import metrics
from leaflens.pipeline.teachers.stage import split_source_dir
from leaflens.records import Record

__all__ = ["EvaluationError", "PhotoEvaluation", "PhotosUnavailable", "UnreadablePhoto", "class_folder_photos",
           "dataset_photo_files", "evaluate_files", "evaluate_photos", "format_evaluation"]


class EvaluationError(ValueError):
    """The evaluation cannot run as asked (the message names the folder or file and says why)."""


class PhotosUnavailable(EvaluationError):
    """The original photo files of a dataset split are no longer where the dataset says they came from."""


@dataclass(frozen=True)
class UnreadablePhoto(Record):
    """A photo that got no answer, and why (the decoder's message, naming the file)."""

    file: str
    error: str


@dataclass(frozen=True)
class PhotoEvaluation(Record):
    """What one evaluation found. ``summary`` is :func:`leaflens.pipeline.report.metrics.evaluation_summary`
    over the readable photos: n, correct, accuracy and its Wilson interval, per-class precision/recall/F1,
    the confusion matrix (rows = true class), calibration."""

    SCHEMA_VERSION: ClassVar[int | None] = 1

    model: str
    photos: str
    provider: str
    classes: list[str]
    unreadable: list[UnreadablePhoto]
    uncertain: int  # readable photos whose top probability is below the model's threshold
    summary: dict[str, Any]
    schema_version: int = 1

    @property
    def accuracy(self) -> float:
        return float(self.summary["accuracy"])


def class_folder_photos(root: str | os.PathLike[str], classes: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """The photos under ``root/<class>/`` (image files, searched recursively, hidden ones skipped) and their
    labels as indices into ``classes``; a folder whose name is not one of ``classes`` is refused."""
    try:
        scan = scan_source(root)
    except ScanError as exc:
        raise EvaluationError(str(exc)) from exc
    if scan.layout == "split_folders":
        raise EvaluationError(f"{scan.root} holds split folders (train/val/test); point --photos at one of them, "
                              f"e.g. {Path(scan.root) / 'test'}")
    unknown = [c for c in scan.classes if c not in classes]
    if unknown:
        raise EvaluationError(
            f"{scan.root}: folder(s) {', '.join(repr(c) for c in unknown)} name no class the model knows; "
            f"its classes are {', '.join(repr(c) for c in classes)} (rename the folder, or use the model "
            "trained on those classes)")
    index = {c: classes.index(c) for c in scan.classes}
    labelled = [f for f in scan.files if f.split != UNLABELED]
    return [f.path for f in labelled], np.array([index[scan.classes[f.label]] for f in labelled], np.int64)


def dataset_photo_files(ds: Any, split: str) -> tuple[Path, list[str]]:
    """The source folder a dataset split came from (as its manifest records it) and the original photo
    file of every row; :class:`PhotosUnavailable` when the folder or any file is no longer there."""
    root = split_source_dir(ds, split)
    if root is None:
        raise PhotosUnavailable(f"dataset {ds.root} does not record where the photos of split '{split}' came from")
    paths = [root / rel for rel in ds[split].files]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise PhotosUnavailable(f"{len(missing)} of the {len(paths)} original photos of split '{split}' are no "
                                f"longer in {root} (first: {missing[0]})")
    return root, [str(p) for p in paths]


def evaluate_files(predictor: Predictor, files: Sequence[str], labels: Any, photos: str,
                   batch_size: int = 32) -> PhotoEvaluation:
    """Run every photo through ``predictor`` as `leaflens predict` does and score the answers against
    ``labels`` (indices into the model's classes). ``photos`` says where the files came from."""
    labels = np.asarray(labels, np.int64)
    if len(files) != len(labels):
        raise ValueError(f"{len(files)} files but {len(labels)} labels")
    if not len(files):
        raise EvaluationError(f"{photos}: no photos to evaluate")
    classes = list(predictor.classes)
    column = {c: i for i, c in enumerate(classes)}
    rows, kept, unreadable, uncertain = [], [], [], 0
    answers = predictor.iter_predict_files(files, top_k=len(classes), batch_size=batch_size)
    for i, answer in enumerate(answers):
        if not answer.ok:
            unreadable.append(UnreadablePhoto(answer.source, str(answer.error)))
            continue
        row = np.zeros(len(classes))
        for name, prob in answer.top:
            row[column[name]] = prob
        rows.append(row)
        kept.append(i)
        uncertain += answer.uncertain
    if not rows:
        raise EvaluationError(f"{photos}: none of the {len(files)} photos could be read "
                              f"(first: {unreadable[0].error})")
    summary = metrics.evaluation_summary(np.stack(rows), labels[kept], classes)
    return PhotoEvaluation(model=str(predictor.model_path), photos=photos, provider=predictor.provider,
                           classes=classes, unreadable=unreadable, uncertain=int(uncertain), summary=summary)


def evaluate_photos(model: str | os.PathLike[str], photos: str | os.PathLike[str], threads: int | None = None,
                    batch_size: int = 32) -> PhotoEvaluation:
    """`leaflens evaluate`: the model file served by onnxruntime on the class folders under ``photos``."""
    predictor = Predictor(model, intra_op_threads=threads)
    files, labels = class_folder_photos(photos, predictor.classes)
    if not files:
        raise EvaluationError(f"{photos}: no photos in its class folders")
    return evaluate_files(predictor, files, labels, str(Path(photos).resolve()), batch_size)


def format_evaluation(ev: PhotoEvaluation) -> str:
    """A readable report: accuracy, per-class table, confusion matrix (rows = true), unreadable files."""
    s = ev.summary
    low, high = s["accuracy_ci"]
    width = max(len(c) for c in ev.classes) + 4
    lines = [f"{Path(ev.model).name} on {s['n']} photos in {ev.photos} ({ev.provider})",
             f"accuracy {s['accuracy']:.2%} ({s['correct']}/{s['n']}; {s['ci_level']:.0%} interval "
             f"{low:.1%}..{high:.1%}), {ev.uncertain} answered 'uncertain'", "",
             f"{'class':<{width}} {'photos':>7} {'precision':>9} {'recall':>7} {'F1':>6}"]
    for i, row in enumerate(s["per_class"]):
        lines.append(f"{f'{i} ' + row['class']:<{width}} {row['support']:>7} {row['precision']:>9.1%} "
                     f"{row['recall']:>7.1%} {row['f1']:>6.3f}")
    cm = s["confusion_matrix"]
    cell = max(4, max(len(str(v)) for r in cm for v in r) + 1)
    lines += ["", "confusion matrix (rows: true class, columns: predicted class, numbered as above)",
              " " * width + "".join(f"{j:>{cell}}" for j in range(len(ev.classes)))]
    for i, r in enumerate(cm):
        lines.append(f"{f'{i} ' + ev.classes[i]:<{width}}" + "".join(f"{v:>{cell}}" for v in r))
    if ev.unreadable:
        lines += ["", f"{len(ev.unreadable)} photo(s) could not be read and are not counted:"]
        lines += [f"  {u.error}" for u in ev.unreadable[:20]]
        if len(ev.unreadable) > 20:
            lines.append(f"  ... and {len(ev.unreadable) - 20} more (see --json)")
    return "\n".join(lines)
