"""The out-of-domain score: how unlike the training photos a photo looks to the model itself.

A classifier's confidence answers "which of my classes?", never "is this one of my photos at all?":
the demo model gave a blank image 89 % "healthy". So every exported model carries a second output,
``ood_score``, computed in the same pass from the statistics of its own feature maps:

1. for every conv block, the spatial mean and standard deviation of each channel (a summary of
   which textures and colours the block saw, and how strongly);
2. per block, the smallest Mahalanobis distance to the class means of the training photos
   (one covariance shared by the classes, shrunk towards its diagonal so that a few hundred photos
   estimate it stably), Lee et al. 2018;
3. each block's distance standardised by its mean and spread on the validation photos, and the
   blocks summed. Higher means further from anything seen in training.

A photo is out of domain when its score is above ``threshold``: the value that the validation
photos (in domain by construction, never trained on) exceed only ``budget`` of the time (default
2.5 %), so that share of genuine photos is what the check costs, known before shipping.

Why this score: measured side by side (benchmarks/ood.py, and on GENERATED negatives - shuffled
patches of training photos, colour-permuted photos, blobs, shapes, sinusoid textures - which is
what the choice was made on), it separated far better than the max softmax probability the app
used before, max logit or energy (AUROC 0.97 vs 0.45-0.60 on generated negatives for an iBeans
student), and than the same distance on the final embedding alone: early blocks see colour and
texture, which is what an insect, a digit or a blank differ in. It needs no extra training and
no photos but the user's own, and it is all matrix products the ONNX graph can carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from leaflens.apps.model_card import OODCheck
from leaflens.apps.predictor import OOD_OUTPUT
from leaflens.engine import Tensor, no_grad, ops
from leaflens.engine.nn import Module

__all__ = ["DEFAULT_BUDGET", "METHOD", "OOD_OUTPUT", "OODHead", "ServedModel", "block_stats",
           "fit_ood_head"]

METHOD = "block-mahalanobis-1"  # recorded in the model card; bump when the score's definition changes
DEFAULT_BUDGET = 0.025  # share of validation photos the out-of-domain check may flag (see AMBIGUOUS_BUDGET)
SHRINKAGE = 0.01  # covariance (of standardised statistics) + SHRINKAGE * identity
DEAD_SPREAD = 1e-3  # a statistic whose spread is under this share of its block's median one is left out
_EPS = 1e-6


def block_stats(block: Any) -> Any:
    """NHWC feature map -> ``[N, 2C]``: each channel's spatial mean, then its spatial standard deviation."""
    mean = block.mean(axis=(1, 2))
    centred = block - block.mean(axis=(1, 2), keepdims=True)
    std = ((centred * centred).mean(axis=(1, 2)) + _EPS) ** 0.5
    return ops.concatenate([mean, std], axis=1)


@dataclass
class _Block:
    means: np.ndarray  # [K, D] class means of the block statistics
    whiten: np.ndarray  # [D, D]: squared distance = ||(f - mean) @ whiten||^2
    offset: float  # validation mean of the distance
    scale: float  # validation standard deviation of the distance


class OODHead:
    """The fitted score: per block, the smallest whitened distance to a class mean, standardised, summed."""

    def __init__(self, blocks: Sequence[_Block]) -> None:
        self.blocks = list(blocks)

    def block_distances(self, stats: Sequence[np.ndarray]) -> np.ndarray:
        """``[N, n_blocks]`` raw distances (NumPy; the reference for the engine/ONNX version)."""
        out = []
        for b, f in zip(self.blocks, stats):
            diff = np.asarray(f, np.float64)[:, None, :] - b.means[None].astype(np.float64)
            d = ((diff @ b.whiten.astype(np.float64)) ** 2).sum(-1).min(1)
            out.append(d)
        return np.stack(out, 1)

    def score_numpy(self, stats: Sequence[np.ndarray]) -> np.ndarray:
        d = self.block_distances(stats)
        offset = np.array([b.offset for b in self.blocks])
        scale = np.array([b.scale for b in self.blocks])
        return ((d - offset) / scale).sum(1)

    def score(self, stats: Sequence[Any]) -> Any:
        """The same score with engine ops (exported into the graph as ``ood_score``)."""
        total = None
        for b, f in zip(self.blocks, stats):
            k, dim = b.means.shape
            diff = f.reshape(-1, 1, dim) - Tensor(b.means.astype(np.float32))
            w = diff @ Tensor(b.whiten.astype(np.float32))
            d = (w * w).sum(axis=2).min(axis=1)
            z = (d - float(b.offset)) * float(1.0 / b.scale)
            total = z if total is None else total + z
        return total


class ServedModel(Module):
    """What export writes to ONNX: the classifier's logits and the out-of-domain score, one pass."""

    def __init__(self, model: Module, head: OODHead) -> None:
        super().__init__()
        self.model = model
        self._head = head

    def forward(self, x: Any) -> tuple[Any, Any]:
        logits, blocks = self.model.forward_blocks(x)
        return logits, self._head.score([block_stats(b) for b in blocks])


def supports_ood(model: Module) -> bool:
    """Whether ``model`` exposes its block outputs (``forward_blocks``), which the score reads."""
    return callable(getattr(model, "forward_blocks", None))


