"""The out-of-domain score: how unlike the training photos a photo looks to the model itself.

A classifier's confidence answers "which of my classes?", never "is this one of my photos at all?":
the demo model gave a blank image 89 % "healthy". So every exported model carries a second output,
``ood_score``, computed in the same pass from the statistics of its own feature maps:

1. for every conv block, the spatial mean and standard deviation of each channel (a summary of
   which textures and colours the block saw, and how strongly); the blocks are the model's own and, since
   ``block-mahalanobis-2``, those of a frozen generic-feature branch (:class:`GenericBranch`: the first
   :data:`GENERIC_BLOCKS` blocks of ImageNet EfficientNet-Lite0 on the same input);
2. per block, the smallest Mahalanobis distance to the class means of the training photos
   (one covariance shared by the classes, shrunk towards its diagonal so that a few hundred photos
   estimate it stably), Lee et al. 2018;
3. each block's distance standardised by its mean and spread on the validation photos, and the
   blocks summed. Higher means further from anything seen in training.

A photo is out of domain when its score is above ``threshold``, chosen on the validation photos (in
domain by construction, never trained on) so that at most ``budget`` of genuine NEW photos (default 3 %)
score above it, with probability ``confidence`` (default 0.9) over the draw of the validation photos: the
threshold sits above all but ``k`` of them, ``k`` the largest count for which that holds
(:func:`leaflens.apps.model_card.flag_confidence`; with 133 validation photos, k = 1). The threshold
used to let the budget's share of the validation photos themselves through; the share of new photos
above such an order statistic averages (k+1)/(n+1), more than the budget, and scatters widely on a
few hundred photos (iBeans: 2.3 % of validation, 5.5 % of test photos).

Why this score: measured side by side (benchmarks/ood.py, and on GENERATED negatives - shuffled
patches of training photos, colour-permuted photos, blobs, shapes, sinusoid textures - which is
what the choice was made on), it separated far better than the max softmax probability the app
used before, max logit or energy (AUROC 0.97 vs 0.45-0.60 on generated negatives for an iBeans
student), and than the same distance on the final embedding alone: early blocks see colour and
texture, which is what an insect, a digit or a blank differ in. It needs no extra training and
no photos but the user's own, and it is all matrix products the ONNX graph can carry.

Why the branch: a 64 px student trained from scratch on a thousand photos learns only what tells its
classes apart, and its maps hardly react to what none of them has; the first blocks of a network trained
on ImageNet are generic colour, texture and part detectors (pretrained features make near out-of-domain
photos separable, Fort et al. 2021). Its length was chosen on validation photos and generated negatives
only (``benchmarks/ood.py --branch-sweep``, iBeans student: AUROC on generated negatives 0.973 without the
branch, 0.984 with 5 blocks, 0.985 with 11, 0.984 with all 16): 5 blocks, 55,504 parameters. Without the
Lite0 weights (``leaflens[teacher]`` not installed) the export falls back to the model's own blocks
(``block-mahalanobis-1``) and says so; a model that is itself the Lite0 teacher needs no branch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.apps.model_card import OODBranch, OODCheck, flag_confidence
from leaflens.apps.predictor import OOD_OUTPUT
from leaflens.engine import Tensor, no_grad, ops
from leaflens.engine.nn import Module, Sequential
from leaflens.pipeline.models.efficientnet import tf_input_affine

__all__ = ["DEFAULT_BUDGET", "DEFAULT_CONFIDENCE", "GENERIC_BLOCKS", "METHOD", "METHOD_OWN", "OOD_OUTPUT",
           "GenericBranch", "OODHead", "ServedModel", "WithGenericBranch", "block_stats", "fit_ood_head",
           "flags_allowed", "generic_branch", "photos_for_confidence", "timing_stand_in", "with_generic_branch"]

# Recorded in the model card; bump when the score's definition changes. METHOD: the model's own blocks and the
# generic branch's; METHOD_OWN: the model's own blocks alone (a model exported without the branch, or the
# EfficientNet-Lite0 teacher, whose own blocks are the generic features).
METHOD = "block-mahalanobis-2"
METHOD_OWN = "block-mahalanobis-1"
GENERIC_BLOCKS = 5  # EfficientNet-Lite0 blocks run by the generic branch (chosen on generated negatives)
DEFAULT_BUDGET = 0.03  # share of genuine new photos the out-of-domain check may flag (see AMBIGUOUS_BUDGET)
DEFAULT_CONFIDENCE = 0.9  # ... with this probability over the draw of the validation photos
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
    """What export writes to ONNX: the classifier's logits and the out-of-domain score, one pass. A
    :class:`WithGenericBranch` is unwrapped so that the graph's node names stay ``/model/...`` for the
    classifier (as before the branch existed) and ``/branch/...`` for the branch."""

    def __init__(self, model: Module, head: OODHead) -> None:
        super().__init__()
        if isinstance(model, WithGenericBranch):
            self.model: Module = model.model
            self.branch: GenericBranch | None = model.branch
        else:
            self.model, self.branch = model, None
        self._head = head

    def forward(self, x: Any) -> tuple[Any, Any]:
        logits, blocks = self.model.forward_blocks(x)
        if self.branch is not None:
            blocks = [*blocks, *self.branch.maps(x)]
        return logits, self._head.score([block_stats(b) for b in blocks])


class GenericBranch(Module):
    """The first ``blocks`` blocks of an ImageNet-pretrained EfficientNet-Lite0, frozen, run on the served
    model's own input: generic colour, texture and object-part detectors beside the model's own blocks.

    A small student trained from scratch on a few hundred photos learns only what tells its classes apart;
    its feature maps barely react to what none of them has (an insect's legs, a digit's strokes). Features
    learnt on ImageNet separate near out-of-domain photos far better (Fort et al. 2021). The model's input
    is normalised by its own mean and std; Lite0 expects (pixel - 127) / 128, so a per-channel affine undoes
    one into the other inside the graph. Its maps (:meth:`maps`) are the stem's (before its ReLU6) and the
    output of the last block of every stage among the first ``blocks``, and of the last block run: as
    :meth:`EfficientNetLite.forward_blocks` reads the whole network's, each before a clipping activation.
    """

    def __init__(self, net: Any, blocks: int, mean: Sequence[float], std: Sequence[float], source: str) -> None:
        super().__init__()
        if not 1 <= blocks <= net.num_blocks:
            raise ValueError(f"the generic branch runs 1 to {net.num_blocks} EfficientNet-Lite0 blocks, got {blocks}")
        if net.config.normalization != "tf":
            raise ValueError("the generic branch expects Lite0 weights normalised 'tf', got "
                             f"{net.config.normalization!r}")
        self.stem_conv, self.stem_bn = net.stem_conv, net.stem_bn
        self.blocks = Sequential(*list(net.blocks)[:blocks])
        self.source = source
        ends = [i for i in net.stage_ends() if i < blocks]
        self.ends = sorted({*ends, blocks - 1})
        self._scale, self._shift = tf_input_affine(mean, std)
        self.eval()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def maps(self, x: Any) -> list[Any]:
        """The branch's feature maps for the served model's normalised NHWC input ``x``."""
        h = x * Tensor(self._scale) + Tensor(self._shift)
        pre = self.stem_bn(self.stem_conv(h))
        h = ops.relu6(pre)
        out = [pre]
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i in self.ends:
                out.append(h)
        return out

    def forward(self, x: Any) -> Any:
        return self.maps(x)

    def record(self) -> OODBranch:
        """What the model card says about the branch."""
        return OODBranch(kind="efficientnet-lite0-imagenet", blocks=self.num_blocks, maps=len(self.ends) + 1,
                         params=int(self.num_parameters()), weights=Path(self.source).name)


class WithGenericBranch(Module):
    """A classifier whose ``forward_blocks`` also gives the generic branch's maps, after its own: what the
    score is fitted on and exported from. ``forward`` is the classifier's alone."""

    def __init__(self, model: Module, branch: GenericBranch) -> None:
        super().__init__()
        self.model = model
        self.branch = branch

    def forward(self, x: Any) -> Any:
        return self.model(x)

    def forward_blocks(self, x: Any) -> tuple[Any, list[Any]]:
        logits, blocks = self.model.forward_blocks(x)
        return logits, [*blocks, *self.branch.maps(x)]


