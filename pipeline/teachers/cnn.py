"""A CNN teacher that the engine trains on the dataset itself, for users with no pretrained encoder.

It is the student's architecture made wider (and trained longer); its pooled embedding is the
feature vector and its classifier gives the logits.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.engine import Tensor, no_grad
from leaflens.engine.data import normalize
from leaflens.pipeline.models.student import StudentCNN
from leaflens.pipeline.runs import load_student_weights
from leaflens.pipeline.train_student import BEST, TrainData, build_student, train_run


class EngineCnnEncoder:
    def __init__(self, model: StudentCNN, mean: np.ndarray, std: np.ndarray, input_size: int, widths: list[int]):
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
        return {"kind": "train-cnn", "widths": self.widths, "params": self.model.num_parameters()}


def train_cnn_teacher(ds: Any, cfg: dict[str, Any], work_dir: Path, widths: list[int], epochs: int,
                      progress: bool = True) -> tuple[EngineCnnEncoder, dict[str, Any]]:
    """Train a wide CNN on the labelled train split, select on val, return it as an encoder."""
    tcfg = copy.deepcopy(cfg)
    tcfg["model"]["widths"] = widths
    tcfg["model"]["input_size"] = 0  # the teacher sees the images at the full stored size
    tcfg["train"]["epochs"] = epochs
    train = ds["train"]
    result = train_run(work_dir, tcfg, TrainData(train.images, np.asarray(train.labels)), ds["val"].images,
                       np.asarray(ds["val"].labels), ds.mean, ds.std, ds.num_classes, {"teacher": "train-cnn"},
                       label="teacher", progress=progress)
    model = build_student(tcfg, ds.num_classes, None)
    load_student_weights(model, Path(work_dir) / BEST)
    enc = EngineCnnEncoder(model, ds.mean, ds.std, ds.image_size, widths)
    return enc, {"val_accuracy": result.best_val_accuracy, "best_epoch": result.best_epoch}
