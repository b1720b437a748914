"""The EfficientNet teacher's fine-tune on fresh views: a new random-resized crop of every training photo
each epoch (``teacher.augment = "rrc"``).

Cached front outputs (pipeline/teachers/effnet.py, ``"cached"``) give the trained blocks only the two
views of each photo computed once, and a network trained on few photos learns those by heart: at 25 % of
the iBeans labels that teacher reached 82.8 % test where the same network fine-tuned in full on fresh
crops reached 91.4 %. Here each epoch every training photo is cut again (area fraction
``teacher.rrc_scale``, random aspect ratio, mirrored at random when ``teacher.mirror``) from the photo
decoded at twice the teacher's input (or from the stored array), resized to the input, passed through the
frozen front (onnxruntime, :class:`~leaflens.pipeline.teachers.effnet.FrontRunner`) and then through the
trained part in the engine. Validation runs on the plain val photos as the stage encodes them (shorter side
to 256/224 of the input, centre crop). The training itself is the pipeline's one loop
(:mod:`leaflens.pipeline.training`).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.data_prep.decode import decode_image_at
from leaflens.engine import Tensor, no_grad, ops
from leaflens.engine.data import Augment, apply_view_boxes, sample_view_boxes
from leaflens.engine.nn import Module, freeze_batchnorm, set_dropout_generator
from leaflens.engine.optim import AdamW, WarmupCosine
from leaflens.pipeline.config import TeacherSection
from leaflens.pipeline.models.efficientnet import normalize_images
from leaflens.pipeline.teachers.stage import (
    TeacherStageError,
    changed_originals,
    changed_originals_message,
    iter_split_images,
    missing_originals_message,
    split_photo_paths,
)
from leaflens.pipeline.training import BatchLoss, epochs_for_steps, validation_scores

# Decoded photos are kept in memory up to this many bytes (full iBeans at 160 px: 320 MB); beyond it
# every epoch decodes them again.
PHOTO_CACHE_BYTES = 1 << 30


def optimizer_groups(back: Module, teacher: TeacherSection) -> list[dict[str, Any]]:
    """The pretrained layers at ``teacher.lr``, the new classifier (``back.fc``) at ``teacher.head_lr``."""
    head = {id(p) for p in back.fc.parameters()}
    return [{"params": [p for p in back.parameters() if id(p) not in head], "lr": teacher.lr},
            {"params": list(back.fc.parameters()), "lr": teacher.head_lr}]


class PhotoViews:
    """The photos of a split as random-resized crops at ``size``: cut from the original photo decoded at
    ``2 * size`` (whole shorter side, the dataset's crop rule), or from the stored arrays with
    ``from_arrays`` or when the stored size is already at least that."""

    def __init__(self, ds: Any, split: str, size: int, from_arrays: bool, workers: int = 2):
        self.size, self.workers = size, workers
        self.source_side = 2 * size
        self.arrays = ds[split].images
        n = len(self.arrays)
        self.paths: list[Path] | None = None
        if not from_arrays and ds.image_size < self.source_side:
            src, paths = split_photo_paths(ds, split)
            if src is None or not src.is_dir():
                raise TeacherStageError(
                    f"the original photos of split '{split}' are not at {src}: the teacher's fresh crops are cut "
                    f"from them. Pass --from-arrays to cut them from the stored {ds.image_size}x{ds.image_size} "
                    "arrays instead, or set teacher.augment = \"cached\".")
            self.paths = paths
            missing = [p for p in self.paths if not p.is_file()]
            if missing:
                raise TeacherStageError(missing_originals_message(split, missing))
            changed = changed_originals(ds, split, self.paths, workers)
            if changed:
                raise TeacherStageError(changed_originals_message(split, self.paths, changed))
        self.resize = ds.manifest.resize
        side = self.source_side
        self.cache: np.ndarray | None = None
        self.cached = np.zeros(n, bool)
        if self.paths is not None and n * side * side * 3 <= PHOTO_CACHE_BYTES:
            self.cache = np.empty((n, side, side, 3), np.uint8)

    def __len__(self) -> int:
        return len(self.arrays)

    def _decode(self, row: int) -> np.ndarray:
        assert self.paths is not None
        return decode_image_at(self.paths[row], self.source_side, self.resize, shorter_side=self.source_side)

    def photos(self, rows: np.ndarray) -> np.ndarray:
        """uint8 (B, S, S, 3) source photos of ``rows``."""
        if self.paths is None:
            return np.stack([np.asarray(self.arrays[int(r)]) for r in rows])
        if self.cache is None:
            with ThreadPoolExecutor(self.workers) as pool:
                return np.stack(list(pool.map(self._decode, [int(r) for r in rows])))
        todo = [int(r) for r in rows if not self.cached[r]]
        if todo:
            with ThreadPoolExecutor(self.workers) as pool:
                for r, im in zip(todo, pool.map(self._decode, todo)):
                    self.cache[r] = im
            self.cached[todo] = True
        return self.cache[rows]

    def views(self, rows: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """float32 (B, size, size, 3) in 0..255: view ``boxes[i]`` (a row of ``sample_view_boxes``) of photo
        ``rows[i]``."""
        return apply_view_boxes(self.photos(rows), boxes, out_size=self.size)


class FreshViewBatch:
    """Front outputs of fresh views of some train photos, with their labels and rows."""

    __slots__ = ("inputs", "labels", "indices", "number")

    def __init__(self, inputs: np.ndarray, labels: np.ndarray, indices: np.ndarray, number: int):
        self.inputs, self.labels, self.indices, self.number = inputs, labels, indices, number


def logits_of(front: Any, back: Module, images: np.ndarray, normalization: str, batch: int) -> np.ndarray:
    """The logits of uint8 ``images`` through the frozen ``front`` and ``back`` (eval mode), ``batch`` at a time."""
    back.eval()
    out = []
    with no_grad():
        for i in range(0, len(images), batch):
            h = front(normalize_images(images[i:i + batch], normalization)).astype(np.float32)
            out.append(back(Tensor(h)).numpy())
    return np.concatenate(out) if out else np.zeros((0, back.fc.out_features), np.float32)


class PseudoPhotos:
    """Unlabelled photos with the teacher's labels (self-training): ``rows`` of ``photos``' split, ``labels``."""

    __slots__ = ("photos", "rows", "labels")

    def __init__(self, photos: PhotoViews, rows: np.ndarray, labels: np.ndarray):
        self.photos, self.rows, self.labels = photos, np.asarray(rows, np.int64), np.asarray(labels, np.int64)


class FreshViewTask:
    """The fine-tune as a :class:`leaflens.pipeline.training.TrainingTask`: batches of fresh views of the train
    split through the frozen ``front``, the trained ``back`` (BatchNorm frozen when ``teacher.freeze_bn``),
    cross-entropy with label smoothing, AdamW with discriminative learning rates, warm-up then cosine per
    step. Its generators (batch order, crops, dropout) come from ``teacher.seed`` (and ``stream``: the
    self-training round draws streams of its own).

    With ``pseudo`` (self-training) the pseudo-labelled unlabelled photos join the train photos: task row
    ``i`` is train row ``i`` below ``len(train)``, else unlabelled row ``pseudo.rows[i - len(train)]``."""

    def __init__(self, front: Any, back: Module, ds: Any, teacher: TeacherSection, normalization: str,
                 from_arrays: bool, shorter_side: int, photos: PhotoViews | None = None,
                 pseudo: PseudoPhotos | None = None, stream: int = 0) -> None:
        self.front, self.model, self.teacher, self.normalization = front, back, teacher, normalization
        self.photos = photos or PhotoViews(ds, "train", teacher.input_size, from_arrays)
        self.labels = np.asarray(ds["train"].labels, np.int64)
        self.num_train, self.pseudo = len(self.labels), pseudo
        if pseudo is not None:
            self.labels = np.concatenate([self.labels, pseudo.labels])
        self.val_labels = np.asarray(ds["val"].labels, np.int64)
        size = teacher.input_size
        self.val_images = np.concatenate(list(iter_split_images(ds, "val", size, shorter_side,
                                                                teacher.encode_batch_size, from_arrays)))
        self.augment = Augment(hflip=teacher.mirror, vflip=False, crop="resized", scale=teacher.rrc_scale,
                               brightness=0.0, contrast=0.0)
        freeze_batchnorm(back, teacher.freeze_bn)
        self.optimizer = AdamW(optimizer_groups(back, teacher), lr=teacher.lr, weight_decay=teacher.weight_decay)
        self.steps_per_epoch = max(len(self.labels) // teacher.batch_size, 1)
        total = teacher.epochs * self.steps_per_epoch
        self.scheduler = WarmupCosine(self.optimizer, total_steps=max(total, 1),
                                      warmup_steps=min(teacher.warmup_epochs * self.steps_per_epoch, total))
        seeds: list[Any] = ([teacher.seed, [teacher.seed, 1], [teacher.seed, 2]] if stream == 0 else
                            [[teacher.seed, 100 * stream + j] for j in range(3)])
        self.order_rng = np.random.default_rng(seeds[0])
        self.view_rng = np.random.default_rng(seeds[1])
        dropout_rng = np.random.default_rng(seeds[2])
        set_dropout_generator(back, dropout_rng)
        self.generators = {"batches": self.order_rng, "views": self.view_rng, "dropout": dropout_rng}

    def batches(self, epoch: int) -> Iterator[FreshViewBatch]:
        n, size = len(self.labels), self.teacher.batch_size
        order = self.order_rng.permutation(n)
        boxes = sample_view_boxes(n, 2, self.augment, self.view_rng)[:, 1]  # view 0 would be the plain photo
        for s in range(self.steps_per_epoch):
            idx = order[s * size:(s + 1) * size]
            x = normalize_images(self._views(idx, boxes[idx]), self.normalization)
            yield FreshViewBatch(self.front(x).astype(np.float32), self.labels[idx], idx, s)

    def _views(self, idx: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        if self.pseudo is None:
            return self.photos.views(idx, boxes)
        size = self.teacher.input_size
        out = np.empty((len(idx), size, size, 3), np.float32)
        labelled = idx < self.num_train
        if labelled.any():
            out[labelled] = self.photos.views(idx[labelled], boxes[labelled])
        if not labelled.all():
            rows = self.pseudo.rows[idx[~labelled] - self.num_train]
            out[~labelled] = self.pseudo.photos.views(rows, boxes[~labelled])
        return out

    def batch_loss(self, batch: FreshViewBatch) -> BatchLoss:
        logits = self.model(Tensor(batch.inputs))
        loss = ops.cross_entropy(logits, batch.labels, label_smoothing=self.teacher.label_smoothing)
        return BatchLoss(loss, logits.data)

    def validate(self) -> tuple[float, float]:
        logits = logits_of(self.front, self.model, self.val_images, self.normalization, self.teacher.encode_batch_size)
        return validation_scores(logits, self.val_labels)

    def position(self, epoch: int) -> dict[str, Any]:
        # The batch order and the crops live in the generators, which the checkpoint saves.
        return {"num_samples": len(self.labels), "batch_size": self.teacher.batch_size, "augment": "rrc",
                "pseudo_labelled": len(self.labels) - self.num_train}

    def restore_position(self, state: dict[str, Any]) -> None:
        mine = self.position(0)
        if state != mine:
            raise ValueError(f"fine-tune state is for {state}, this run has {mine}")


def epochs_for(teacher: TeacherSection, num_train: int) -> int:
    """The first fine-tune's epochs for ``num_train`` labelled photos: ``teacher.epochs``, raised until the run
    takes at least ``teacher.min_steps`` optimiser steps.

    With few labels an epoch is a handful of steps (42 photos at batch 16: 2), too few for the new classifier
    and the blocks to learn the task; measured on validation (README), 14 iBeans photos per class reached 77 %
    in 8 epochs and 83 % in 64."""
    return epochs_for_steps(teacher.epochs, num_train // teacher.batch_size, teacher.min_steps)


def recipe_record(teacher: TeacherSection) -> dict[str, Any]:
    """What teacher.json records of the fine-tune recipe: the whole ``[teacher]`` section."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in teacher.to_dict().items()}