def generic_branch(mean: Sequence[float], std: Sequence[float], blocks: int = GENERIC_BLOCKS,
                   weights: str | os.PathLike[str] | None = None) -> tuple[GenericBranch | None, str | None]:
    """The generic branch for a model normalised by ``mean``/``std`` (pixel/255 scale), from the
    EfficientNet-Lite0 weights the teacher stage uses (``weights`` None: the installed package's), or
    (None, why) when they cannot be found or read: the score then falls back to the model's own blocks."""
    from leaflens.pipeline.models.efficientnet import LiteConfig  # noqa: PLC0415
    from leaflens.pipeline.models.pretrained import find_lite0_weights, load_efficientnet_lite0  # noqa: PLC0415
    from leaflens.pipeline.models.torch_weights import UnsafeCheckpointError  # noqa: PLC0415

    try:
        path = find_lite0_weights(weights)
        net = load_efficientnet_lite0(path, LiteConfig(padding="same", bn_eps=1e-3, normalization="tf"))
    except (OSError, ValueError, KeyError, UnsafeCheckpointError) as exc:  # WeightsNotFoundError: an OSError
        return None, f"{type(exc).__name__}: {exc}"
    return GenericBranch(net, min(blocks, net.num_blocks), mean, std, str(path)), None


def with_generic_branch(model: Module, mean: Sequence[float], std: Sequence[float], blocks: int = GENERIC_BLOCKS,
                        weights: str | os.PathLike[str] | None = None) -> tuple[Module, str | None]:
    """What the score of ``model`` is fitted on and exported from: ``model`` with the generic branch
    (:class:`WithGenericBranch`), or, when the EfficientNet-Lite0 weights cannot be found or read, ``model``
    alone (today's score, :data:`METHOD_OWN`) and a sentence saying why, for the export log and report.
    The pretrained trunk student gets the branch too: its Lite0 blocks are fine-tuned, the branch's stay
    ImageNet's (on generated negatives, iBeans lite8: AUROC 0.983 without, 0.987 with; `--branch-sweep`)."""
    branch, why = generic_branch(mean, std, blocks, weights)
    if branch is None:
        return model, (f"the out-of-domain score reads the model's own blocks only ({METHOD_OWN}): the "
                       f"EfficientNet-Lite0 weights of its generic branch are not available ({why})")
    return WithGenericBranch(model, branch), None


