"""A CNN teacher that the engine trains on the dataset itself, for users with no pretrained encoder.

It is the student's architecture made wider (and trained longer); its pooled embedding is the
feature vector and its classifier gives the logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.data_prep.contract import normalize
from leaflens.engine import Tensor, no_grad
from leaflens.pipeline.config import StageConfig
from leaflens.pipeline.models.student import StudentCNN, StudentSpec
from leaflens.pipeline.runs import load_student_weights
from leaflens.pipeline.train_student import TrainData, train_run
from leaflens.pipeline.training import BEST


class EngineCnnEncoder:
    def __init__(self, model: StudentCNN, mean: np.ndarray, std: np.ndarray, input_size: int,
                 widths: tuple[int, ...]):
        self.model = model.eval()
        self.mean, self.std = mean, std
        self.input_size = input_size
        self.feature_dim = model.embed_dim
        self.num_classes = model.classifier.out_features
        self.widths = widths

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with no_grad():
            e = self.model.embed(Tensor(normalize(images, self.mean, self.std)))
            logits = self.model.classifier(e)
        return e.numpy(), logits.numpy()

    def identity(self) -> dict[str, Any]:
        return {"kind": "train-cnn", "widths": list(self.widths), "params": self.model.num_parameters()}


def train_cnn_teacher(ds: Any, cfg: StageConfig, work_dir: Path, progress: bool = True,
                      resumable: bool = False) -> tuple[EngineCnnEncoder, dict[str, Any]]:
    """Train a wide CNN (``teacher.cnn_widths``, ``teacher.cnn_epochs``, the rest of ``[train]``) on the
    labelled train split, select on val, return it as an encoder. Training goes on from ``work_dir``'s
    ``last.npz`` when there is one (the stage checks it is this dataset's and recipe's); ``resumable``: a stop
    says --resume."""
    widths = cfg.teacher.cnn_widths
    # the teacher sees the images at the full stored size (input_size 0)
    tcfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, widths=widths, input_size=0),
                               train=dataclasses.replace(cfg.train, epochs=cfg.teacher.cnn_epochs))
    train = ds["train"]
    result = train_run(work_dir, tcfg, TrainData(train.images, np.asarray(train.labels)), ds["val"].images,
                       np.asarray(ds["val"].labels), ds.mean, ds.std, ds.num_classes, {"teacher": "train-cnn"},
                       label="teacher", progress=progress, resume=resumable, resumable=resumable)
    # every initial value is replaced by the checkpoint's weights: any generator will do
    model = StudentSpec.from_recipe(tcfg.model, ds.num_classes).build(np.random.default_rng(0))
    load_student_weights(model, Path(work_dir) / BEST)
    enc = EngineCnnEncoder(model, ds.mean, ds.std, ds.image_size, widths)
    return enc, {"val_accuracy": result.best_val_accuracy, "best_epoch": result.best_epoch,
                 "recipe": cnn_recipe(tcfg)}


def cnn_recipe(tcfg: StageConfig) -> dict[str, Any]:
    """What the CNN teacher trained with, for teacher.json's ``stage.recipe`` as the fine-tuned teacher records
    its own: its widths and epochs, and the [model] (but the widths and input size, set above), [train] and
    [augment] settings it shares with the students."""
    recipe: dict[str, Any] = {"teacher.cnn_widths": list(tcfg.model.widths), "teacher.cnn_epochs": tcfg.train.epochs}
    for section, record, leave_out in (("model", tcfg.model, {"widths", "input_size"}),
                                       ("train", tcfg.train, {"epochs"}), ("augment", tcfg.augment, set())):
        recipe.update({f"{section}.{k}": (list(v) if isinstance(v, tuple) else v)
                       for k, v in record.to_dict().items() if k not in leave_out})
    return recipe
