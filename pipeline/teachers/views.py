"""A bank of teacher targets on augmented views: "a good teacher is patient and consistent".

Distillation works best when the teacher judges exactly the image the student is shown (function
matching, Beyer et al. 2022). Running the teacher inside the student's training loop is out of
reach on a CPU, so the teacher is run once on ``K`` augmented views of every training (and
unlabelled) photo, and the student, each time it meets a photo, is shown one of those ``K`` views
and learns the teacher's features and logits for that very view.

A view is a resolution-free box plus flips (``leaflens.engine.data.sample_view_boxes``); the teacher cuts it
from the photo decoded at its own resolution, over the same region the student's array covers
(the whole shorter side: no ImageNet-style inner crop, or the views would not line up), and the
student cuts it from its stored array. View 0 is the plain image.

Files next to ``teacher.json`` for each split in ``VIEW_SPLITS`` the dataset has:
``views_<split>.npy`` (N, K, 6) boxes, ``features_views_<split>.npy`` (N, K, D) and, when the
teacher has logits, ``logits_views_<split>.npy`` (N, K, C).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from leaflens.data_prep.arrays import NpyRowWriter
from leaflens.engine.data import Augment, apply_view_boxes, sample_view_boxes
from leaflens.pipeline.teachers.artefact import TeacherError, TeacherInfo, ViewBankInfo, open_teacher_array

VIEW_SPLITS = ("train", "unlabeled")


def view_paths(split: str) -> tuple[str, str, str]:
    return f"views_{split}.npy", f"features_views_{split}.npy", f"logits_views_{split}.npy"


def view_augment(scale: tuple[float, float], hflip: bool = True, vflip: bool = True) -> Augment:
    """Random-resized crops of area fraction ``scale`` (the recipe's ``teacher.view_scale``) and flips: the
    geometric part of the student's augmentation (colour jitter stays with the student)."""
    return Augment(hflip=hflip, vflip=vflip, crop="resized", scale=scale, brightness=0.0, contrast=0.0)


def write_view_bank(out: Path, ds: Any, encoder: Any, views: int, aug: Augment, seed: int, batch: int,
                    from_arrays: bool, dtype: Any, progress: bool) -> ViewBankInfo:
    """Encode ``views`` views of every row of the view splits into ``out``; returns teacher.json's entry.

    ``encoder`` must look at pixels (``encode(uint8 images)``): precomputed features cannot be
    re-run on new views.
    """
    from leaflens.pipeline.teachers.stage import TeacherStageError, iter_split_images  # noqa: PLC0415 - avoids a cycle

    if views < 2:
        raise ValueError(f"a view bank needs at least 2 views (view 0 is the plain image), got {views}")
    if encoder is None or not getattr(encoder, "sees_images", True):
        raise TeacherStageError("--views needs a teacher that can look at images; precomputed features "
                                "(--features) cannot be recomputed on augmented views")
    splits = [s for s in VIEW_SPLITS if s in ds.splits and len(ds[s])]
    size = int(encoder.input_size)
    bar = tqdm(total=sum(len(ds[s]) for s in splits) * views, desc=f"teacher: {views} views per photo",
               unit="img", disable=None if progress else True)
    for si, split in enumerate(splits):
        n = len(ds[split])
        boxes = sample_view_boxes(n, views, aug, np.random.default_rng([seed, si]))
        bname, fname, lname = view_paths(split)
        np.save(out / bname, boxes, allow_pickle=False)
        row = 0
        with (NpyRowWriter(out / fname, n, (views, encoder.feature_dim), dtype) as fw,
              NpyRowWriter(out / lname, n, (views, encoder.num_classes), np.float32) if encoder.num_classes
              else nullcontext() as lw):
            # shorter_side=size: the whole shorter side, the region the student's array covers
            for chunk in iter_split_images(ds, split, size, size, batch, from_arrays):
                m = len(chunk)
                feats = np.empty((m, views, encoder.feature_dim), np.float32)
                logits = np.empty((m, views, encoder.num_classes or 0), np.float32)
                for v in range(views):
                    imgs = chunk if v == 0 else np.clip(
                        np.rint(apply_view_boxes(chunk, boxes[row:row + m, v])), 0, 255).astype(np.uint8)
                    f, lg = encoder.encode(imgs)
                    feats[:, v] = f
                    if lw is not None:
                        logits[:, v] = lg
                    bar.update(m)
                fw.write(feats)
                if lw is not None:
                    lw.write(logits)
                row += m
    bar.close()
    return ViewBankInfo(count=views, splits=tuple(splits), seed=seed, scale=aug.scale, ratio=aug.ratio,
                        hflip=aug.hflip, vflip=aug.vflip, region="whole shorter side (as the student's arrays)")


def load_view_bank(root: Path, ds: Any, info: TeacherInfo) -> dict[str, tuple[np.ndarray, np.ndarray,
                                                                              np.ndarray | None]]:
    """``{split: (boxes, features, logits or None)}`` memory-mapped, shapes checked against the dataset."""
    meta = info.views
    if meta is None:
        return {}
    k, dim, classes = meta.count, info.feature_dim, info.num_classes
    bank = {}
    for split in meta.splits:
        if split not in ds.splits:
            raise TeacherError(f"{root}: teacher.json lists views for split '{split}', which the dataset lacks")
        n = len(ds[split])
        arrays: list[Any] = []  # boxes, features, logits (None without logits)
        for name, shape in zip(view_paths(split), ((n, k, 6), (n, k, dim), (n, k, classes or 0))):
            if name.startswith("logits") and not classes:
                arrays.append(None)
                continue
            arrays.append(open_teacher_array(root / name, shape, f"teacher.json says the teacher has {k} views"))
        bank[split] = (arrays[0], arrays[1], arrays[2])
    return bank