def timing_stand_in(model: Module, input_size: int, branch: bool = True,
                    weights: str | os.PathLike[str] | None = None) -> Module:
    """``model`` as it is served with its out-of-domain score, for timing it (leaflens.pipeline.selection): with
    the generic branch when ``branch`` (export gives a student one, the Lite0 teacher reads its own blocks),
    and a head of the fitted one's shapes whose numbers are placeholders (the time does not depend on them).
    ``model`` itself when it exposes no block outputs (it is served without the score). ``weights``: the
    branch's Lite0 weights (default: the installed ones). The stand-in, ``model`` with it, is left in eval mode,
    as served: the caller puts back ``model``'s own."""
    if not supports_ood(model):
        return model
    scored = with_generic_branch(model, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), weights=weights)[0] if branch else model
    logits, stats = model_outputs(scored, np.zeros((1, input_size, input_size, 3), np.float32))
    k = logits.shape[1]
    head = OODHead([_Block(np.zeros((k, f.shape[1]), np.float32), np.eye(f.shape[1], dtype=np.float32), 0.0, 1.0)
                    for f in stats])
    return ServedModel(scored, head).eval()


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
                 num_classes: int, budget: float = DEFAULT_BUDGET, branch: OODBranch | None = None,
                 confidence: float = DEFAULT_CONFIDENCE) -> tuple[OODHead, OODCheck, np.ndarray]:
    """Fit the score on the training photos' block statistics, standardise it and set the threshold on the
    validation photos' (:func:`threshold_for`). ``branch``: the generic branch whose maps are among the
    statistics (recorded; the method is then :data:`METHOD`, else :data:`METHOD_OWN`). Returns the head, the
    calibration record and the validation scores."""
    if not 0.0 < budget < 0.5:
        raise ValueError(f"out-of-domain budget is a share of genuine photos in (0, 0.5), got {budget}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"out-of-domain confidence must be in (0, 1), got {confidence}")
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
    threshold = threshold_for(val_scores, budget, confidence)
    calib = OODCheck(method=METHOD if branch is not None else METHOD_OWN, threshold=threshold, budget=float(budget),
                     val_photos=n_val, val_flagged=float(np.mean(val_scores > threshold)), train_photos=len(labels),
                     blocks=len(blocks), branch=branch, confidence=float(confidence))
    # the file (its card, Triton's config) says the confidence that holds, as the console and the Model tab do:
    # at least the one asked, or less with too few validation photos for it
    if 0.0 < calib.achieved_confidence < 1.0:
        calib = replace(calib, confidence=calib.achieved_confidence)
    return head, calib, val_scores


def flags_allowed(n: int, budget: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """How many of ``n`` validation scores a threshold may leave above it so that at most ``budget`` of new
    in-domain photos score above it with probability ``confidence``: the largest such count, or 0 (a
    threshold above every validation score, which then holds with less confidence) when ``n`` is too small
    for any (fewer than 76 photos at 3 % and 0.9)."""
    k = 0
    while k + 1 < n and flag_confidence(n, k + 1, budget) >= confidence:
        k += 1
    return k


def photos_for_confidence(budget: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """The fewest validation photos with which a threshold above all of them holds ``budget`` with
    ``confidence`` (``1 - (1 - budget)^n >= confidence``): 76 at 3 % and 0.9."""
    return math.ceil(math.log1p(-confidence) / math.log1p(-budget))


def threshold_for(val_scores: np.ndarray, budget: float, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """The threshold above all but :func:`flags_allowed` of the validation scores: halfway between the highest
    score kept and the lowest one flagged, so that a file computing the same scores with float rounding (the
    FP32 ONNX graph, 1e-5 apart) flags the same photos; a hair above the highest score when none is flagged."""
    s = np.sort(np.asarray(val_scores, np.float64))
    allowed = flags_allowed(len(s), budget, confidence)
    kept = s[len(s) - 1 - allowed]
    if allowed == 0:
        return float(kept + 1e-4 * (1.0 + abs(kept)))
    return float(kept + (s[len(s) - allowed] - kept) / 2.0)


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
                    batch: int = 64, confidence: float = DEFAULT_CONFIDENCE
                    ) -> tuple[OODHead, OODCheck, np.ndarray, np.ndarray]:
    """:func:`fit_ood_head` on a dataset's labelled training photos and its validation photos (the same
    numbers every time for the same model and data: distill reports them, export ships them); ``model`` a
    :class:`WithGenericBranch` to fit the branch's maps too. Returns the
    head, the check, and the validation photos' scores and logits."""
    for split in ("train", "val"):
        if split not in ds or len(ds[split]) == 0 or (split == "train" and ds[split].labels is None):
            raise ValueError(f"dataset {ds.root} has no labelled '{split}' photos to fit the out-of-domain check on")
    _, train = split_stats(model, ds["train"].images, contract, batch)
    val_logits, val = split_stats(model, ds["val"].images, contract, batch)
    branch = model.branch.record() if isinstance(model, WithGenericBranch) else None
    head, check, scores = fit_ood_head(train, np.asarray(ds["train"].labels), val, num_classes, budget, branch,
                                       confidence)
    return head, check, scores, val_logits
