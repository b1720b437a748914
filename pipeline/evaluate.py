"""The SERVED model on photo files: what `leaflens evaluate` and the export stage's served check measure.

The model is an exported ONNX file run by onnxruntime through the apps' Predictor, and its input is
the raw photo files, decoded, resized and normalised by the preprocessing contract the model carries
(leaflens.data_prep.contract): the figures are the ones users meet, not the engine's on the
preprocessed arrays. Photos come either from class folders (``DIR/<class>/*.jpg``, the folder names
must be classes the model knows) or from a dataset split's original files (the export's check).

An unreadable photo gets no answer: it is listed with its reason and left out of the figures. A photo the
app would refuse before the model (too small, one flat colour, too blurred: leaflens.data_prep.quality) is
still shown to the model here, so the figures measure the model on every readable photo (and the export's
served check compares like with like); it is listed apart, with its reason, as the share of such photos
the app would turn away. The verdicts of the model's answers (diagnosis, ambiguous, out of domain:
leaflens.apps.predictor) are counted, with the accuracy of the diagnoses alone. This module does not
import the training engine.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from leaflens.apps.diagnosis import REFUSAL_REASONS
from leaflens.apps.predictor import Prediction, Predictor
from leaflens.columns import display_width, pad_right
from leaflens.data_prep.scan import IMAGE_EXTENSIONS, NOT_A_LEAF, UNLABELED, ScanError, matching_class, scan_source
from leaflens.pipeline.report import metrics
from leaflens.pipeline.teachers.stage import changed_originals, changed_originals_message, split_photo_paths
from leaflens.records import Record

__all__ = ["EvaluationError", "NoPhotoReadable", "PhotoEvaluation", "PhotosUnavailable", "RefusedPhoto",
           "UnreadablePhoto", "class_folder_photos", "dataset_photo_files", "evaluate_files", "evaluate_photos",
           "format_evaluation"]


class EvaluationError(ValueError):
    """The evaluation cannot run as asked (the message names the folder or file and says why)."""


class NoPhotoReadable(EvaluationError):
    """Photos were found but none could be read (exit 1, as for some unreadable photos: not a usage error)."""


class PhotosUnavailable(EvaluationError):
    """The original photo files of a dataset split are no longer where the dataset says they came from."""


@dataclass(frozen=True)
class UnreadablePhoto(Record):
    """A photo that got no answer, and why (the decoder's message, naming the file)."""

    file: str
    error: str


@dataclass(frozen=True)
class RefusedPhoto(Record):
    """A photo the app would refuse before the model, and why (``reason``: "too_small", "uniform" or
    "low_texture"; ``error``: the message naming the file). It is still evaluated."""

    file: str
    reason: str
    error: str


@dataclass(frozen=True)
class PhotoEvaluation(Record):
    """What one evaluation found. ``summary`` is :func:`leaflens.pipeline.report.metrics.evaluation_summary`
    over the readable photos: n, correct, accuracy and its Wilson interval, per-class precision/recall/F1,
    the confusion matrix (rows = true class), calibration.

    Verdicts of the model's answers on those photos: ``diagnosed`` (of which ``diagnosed_correct`` have the
    true class), ``ambiguous``, ``out_of_domain``; ``uncertain`` = ambiguous + out of domain. ``refused``:
    the photos the app would turn away before the model (counted in the figures all the same)."""

    SCHEMA_VERSION: ClassVar[int | None] = 2

    model: str
    photos: str
    provider: str
    classes: list[str]
    unreadable: list[UnreadablePhoto]
    uncertain: int  # readable photos answered without a diagnosis (ambiguous or out of domain)
    summary: dict[str, Any]
    diagnosed: int = 0
    diagnosed_correct: int = 0
    ambiguous: int = 0
    out_of_domain: int = 0
    refused: list[RefusedPhoto] = field(default_factory=list)
    # --not-known: photos of no class of the model and what it answered them (:func:`evaluate_not_known`'s
    # record; None when not asked)
    not_known: dict[str, Any] | None = None
    schema_version: int = 2

    @classmethod
    def _upgrade(cls, data: dict[str, Any], version: int, where: str) -> dict[str, Any]:
        """Version 1 did not count verdicts: the new counts keep their defaults (0, none refused)."""
        if version == 1:
            return data
        return super()._upgrade(data, version, where)

    @property
    def accuracy(self) -> float:
        return float(self.summary["accuracy"])


# What a scan leaves out that a person should hear about (leaflens.data_prep.scan.walk_folder)
LEFT_OUT = {"broken_link": "link(s) to a missing file", "name_not_utf8": "file name(s) not in UTF-8 (rename them)",
            "link_loop": "link loop(s) (a folder link back to a folder already searched, or links to each other)",
            "not_image": "file(s) not images by their extension", "hidden": "hidden file(s) or folder(s)",
            "outside_class_folders": "file(s) outside the class folders"}


def class_folder_photos(root: str | os.PathLike[str], classes: Sequence[str],
                        not_known: str | os.PathLike[str] | None = None) -> tuple[list[str], np.ndarray]:
    """The photos under ``root/<class>/`` (image files, searched recursively, hidden ones skipped) and their
    labels as indices into ``classes``; a folder whose name is not one of ``classes`` is refused."""
    if Path(root).is_file():
        raise EvaluationError(f"{root} is a file; evaluate takes a folder of class folders (PHOTOS/<class>/*.jpg), "
                              f"whose names are the right answers; for the model's answer to one photo: leaflens "
                              f"predict {root}")
    try:
        scan = scan_source(root)
    except ScanError as exc:
        loose = Path(root).is_dir() and any(p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
                                            for p in Path(root).iterdir())
        hint = (f"; {root} holds photos itself: if it is one class's folder, point at the folder above it, "
                f"{Path(root).resolve().parent}" if loose else "")
        raise EvaluationError(f"{exc}{hint}") from exc
    if scan.layout == "split_folders":
        raise EvaluationError(f"{scan.root} holds split folders (train/val/test); point --photos at one of them, "
                              f"e.g. {Path(scan.root) / 'test'}")
    # the web app's corrections folder holds one for photos people said show no leaf: not a class to score
    no_leaf = NOT_A_LEAF in scan.classes and NOT_A_LEAF not in classes
    asked = not_known is not None and Path(not_known).resolve() == (Path(scan.root) / NOT_A_LEAF).resolve()
    if no_leaf and not asked:  # with --not-known naming it, its figures follow
        print(f"note: {Path(scan.root) / NOT_A_LEAF} left out: photos people said show no leaf are of no class of "
              f"the model; to see what it answers them: --not-known {Path(scan.root) / NOT_A_LEAF}", file=sys.stderr)
    # a folder name in another Unicode form than the model's class (copied from macOS) is that class
    named = {c: matching_class(c, classes) or c for c in scan.classes}
    unknown = [c for c in scan.classes if named[c] not in classes and not (no_leaf and c == NOT_A_LEAF)]
    if unknown:
        # PHOTOS/plants/<class>/...: the class folders are one level down
        below = [Path(scan.root) / c for c in unknown if _class_folders(Path(scan.root) / c, classes)]
        hint = (f"; {below[0]} holds folders named as the model's classes: point at it" if len(unknown) == 1 and below
                else "")
        raise EvaluationError(
            f"{scan.root}: folder(s) {', '.join(repr(c) for c in unknown)} name no class the model knows; "
            f"its classes are {', '.join(repr(c) for c in classes)} (rename the folder, or use the model "
            f"trained on those classes){hint}")
    left = {k: n for k, n in scan.ignored.items() if k in LEFT_OUT}
    if left:
        examples = scan.ignored_names()

        def which(kind: str, n: int) -> str:
            paths = examples.get(kind, [])
            return f" ({', '.join(paths)}{', ...' if n > len(paths) else ''})" if paths else ""
        print(f"note: left out of {scan.root}: "
              + ", ".join(f"{n} {LEFT_OUT[k]}{which(k, n)}" for k, n in left.items()), file=sys.stderr)
    index = {c: classes.index(named[c]) for c in scan.classes if named[c] in classes}
    labelled = [f for f in scan.files if f.split != UNLABELED and scan.classes[f.label] in index]
    unlabelled = sum(f.split == UNLABELED for f in scan.files)
    if unlabelled:
        print(f"note: {Path(scan.root) / UNLABELED} left out ({unlabelled} photo{'s' if unlabelled != 1 else ''}): "
              "photos without a label cannot be scored; to see what the model answers them: leaflens predict "
              f"{Path(scan.root) / UNLABELED} (they show the model's own classes, so --not-known, for photos of none "
              "of them, would count every right answer as a wrong one)", file=sys.stderr)
    return [f.path for f in labelled], np.array([index[scan.classes[f.label]] for f in labelled], np.int64)


def dataset_photo_files(ds: Any, split: str) -> tuple[Path, list[str]]:
    """The source folder a dataset split came from (as its manifest records it) and the original photo
    file of every row; :class:`PhotosUnavailable` when the folder or any file is no longer there."""
    root, paths = split_photo_paths(ds, split)
    if root is None:
        raise PhotosUnavailable(f"dataset {ds.root} does not record where the photos of split '{split}' came from")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        # a photo of --also (a correction, recorded by absolute path) is not under the source folder
        where = root if root == missing[0] or root in missing[0].parents else missing[0].parent
        raise PhotosUnavailable(f"{len(missing)} of the {len(paths)} original photos of split '{split}' are no "
                                f"longer in {where} (first: {missing[0]})")
    changed = changed_originals(ds, split, paths)
    if changed:  # the split's labels and figures are of the photos as they were
        raise PhotosUnavailable(changed_originals_message(split, paths, changed, from_arrays=False))
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
    answers = list(predictor.iter_predict_files(files, top_k=len(classes), batch_size=batch_size))
    refused = [RefusedPhoto(a.source, str(a.reason), str(a.error)) for a in answers if _refusal(a)]
    if refused:  # the few photos the app would turn away are measured all the same
        at = [i for i, a in enumerate(answers) if _refusal(a)]
        again = predictor.iter_predict_files([files[i] for i in at], top_k=len(classes), batch_size=batch_size,
                                             refuse=False)
        for i, answer in zip(at, again):
            answers[i] = answer
    rows, kept, unreadable = [], [], []
    verdicts = {"diagnosis": 0, "ambiguous": 0, "out_of_domain": 0}
    diagnosed_correct = 0
    for i, answer in enumerate(answers):
        if not answer.ok:
            unreadable.append(UnreadablePhoto(answer.source, str(answer.error)))
            continue
        row = np.zeros(len(classes))
        for name, prob in answer.top:
            row[column[name]] = prob
        rows.append(row)
        kept.append(i)
        verdicts[answer.verdict] += 1
        diagnosed_correct += answer.verdict == "diagnosis" and column[str(answer.label)] == labels[i]
    if not rows:
        raise NoPhotoReadable(f"{photos}: none of the {len(files)} photos could be read "
                              f"(first: {unreadable[0].error})")
    summary = metrics.evaluation_summary(np.stack(rows), labels[kept], classes)
    for row in summary["per_class"]:  # no photo of the class here: no figure (null in --json), as the console's n/a
        if row["support"] == 0:
            row.update(recall=None, f1=None, **({} if row.get("predicted") else {"precision": None}))
    return PhotoEvaluation(model=str(predictor.model_path), photos=photos, provider=predictor.provider,
                           classes=classes, unreadable=unreadable,
                           uncertain=verdicts["ambiguous"] + verdicts["out_of_domain"], summary=summary,
                           diagnosed=verdicts["diagnosis"], diagnosed_correct=int(diagnosed_correct),
                           ambiguous=verdicts["ambiguous"], out_of_domain=verdicts["out_of_domain"], refused=refused)


def _refusal(answer: Prediction) -> bool:
    """Whether the app turns this photo away before the model (``too_small`` comes from the decoder)."""
    return answer.verdict == "refused" or (not answer.ok and answer.reason in REFUSAL_REASONS)


def _class_folders(folder: Path, classes: Sequence[str]) -> list[str]:
    """The folders in ``folder`` named as one of ``classes``, sorted (none when it cannot be read)."""
    try:
        return sorted(d.name for d in folder.iterdir() if d.is_dir() and matching_class(d.name, classes))
    except OSError:
        return []


def evaluate_photos(model: str | os.PathLike[str] | Predictor, photos: str | os.PathLike[str],
                    threads: int | None = None, batch_size: int = 32,
                    not_known: str | os.PathLike[str] | None = None) -> PhotoEvaluation:
    """`leaflens evaluate`: the model file served by onnxruntime (or a loaded Predictor) on the class folders
    under ``photos`` (``not_known``: the --not-known folder, evaluated apart)."""
    predictor = model if isinstance(model, Predictor) else Predictor(model, intra_op_threads=threads)
    files, labels = class_folder_photos(photos, predictor.classes, not_known)
    if not files:
        raise EvaluationError(f"{photos}: no photos in its class folders")
    return evaluate_files(predictor, files, labels, str(Path(photos).resolve()), batch_size)


def evaluate_not_known(predictor: Predictor, folder: str | os.PathLike[str], batch_size: int = 32) -> dict[str, Any]:
    """What the model answers photos it has no business judging (other crops, insects, anything that is none
    of its classes), every image file under ``folder``: how many it calls "not a photo this model knows",
    "unsure", turns away before the model (too small, blank), or gives a diagnosis they should not get (and
    which). The app's own checks run as they do for a user."""
    from leaflens.apps.cmd_predict import collect_images  # noqa: PLC0415

    root = Path(folder)
    if not root.is_dir():
        raise EvaluationError(f"--not-known {folder}: not a folder")
    files = collect_images([root])
    if not files:
        raise EvaluationError(f"--not-known {folder}: no photos in it")
    own = _class_folders(root, predictor.classes)
    if own:  # the model's own classes: each right answer would be counted as a photo wrongly diagnosed
        print(f"warning: --not-known {folder} holds folders named as the model's classes ({', '.join(own[:5])}"
              f"{', ...' if len(own) > 5 else ''}): every photo in it counts as one of no class of the model, so if "
              "those are photos of its own classes, each right answer counts as a wrong diagnosis (another crop's "
              "photos sorted by condition are fine)", file=sys.stderr)
    if not predictor.has_ood:
        print(f"note: {predictor.model_path.name} has no out-of-domain check, so none of these photos can be called "
              "\"not a photo this model knows\"; export the model again (leaflens export) to add one",
              file=sys.stderr)
    counts = {"out_of_domain": 0, "ambiguous": 0, "refused": 0, "diagnosis": 0}
    diagnoses: Counter[str] = Counter()
    unreadable = []
    for answer in predictor.iter_predict_files(files, top_k=2, batch_size=batch_size):
        if _refusal(answer):
            counts["refused"] += 1
        elif not answer.ok:
            unreadable.append({"file": answer.source, "error": str(answer.error)})
        else:
            counts[answer.verdict] += 1
            if answer.verdict == "diagnosis":
                diagnoses[str(answer.label)] += 1
    n = sum(counts.values())
    return {"photos": str(root.resolve()), "n": n, **counts, "diagnosed_share": counts["diagnosis"] / n if n else 0.0,
            "diagnoses": dict(diagnoses.most_common()), "unreadable": unreadable}


def format_not_known(nk: dict[str, Any]) -> list[str]:
    """The --not-known lines of :func:`format_evaluation`."""
    n = max(int(nk["n"]), 1)
    given = ", ".join(f"{c} {k}" for c, k in nk["diagnoses"].items())
    rows = [("not a photo this model knows", nk["out_of_domain"]), ("unsure between classes", nk["ambiguous"]),
            ("turned away before the model", nk["refused"]), ("given a diagnosis", nk["diagnosis"])]
    lines = ["", f"photos of no class of the model: {nk['n']} in {nk['photos']}"]
    lines += [f"  {what:<30} {k:>6} ({k / n:.1%})" + (f": {given}" if what == "given a diagnosis" and given else "")
              for what, k in rows]
    if nk["unreadable"]:
        k = len(nk["unreadable"])
        lines.append(f"  {k} could not be read and {'is' if k == 1 else 'are'} not counted: "
                     + ", ".join(str(u["file"]) for u in nk["unreadable"][:5]) + (", ..." if k > 5 else ""))
    return lines


def format_evaluation(ev: PhotoEvaluation) -> str:
    """A readable report: accuracy, verdict counts, photos the app would refuse, per-class table, confusion
    matrix (rows = true), unreadable files."""
    s = ev.summary
    low, high = s["accuracy_ci"]
    width = max(display_width(c) for c in ev.classes) + 4
    right = f" ({ev.diagnosed_correct / ev.diagnosed:.1%} of them right)" if ev.diagnosed else ""
    lines = [f"{Path(ev.model).name} on {s['n']} photos in {ev.photos} ({ev.provider})",
             f"accuracy {s['accuracy']:.2%} ({s['correct']}/{s['n']}; {s['ci_level']:.0%} interval "
             f"{low:.1%}..{high:.1%}) of the top class on every readable photo",
             f"verdicts: {ev.diagnosed} diagnosis{right}, {ev.ambiguous} ambiguous, {ev.out_of_domain} out of domain"]
    if ev.refused:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(Counter(r.reason for r in ev.refused).items()))
        lines.append(f"{len(ev.refused)} photo(s) would be refused by the app's photo checks ({reasons}); "
                     "they are counted above as the model answered them")
    lines += ["",
             f"{'class':<{width}} {'photos':>7} {'precision':>9} {'recall':>7} {'F1':>6}"]
    for i, row in enumerate(s["per_class"]):
        if row["support"] == 0:  # no photo of it here: no recall; a precision only where the model named it
            precision = f"{row['precision']:>9.1%}" if row.get("predicted") else f"{'n/a':>9}"
            lines.append(f"{pad_right(f'{i} ' + row['class'], width)} {0:>7} {precision} {'n/a':>7} {'n/a':>6}")
            continue
        lines.append(f"{pad_right(f'{i} ' + row['class'], width)} {row['support']:>7} {row['precision']:>9.1%} "
                     f"{row['recall']:>7.1%} {row['f1']:>6.3f}")
    if s.get("macro_classes", len(ev.classes)) < len(ev.classes):
        lines.append(f"(macro figures average the {s['macro_classes']} classes with photos here, of "
                     f"{len(ev.classes)})")
    cm = s["confusion_matrix"]
    cell = max(4, max(len(str(v)) for r in cm for v in r) + 1)
    lines += ["", "confusion matrix (rows: true class, columns: predicted class, numbered as above)",
              " " * width + "".join(f"{j:>{cell}}" for j in range(len(ev.classes)))]
    for i, r in enumerate(cm):
        lines.append(pad_right(f"{i} {ev.classes[i]}", width) + "".join(f"{v:>{cell}}" for v in r))
    if ev.unreadable:
        lines += ["", f"{len(ev.unreadable)} photo(s) could not be read and are not counted:"]
        lines += [f"  {u.error}" for u in ev.unreadable[:20]]
        if len(ev.unreadable) > 20:
            lines.append(f"  ... and {len(ev.unreadable) - 20} more (see --json)")
    if ev.not_known is not None:
        lines += format_not_known(ev.not_known)
    return "\n".join(lines)