def model_outputs(model: Module, images: Any, batch: int = 64) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits ``[N, K]``, per-block statistics) for float32 NHWC ``images`` already normalised."""
    logits, stats = [], []
    was = model.training
    model.eval()
    try:
        with no_grad():
            for i in range(0, len(images), batch):
                lg, blocks = model.forward_blocks(Tensor(np.ascontiguousarray(images[i:i + batch])))
                logits.append(np.asarray(lg.data))
                stats.append([np.asarray(block_stats(b).data) for b in blocks])
    finally:
        if was:
            model.train()
    return np.concatenate(logits), [np.concatenate(s) for s in zip(*stats)]


def _fit_block(train: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    f = np.asarray(train, np.float64)
    present = [c for c in range(k) if np.any(labels == c)]
    means = np.stack([f[labels == c].mean(0) if np.any(labels == c) else f.mean(0) for c in range(k)])
    centred = f - means[labels]
    spread = centred.std(0)
    # A statistic constant on every training photo up to float noise (a dead filter's: EfficientNet-Lite0's stem
    # has a few, whose output is their BatchNorm bias whatever the photo) carries nothing to measure a photo by,
    # and dividing by its spread would amplify float noise a millionfold (beyond float16; the engine and
    # onnxruntime far apart). It is left out: its whitening row is zero.
    live = spread > DEAD_SPREAD * np.median(spread)
    scale = np.where(live, spread + _EPS, np.inf)
    z = centred / scale
    cov = z.T @ z / max(1, len(z) - len(present)) + SHRINKAGE * np.eye(f.shape[1])
    chol = np.linalg.cholesky(np.linalg.inv(cov))  # precision = L L^T, distance = ||z @ L||^2
    return means, chol / scale[:, None]


def fit_ood_head(train_stats: Sequence[np.ndarray], train_labels: np.ndarray, val_stats: Sequence[np.ndarray],
                 num_classes: int, budget: float = DEFAULT_BUDGET) -> tuple[OODHead, OODCheck, np.ndarray]:
    """Fit the score on the training photos' block statistics, standardise and set the threshold on the
    validation photos'. Returns the head, the calibration record and the validation scores."""
    if not 0.0 < budget < 0.5:
        raise ValueError(f"out-of-domain budget is a share of validation photos in (0, 0.5), got {budget}")
    labels = np.asarray(train_labels).astype(np.int64)
    n_val = len(val_stats[0]) if val_stats else 0
    if n_val < 2:
        raise ValueError(f"the out-of-domain threshold needs validation photos, got {n_val}")
    blocks = []
    for tr, va in zip(train_stats, val_stats):
        means, whiten = _fit_block(tr, labels, num_classes)
        head = OODHead([_Block(means, whiten, 0.0, 1.0)])
        d = head.block_distances([va])[:, 0]
        blocks.append(_Block(means.astype(np.float32), whiten.astype(np.float32), float(d.mean()),
                             float(d.std() + _EPS)))
    head = OODHead(blocks)
    val_scores = head.score_numpy(val_stats)
    threshold = threshold_for(val_scores, budget)
    calib = OODCheck(method=METHOD, threshold=threshold, budget=float(budget), val_photos=n_val,
                     val_flagged=float(np.mean(val_scores > threshold)), train_photos=len(labels),
                     blocks=len(blocks))
    return head, calib, val_scores


def threshold_for(val_scores: np.ndarray, budget: float) -> float:
    """The smallest observed validation score that at most ``budget`` of the validation scores exceed
    (so the in-domain share flagged on validation is at most ``budget``, never more by rounding)."""
    s = np.sort(np.asarray(val_scores, np.float64))
    allowed = int(np.floor(budget * len(s)))
    return float(s[len(s) - 1 - allowed])


def split_stats(model: Module, images: Any, contract: Any, batch: int = 64) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits, per-block statistics) of ``model`` on uint8 stored-size ``images`` (memmaps welcome), each
    batch brought to the input size and normalised by the preprocessing ``contract`` as in serving."""
    logits, stats = [], []
    for i in range(0, len(images), batch):
        lg, st = model_outputs(model, contract.prepare(np.asarray(images[i:i + batch])), batch)
        logits.append(lg)
        stats.append(st)
    if not logits:
        raise ValueError("no images")
    return np.concatenate(logits), [np.concatenate(s) for s in zip(*stats)]


def fit_for_dataset(model: Module, ds: Any, contract: Any, num_classes: int, budget: float = DEFAULT_BUDGET,
                    batch: int = 64) -> tuple[OODHead, OODCheck, np.ndarray, np.ndarray]:
    """:func:`fit_ood_head` on a dataset's labelled training photos and its validation photos (the same
    numbers every time for the same model and data: distill reports them, export ships them). Returns the
    head, the check, and the validation photos' scores and logits."""
    for split in ("train", "val"):
        if split not in ds or len(ds[split]) == 0 or (split == "train" and ds[split].labels is None):
            raise ValueError(f"dataset {ds.root} has no labelled '{split}' photos to fit the out-of-domain check on")
    _, train = split_stats(model, ds["train"].images, contract, batch)
    val_logits, val = split_stats(model, ds["val"].images, contract, batch)
    head, check, scores = fit_ood_head(train, np.asarray(ds["train"].labels), val, num_classes, budget)
    return head, check, scores, val_logits
