"""The teacher artefact: what `leaflens teacher` writes and `leaflens distill` reads.

A teacher folder holds ``teacher.json`` and, per split of the dataset, ``features_<split>.npy``
(N x D, float16 or float32, memory-mapped) and, when the teacher has a classifier for the
dataset's classes, ``logits_<split>.npy`` (N x C float32). ``teacher.json`` records the teacher's
identity, the feature dimension, how images were preprocessed for it, and the SHA-256 of the
dataset manifest the rows belong to: features of another dataset are refused. It is read and
written as a :class:`TeacherInfo` record; its ``format`` string carries the version. ``config.toml``
beside it, when present, is the resolved recipe the teacher was made with. A fine-tuned EfficientNet
teacher also leaves ``model.npz`` (the whole network) and, when it can be served, ``teacher.onnx``
(pipeline/teachers/served.py; ``stage.served`` in teacher.json says which).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np

from leaflens.data_prep.manifest import manifest_sha256
from leaflens.records import Record, RecordError

TEACHER_JSON = "teacher.json"
FORMAT: Final = "leaflens-teacher-1"


class TeacherError(ValueError):
    """A teacher folder that is missing, incomplete, or belongs to another dataset."""


@dataclass(frozen=True)
class ViewBankInfo(Record):
    """teacher.json's ``views``: how the bank of augmented views was drawn (pipeline/teachers/views.py)."""

    count: int                      # views per photo, view 0 the plain photo
    splits: tuple[str, ...]         # the splits that have a bank
    seed: int
    scale: tuple[float, float]      # area fraction range of the crops
    ratio: tuple[float, float]      # aspect ratio range of the crops
    hflip: bool
    vflip: bool
    region: str                     # what part of the photo a view box is relative to


@dataclass(frozen=True)
class TeacherInfo(Record):
    """teacher.json: what the teacher is and which dataset rows its features belong to."""

    format: Literal["leaflens-teacher-1"]
    teacher: dict[str, Any]         # the encoder's identity (kind, weights, preprocessing...)
    feature_dim: int
    num_classes: int | None         # None: features only, no logits
    classes: tuple[str, ...] | None
    input_size: int
    shorter_side: int | None
    from_arrays: bool
    dtype: Literal["float16", "float32"]  # of the stored features
    dataset_manifest_sha256: str
    dataset_root: str
    rows: dict[str, int]            # split -> rows
    views: ViewBankInfo | None = None
    stage: dict[str, Any] = field(default_factory=dict)  # what the teacher's maker recorded (fine-tune history...)
    seconds: float | None = None    # wall time of the teacher stage


@dataclass
class TeacherTargets:
    root: Path
    info: TeacherInfo
    features: dict[str, np.ndarray]
    logits: dict[str, np.ndarray]
    # split -> (view boxes (N, K, 6), features (N, K, D), logits (N, K, C) or None); see teacher_views.py
    views: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = field(default_factory=dict)

    @property
    def feature_dim(self) -> int:
        return self.info.feature_dim

    @property
    def has_logits(self) -> bool:
        return bool(self.logits)


def feature_paths(split: str) -> tuple[str, str]:
    return f"features_{split}.npy", f"logits_{split}.npy"


def read_teacher_info(path: Path) -> TeacherInfo:
    """Parse teacher.json, refusing another format or a key it does not know, by name."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TeacherError(f"{path} is not valid JSON: {exc}") from None
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise TeacherError(f"{path} has format {found!r}, expected {FORMAT!r}")
    try:
        return TeacherInfo.from_dict(data, str(path))
    except RecordError as exc:
        raise TeacherError(str(exc)) from None


def open_teacher_array(path: Path, shape: tuple[int, ...], why: str | None = None, *,
                       finite: bool = False) -> np.ndarray:
    """Memory-map one of a teacher folder's arrays, refusing a missing, unreadable or misshapen file by
    name (``why``: what says the file should be there), and with ``finite`` one holding NaN or inf."""
    if not path.is_file():
        raise TeacherError(f"{path} is missing" + (f" ({why})" if why else ""))
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise TeacherError(f"cannot read {path}: {exc}") from None
    if a.shape != shape:
        raise TeacherError(f"{path} has shape {a.shape}, expected {shape}")
    if finite and a.dtype.kind == "f":
        for start in range(0, len(a), _FINITE_ROWS):
            bad = ~np.isfinite(a[start:start + _FINITE_ROWS]).all(axis=tuple(range(1, a.ndim)))
            if bad.any():
                raise TeacherError(f"{path} holds NaN or infinite values (row {start + int(np.argmax(bad))}): the "
                                   "teacher that wrote it diverged, or the file was damaged; make the teacher "
                                   "again with `leaflens teacher`")
    return a


_FINITE_ROWS = 4096  # rows checked at a time: a memory-mapped array is never read whole into memory


def load_teacher(root: str | os.PathLike[str], dataset: Any) -> TeacherTargets:
    """Open a teacher folder for ``dataset`` (a data_prep Dataset), checking it belongs to it."""
    root = Path(root)
    meta_path = root / TEACHER_JSON
    if not meta_path.is_file():
        raise TeacherError(f"{meta_path} does not exist: run `leaflens teacher` first")
    info = read_teacher_info(meta_path)
    expected = manifest_sha256(dataset.root)
    if info.dataset_manifest_sha256 != expected:
        raise TeacherError(f"{root} holds features of another dataset (manifest checksum "
                           f"{info.dataset_manifest_sha256[:12]}... != {expected[:12]}... of "
                           f"{dataset.root}): recompute them with `leaflens teacher`")
    features, logits = {}, {}
    for split in dataset.splits:
        fname, lname = feature_paths(split)
        n = len(dataset[split])
        # the rows students train on may be poisoned: the training loop skips and logs their batches (README,
        # Reliability); validation and test rows feed the choice and the report, where a NaN has no remedy
        judged = split not in ("train", "unlabeled")
        features[split] = open_teacher_array(root / fname, (n, info.feature_dim), finite=judged)
        if info.num_classes:
            logits[split] = open_teacher_array(root / lname, (n, info.num_classes),
                                               "teacher.json says the teacher has logits", finite=judged)
    from leaflens.pipeline.teachers.views import load_view_bank  # noqa: PLC0415

    return TeacherTargets(root, info, features, logits, load_view_bank(root, dataset, info))
