"""The teacher artefact: what `leaflens teacher` writes and `leaflens distill` reads.

A teacher folder holds ``teacher.json`` and, per split of the dataset, ``features_<split>.npy``
(N x D, float16 or float32, memory-mapped) and, when the teacher has a classifier for the
dataset's classes, ``logits_<split>.npy`` (N x C float32). ``teacher.json`` records the teacher's
identity, the feature dimension, how images were preprocessed for it, and the SHA-256 of the
dataset manifest the rows belong to: features of another dataset are refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.data_prep.manifest import manifest_sha256

TEACHER_JSON = "teacher.json"
FORMAT = "leaflens-teacher-1"


class TeacherError(ValueError):
    """A teacher folder that is missing, incomplete, or belongs to another dataset."""


@dataclass
class TeacherTargets:
    root: Path
    info: dict[str, Any]
    features: dict[str, np.ndarray]
    logits: dict[str, np.ndarray]
    # split -> (view boxes (N, K, 6), features (N, K, D), logits (N, K, C) or None); see teacher_views.py
    views: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = field(default_factory=dict)

    @property
    def feature_dim(self) -> int:
        return int(self.info["feature_dim"])

    @property
    def has_logits(self) -> bool:
        return bool(self.logits)


def feature_paths(split: str) -> tuple[str, str]:
    return f"features_{split}.npy", f"logits_{split}.npy"


def load_teacher(root: str | os.PathLike[str], dataset: Any) -> TeacherTargets:
    """Open a teacher folder for ``dataset`` (a data_prep Dataset), checking it belongs to it."""
    root = Path(root)
    meta_path = root / TEACHER_JSON
    if not meta_path.is_file():
        raise TeacherError(f"{meta_path} does not exist: run `leaflens teacher` first")
    try:
        info = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TeacherError(f"{meta_path} is not valid JSON: {exc}") from None
    if info.get("format") != FORMAT:
        raise TeacherError(f"{meta_path} has format {info.get('format')!r}, expected {FORMAT!r}")
    expected = manifest_sha256(dataset.root)
    if info.get("dataset_manifest_sha256") != expected:
        raise TeacherError(f"{root} holds features of another dataset (manifest checksum "
                           f"{str(info.get('dataset_manifest_sha256'))[:12]}... != {expected[:12]}... of "
                           f"{dataset.root}): recompute them with `leaflens teacher`")
    features, logits = {}, {}
    for split in dataset.splits:
        fname, lname = feature_paths(split)
        n = len(dataset[split])
        fpath = root / fname
        if not fpath.is_file():
            raise TeacherError(f"{fpath} is missing")
        try:
            f = np.load(fpath, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise TeacherError(f"cannot read {fpath}: {exc}") from None
        if f.ndim != 2 or f.shape[0] != n or f.shape[1] != int(info["feature_dim"]):
            raise TeacherError(f"{fpath} has shape {f.shape}, expected ({n}, {info['feature_dim']})")
        features[split] = f
        lpath = root / lname
        if info.get("num_classes"):
            if not lpath.is_file():
                raise TeacherError(f"{lpath} is missing (teacher.json says the teacher has logits)")
            lg = np.load(lpath, mmap_mode="r", allow_pickle=False)
            if lg.shape != (n, int(info["num_classes"])):
                raise TeacherError(f"{lpath} has shape {lg.shape}, expected ({n}, {info['num_classes']})")
            logits[split] = lg
    from leaflens.pipeline.teachers.views import load_view_bank  # noqa: PLC0415

    return TeacherTargets(root, info, features, logits, load_view_bank(root, dataset, info))
