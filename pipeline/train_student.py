"""One student training run: the student's model, data, loss and validation (:class:`StudentTask`), trained
by the pipeline's one training loop (:mod:`leaflens.pipeline.training`: steps, fault handling,
checkpoints, metrics, epoch selection, early stopping).

Used twice by `leaflens distill`: once learning from the teacher (feature + CE + KD loss, on the
labelled images and any unlabelled ones) and once from scratch (CE alone, labelled images only),
with the same recipe and seed, so that the gain from distillation is measured, never assumed; and by
the --train-cnn teacher. The teacher's targets are looked up by each batch's dataset rows.

Every epoch appends a line to ``metrics.jsonl`` and writes ``last.npz`` (model, optimiser,
scheduler, generator state, loader position, history: everything needed to resume exactly);
``best.npz`` holds the weights with the best validation accuracy so far (equal accuracies: the lower
validation loss).

``train.device`` ("auto": CUDA when a usable GPU is found) chooses where the model, the batches and
the teacher targets live; batches reach the GPU through ``leaflens.engine.device_loader.DeviceLoader``
(pinned memory, a copy stream, double buffering). ``train.mixed_precision`` ("auto": on with CUDA)
runs conv/linear in float16 under ``leaflens.engine.amp.autocast`` with float32 master weights and dynamic
loss scaling; a step skipped because its float16 gradients overflowed is counted in the metrics
(``amp_skipped_steps``), not reported as a fault. With device "cpu" and mixed precision off the
loop computes exactly what it computed before either existed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from leaflens.data_prep.contract import at_input_size, normalize
from leaflens.engine import Tensor, no_grad, ops
from leaflens.engine.backend import array_module, to_device
from leaflens.engine.data import ArrayDataset, Augment, Batch, DataLoader, apply_view_boxes
from leaflens.engine.device_loader import DeviceLoader, resolve_device
from leaflens.engine.nn import Module
from leaflens.engine.optim import SGD, AdamW, Optimizer, WarmupCosine
from leaflens.pipeline.config import DistillSection, StageConfig
from leaflens.pipeline.models.student import StudentCNN, StudentSpec
from leaflens.pipeline.negatives import make_negatives
from leaflens.pipeline.training import (
    BatchLoss,
    LoopSettings,
    RunResult,
    epochs_for_steps,
    run_training,
    validation_scores,
    warn_all_warmup,
)


class ConcatImages:
    """Row-wise concatenation of (memory-mapped) image arrays without copying them into memory."""

    def __init__(self, parts: list[np.ndarray]):
        if len({p.shape[1:] for p in parts}) != 1:
            raise ValueError(f"image arrays of different shapes cannot be combined: {[p.shape for p in parts]}")
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])
        self.shape = (int(self.offsets[-1]), *parts[0].shape[1:])
        self.dtype, self.ndim = parts[0].dtype, parts[0].ndim

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx)
        out = np.empty((len(idx), *self.shape[1:]), self.dtype)
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        for k, part in enumerate(self.parts):
            sel = which == k
            if sel.any():
                out[sel] = part[idx[sel] - self.offsets[k]]
        return out


@dataclass
class TrainData:
    """What a run trains on: images, labels (-1 = unlabelled) and optional teacher targets per row."""

    images: Any
    labels: np.ndarray
    features: np.ndarray | ConcatImages | None = None   # (N, D) teacher features, or None
    logits: np.ndarray | ConcatImages | None = None     # (N, C) teacher logits, or None
    # Teacher view bank (pipeline/teachers/views.py): the student is shown view v of a photo and learns
    # the teacher's targets for that view. (N, K, 6) boxes, (N, K, D) features, (N, K, C) logits.
    views: Any = None
    view_features: Any = None
    view_logits: Any = None
    # The teacher in the loop (pipeline/teachers/online.py): targets computed for each batch's own views;
    # ``features``/``logits`` above then only give the targets' shapes.
    online: Any = None
    # A fine-tuned teacher's network (its model.npz) whose stem and blocks a Lite0-trunk student starts from
    # (model.trunk_init = "teacher"); None: ImageNet's.
    trunk_from: Any = None


def student_input_size(cfg: StageConfig, image_size: int) -> int:
    """The side of the student's input for a dataset stored at ``image_size`` px: ``model.input_size``
    (0: the stored size), never more than the stored size (images are never blown up)."""
    want = cfg.model.input_size
    return image_size if want <= 0 else min(want, int(image_size))


def resolve_precision(setting: Any, device: str) -> bool:
    """Whether ``train.mixed_precision`` ("auto", "on", "off") means float16 compute on ``device``.

    "auto" is on with CUDA only: NumPy has no float16 BLAS, so on the CPU float16 is correct but slow.
    """
    s = ("on" if setting else "off") if isinstance(setting, bool) else str(setting).lower()
    if s == "auto":
        return device == "cuda"
    if s in ("on", "off"):
        return s == "on"
    raise ValueError(f"train.mixed_precision must be 'auto', 'on' or 'off', got {setting!r}")


def _model_device(model: Module) -> str:
    params = model.parameters()
    return params[0].device if params else "cpu"


def make_augment(cfg: StageConfig, colour_only: bool = False, out_size: int | None = None) -> Augment:
    """The loader's augmentation, its output ``out_size`` px (None: as stored); ``colour_only`` when the
    geometry comes from the teacher's view bank (the views are then cut at the input size later)."""
    a = cfg.augment
    crop = None if a.crop == "none" or colour_only else a.crop
    return Augment(hflip=a.hflip and not colour_only, vflip=a.vflip and not colour_only, crop=crop,
                   scale=a.scale, brightness=a.brightness, contrast=a.contrast,
                   out_size=None if colour_only else out_size)


def pick_views(data: TrainData, idx: np.ndarray, x: np.ndarray, seed: int, epoch: int, batch: int,
               out_size: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One teacher view per row (seeded by epoch and batch, so a resumed run repeats it): the batch cut
    to those views, and the teacher's features and logits for exactly those views."""
    k = data.views.shape[1]
    v = np.random.default_rng([seed, epoch, batch]).integers(0, k, len(idx))
    rows = np.arange(len(idx))
    boxes = np.asarray(data.views[idx])[rows, v]
    feats = np.asarray(data.view_features[idx])[rows, v]
    logits = None if data.view_logits is None else np.asarray(data.view_logits[idx])[rows, v]
    return apply_view_boxes(x, boxes, out_size), feats, logits


def predict_logits(model: Module, images: Any, mean: np.ndarray, std: np.ndarray, batch: int = 256,
                   size: int | None = None, crop: float | None = None) -> np.ndarray:
    """Logits for every row of a uint8 NHWC array, in eval mode, without recording a graph; the images
    are first cut to their centre ``crop`` share (None: whole) and area-downsampled to ``size`` px when they
    are stored larger. Cropping, resizing and normalising are the preprocessing contract's
    (leaflens.data_prep.contract), as the Predictor's are."""
    if crop is not None and size is None:
        raise ValueError("predict_logits: a centre crop needs the input size to resize the crop to")
    was_training = model.training
    model.eval()
    device = _model_device(model)
    out = []
    with no_grad():
        for i in range(0, len(images), batch):
            x = np.asarray(images[i:i + batch])
            # never in place: at its own size, x may be a view of the caller's float array
            x = normalize(x if size is None else at_input_size(x, size, crop), mean, std)
            out.append(model(Tensor(to_device(x, device))).numpy())
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def _l2n(a: Any) -> Any:
    """Rows scaled to unit length (NumPy or CuPy, float32)."""
    xp = array_module(a)
    a = a.astype(np.float32, copy=False)
    return a / xp.maximum(xp.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def _softmax(z: Any) -> Any:
    xp = array_module(z)
    z = z - z.max(axis=1, keepdims=True)
    e = xp.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _outlier_exposure(logits_neg: Any) -> Any:
    """Cross-entropy of the negatives' logits against the uniform distribution (logsumexp - mean)."""
    m = logits_neg.max(axis=1, keepdims=True).data
    lse = ops.log(ops.exp(logits_neg - m).sum(axis=1)) + m[:, 0]
    return (lse - logits_neg.mean(axis=1)).mean()


class Mix(NamedTuple):
    """A mixup draw for one batch: row ``i`` of the mixed batch is ``lam * row i + (1 - lam) * row perm[i]``."""

    perm: Any   # (B,) int64 row indices (on the batch's device once uploaded)
    lam: float  # the weight of the row's own image, drawn on the host


def mixup_batch(x: np.ndarray, alpha: float, rng: np.random.Generator) -> tuple[np.ndarray, Mix | None]:
    """Mix a (host) batch with a shuffled copy of itself, lam ~ Beta(alpha, alpha) once per batch
    (Zhang et al. 2018; with the teacher's targets mixed alike, Beyer et al. 2022). ``alpha`` 0 (or a
    batch of one row): the batch unchanged and no mix."""
    if alpha <= 0 or len(x) < 2:
        return x, None
    lam = float(rng.beta(alpha, alpha))
    perm = rng.permutation(len(x))
    mixed = (x * np.float32(lam) + x[perm] * np.float32(1.0 - lam)).astype(x.dtype, copy=False)
    return mixed, Mix(perm, lam)


def _mixed(a: Any, mix: Mix | None) -> Any:
    """Per-row targets mixed with the batch's own draw (unchanged without one)."""
    if mix is None:
        return a
    return a * np.float32(mix.lam) + a[mix.perm] * np.float32(1.0 - mix.lam)


def _cross_entropy(logits: Tensor, y: Any, label_smoothing: float, mix: Mix | None) -> Tensor:
    """Cross-entropy on the labelled rows (-1 ignored); for a mixed batch lam CE(y) + (1 - lam) CE(y[perm]),
    so a row is taught a label only in proportion to its labelled partners' share of its pixels."""
    ce = ops.cross_entropy(logits, y, label_smoothing=label_smoothing, ignore_index=-1)
    if mix is None:
        return ce
    other = ops.cross_entropy(logits, y[mix.perm], label_smoothing=label_smoothing, ignore_index=-1)
    return ce * float(mix.lam) + other * float(1.0 - mix.lam)


def distill_loss(model: StudentCNN, x: np.ndarray, y: np.ndarray, feats: np.ndarray | None,
                 tlogits: np.ndarray | None, dcfg: DistillSection,
                 label_smoothing: float, negatives: Any = None,
                 oe_weight: float = 0.0, any_labelled: bool | None = None,
                 mix: Mix | None = None, targets_mixed: bool = False) -> tuple[Tensor, dict[str, Any], np.ndarray]:
    """The batch loss, its parts (feature = 2 - 2 cos, cross-entropy on labelled rows, KD, outlier exposure
    on generated ``negatives``) and the logits of the batch.

    The parts are 0-d float32 arrays on the batch's device (``float()`` reads one), so a training step
    reads nothing from a GPU for its logging. ``any_labelled``: whether ``y`` has a row >= 0, when the
    caller knows it from the host (None: asked of ``y``, a synchronisation when ``y`` is on a GPU).
    ``mix``: the mixup draw ``x`` was mixed with (:func:`mixup_batch`); every target is mixed alike, except
    the teacher's when ``targets_mixed`` (a teacher in the loop judged the mixed images themselves).
    """
    parts: dict[str, Any] = {}
    labelled = bool((y >= 0).any()) if any_labelled is None else any_labelled
    n = len(x)
    inputs = Tensor(x) if negatives is None else Tensor(array_module(x).concatenate([x, negatives]))
    if feats is None:
        logits = model(inputs)
        neg = logits[n:] if negatives is not None else None
        logits = logits[:n] if negatives is not None else logits
        loss = _cross_entropy(logits, y, label_smoothing, mix)
        parts["ce"] = loss.data
        if neg is not None:
            oe = _outlier_exposure(neg)
            loss = loss + oe * float(oe_weight)
            parts["oe"] = oe.data
        return loss, parts, logits.data
    logits, proj = model.forward_with_projection(inputs)
    neg = None
    if negatives is not None:
        logits, neg, proj = logits[:n], logits[n:], proj[:n]
    tmix = None if targets_mixed else mix
    # a mixed target is the mix of the pair's unit features, made unit again (the loss is 2 - 2 cos)
    target = _l2n(feats) if tmix is None else _l2n(_mixed(_l2n(feats), tmix))
    diff = ops.l2_normalize(proj, axis=1) - target
    feat = (diff * diff).sum(axis=1).mean()
    loss = feat * float(dcfg.feature_weight)
    parts["feature"] = feat.data
    if labelled and dcfg.alpha:
        ce = _cross_entropy(logits, y, label_smoothing, mix)
        loss = loss + ce * float(dcfg.alpha)
        parts["ce"] = ce.data
    if tlogits is not None and dcfg.kd_weight:
        t = float(dcfg.temperature)
        soft = _mixed(_softmax(tlogits.astype(np.float32, copy=False) / t).astype(np.float32), tmix)
        kd = ops.cross_entropy(logits * (1.0 / t), soft) * (t * t)
        loss = loss + kd * float(dcfg.kd_weight)
        # log the KL divergence (cross-entropy minus the targets' constant entropy), which goes to 0
        xp = array_module(soft)
        entropy = -(soft * xp.log(xp.maximum(soft, 1e-12))).sum(axis=1).mean()
        # float64 on the device, as the host's Python floats computed it
        parts["kd"] = kd.data.astype(np.float64) - t * t * entropy.astype(np.float64)
    if neg is not None:
        oe = _outlier_exposure(neg)
        loss = loss + oe * float(oe_weight)
        parts["oe"] = oe.data
    return loss, parts, logits.data


def train_run(run_dir: str | os.PathLike[str], cfg: StageConfig, data: TrainData, val_images: Any,
              val_labels: np.ndarray, mean: np.ndarray, std: np.ndarray, num_classes: int,
              extra_meta: dict[str, Any], resume: bool = False, label: str = "student",
              progress: bool = True, resumable: bool = True) -> RunResult:
    """Train one student in ``run_dir`` with the pipeline's training loop (:mod:`leaflens.pipeline.training`);
    resumes from ``last.npz`` when ``resume`` and it exists. ``resumable``: whether the calling stage offers
    ``--resume`` (its messages after a stop say so)."""
    task, settings, device = student_run(cfg, data, val_images, val_labels, mean, std, num_classes, label=label,
                                         progress=progress, resumable=resumable)
    return run_training(run_dir, task, settings, extra_meta, resume=resume, device=device)


def student_run(cfg: StageConfig, data: TrainData, val_images: Any, val_labels: np.ndarray, mean: np.ndarray,
                std: np.ndarray, num_classes: int, label: str = "student", progress: bool = True,
                resumable: bool = True, device: str | None = None) -> tuple[StudentTask, LoopSettings, str]:
    """What :func:`train_run` trains: the task, the loop's settings and the device ("cpu"/"cuda").

    ``device``: where to train, already resolved (None: ``train.device`` resolved here);
    ``leaflens.pipeline.host_syncs`` passes "cuda" with the engine's counting stand-in for CuPy.
    """
    tcfg = cfg.train
    device = resolve_device(tcfg.device) if device is None else device
    use_amp = resolve_precision(tcfg.mixed_precision, device)
    seed = int(tcfg.seed)
    teacher_dim = None if data.features is None else int(data.features.shape[1])
    # The run's own generator, from the recipe's seed: the initial weights, then the dropout masks. Nothing
    # that ran earlier in the process can change them; checkpoints carry its state for an exact resume.
    model_rng = np.random.default_rng(seed)
    spec = StudentSpec.from_recipe(cfg.model, num_classes)
    model = spec.build(model_rng, teacher_dim, (tuple(map(float, mean)), tuple(map(float, std))) if spec.pretrained
                       else None, trunk_from=data.trunk_from)
    if tcfg.freeze_bn and spec.pretrained:
        model.freeze_trunk_batchnorm()
    if device != "cpu":
        model.to(device)  # before the optimiser and the checkpoint: their state follows the parameters
    dataset = ArrayDataset(data.images, data.labels)
    size = student_input_size(cfg, dataset.image_shape[0])
    augment = make_augment(cfg, colour_only=data.views is not None or data.online is not None, out_size=size)
    loader = DataLoader(dataset, int(tcfg.batch_size), shuffle=True, drop_last=len(dataset) > tcfg.batch_size,
                        seed=seed, mean=mean, std=std, augment=augment, prefetch=3, num_threads=1)
    epochs, steps_per_epoch = int(tcfg.epochs), len(loader)
    patience = int(tcfg.early_stopping_patience)
    raised = epochs_for_steps(epochs, steps_per_epoch, int(tcfg.min_steps))
    if raised > epochs:
        patience = -(-patience * raised // epochs)  # the same share of the run without a better epoch
        print(f"note: {label}: {len(dataset)} training photos make {steps_per_epoch} step"
              f"{'s' if steps_per_epoch > 1 else ''} an epoch; it trains {raised} epochs instead of {epochs} "
              f"(early stopping after {patience} without a better one) to take at least train.min_steps = "
              f"{tcfg.min_steps} steps (--set train.min_steps=0: as given)", file=sys.stderr, flush=True)
        epochs = raised
    warn_all_warmup("train.warmup_epochs", int(tcfg.warmup_epochs), epochs, label)
    opt: Optimizer
    if tcfg.optimizer == "adamw":
        opt = AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    elif tcfg.optimizer == "sgd":
        opt = SGD(model.parameters(), lr=tcfg.lr, momentum=0.9, nesterov=True, weight_decay=tcfg.weight_decay)
    else:
        raise ValueError(f"train.optimizer must be 'adamw' or 'sgd', got {tcfg.optimizer!r}")
    sched = WarmupCosine(opt, total_steps=max(epochs * steps_per_epoch, 1),
                         warmup_steps=min(int(tcfg.warmup_epochs) * steps_per_epoch, epochs * steps_per_epoch))
    task = StudentTask(model, opt, sched, {"model": model_rng}, loader, DeviceLoader(loader, device), data, cfg,
                       size, val_images, val_labels, mean, std)
    settings = LoopSettings(epochs=epochs, clip_grad_norm=float(tcfg.clip_grad_norm),
                            max_bad_steps=int(tcfg.max_bad_steps),
                            early_stopping_patience=patience, mixed_precision=use_amp,
                            label=label, resumable=resumable, progress=progress,
                            ema_decay=float(tcfg.ema))
    return task, settings, device


class StudentTask:
    """The student's half of a run (:class:`leaflens.pipeline.training.TrainingTask`): loader batches with
    the teacher's targets looked up by their dataset rows, the distillation loss, validation at the
    model's input size."""

    def __init__(self, model: StudentCNN, optimizer: Any, scheduler: Any, generators: dict[str, np.random.Generator],
                 loader: DataLoader, device_loader: DeviceLoader, data: TrainData, cfg: StageConfig, size: int,
                 val_images: Any, val_labels: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
        self.model, self.optimizer, self.scheduler, self.generators = model, optimizer, scheduler, generators
        self.loader, self.device_loader, self.data, self.cfg, self.size = loader, device_loader, data, cfg, size
        self.val_images, self.val_labels, self.mean, self.std = val_images, val_labels, mean, std
        self.steps_per_epoch = len(loader)

    def batches(self, epoch: int) -> Iterator[StudentBatch]:
        if self.loader.epoch != epoch:  # a restored position inside ``epoch`` is kept
            self.loader.set_epoch(epoch)
        seed = self.loader.seed
        # Host side (teacher targets looked up by the batch's dataset rows, views), then on to the device.
        oe = float(self.cfg.train.outlier_exposure)
        mixup = float(self.cfg.distill.mixup)
        a = self.cfg.augment
        view_aug = Augment(hflip=a.hflip, vflip=a.vflip, crop=None if a.crop == "none" else a.crop, scale=a.scale)
        host = (_host_batch(self.data, batch, seed, epoch, self.size, oe > 0, mixup, self.mean, self.std, view_aug)
                for batch in self.loader)
        return self.device_loader.upload(host)

    def batch_loss(self, batch: StudentBatch) -> BatchLoss:
        loss, parts, logits = distill_loss(self.model, batch.images, batch.labels, batch.features, batch.logits,
                                           self.cfg.distill, self.cfg.train.label_smoothing, batch.negatives,
                                           self.cfg.train.outlier_exposure, batch.any_labelled,
                                           None if batch.mix_perm is None else Mix(batch.mix_perm, batch.mix_lam),
                                           batch.targets_mixed)
        return BatchLoss(loss, logits, parts)

    def validate(self) -> tuple[float, float]:
        logits = predict_logits(self.model, self.val_images, self.mean, self.std,
                                int(self.cfg.train.eval_batch_size), self.size)
        return validation_scores(logits, self.val_labels)

    def position(self, epoch: int) -> dict[str, Any]:
        self.loader.set_epoch(epoch)
        return self.loader.state_dict()

    def restore_position(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class StudentBatch(NamedTuple):
    """A loader batch with the teacher's targets for its rows (None without a teacher)."""

    images: Any
    labels: Any
    features: Any
    logits: Any
    indices: np.ndarray  # dataset rows: stay on the host (DeviceLoader leaves ``indices`` alone)
    number: int          # the batch's position in its epoch
    negatives: Any = None  # generated negatives for outlier exposure (leaflens.pipeline.negatives)
    any_labelled: bool | None = None  # whether a row has a label >= 0, known on the host (None: ask ``labels``)
    mix_perm: Any = None   # mixup: the partner row of each row (None: the batch is not mixed)
    mix_lam: float = 1.0   # mixup: the weight of each row's own image
    targets_mixed: bool = False  # the teacher's targets are already those of the mixed images (teacher online)


def _host_batch(data: TrainData, batch: Batch, seed: int, epoch: int, size: int,
                negatives: bool = False, mixup: float = 0.0, mean: Any = None, std: Any = None,
                view_aug: Augment | None = None) -> StudentBatch:
    """A loader batch with its teacher targets looked up on the host by the batch's dataset rows
    (cut to the teacher's views when there is a bank), mixed when ``mixup`` > 0 (the draw travels
    with the batch: the loss mixes the targets of those very views alike). With the teacher online
    (pipeline/teachers/online.py) the batch is cut to one fresh view per row (``view_aug``) at the student's
    size and at the teacher's, both mixed alike, and the teacher judges the mixed views themselves."""
    x, idx, online = batch.images, batch.indices, data.online
    feats = tl = None
    xt: Any = None  # the teacher's view of each row (teacher online)
    if online is not None:
        from leaflens.pipeline.teachers.online import view_boxes  # noqa: PLC0415

        if mean is None or std is None or view_aug is None:
            raise ValueError("a batch for the teacher in the loop needs the dataset's mean and std and the view recipe")
        boxes = view_boxes(len(idx), view_aug, seed, epoch, batch.number)
        x, xt = apply_view_boxes(np.asarray(x), boxes, size), online.teacher_views(np.asarray(x), mean, std, boxes)
    else:
        feats = None if data.features is None else np.asarray(data.features[idx])
        tl = None if data.logits is None else np.asarray(data.logits[idx])
        if data.views is not None:
            x, feats, tl = pick_views(data, idx, x, seed, epoch, batch.number, size)
    neg = None
    if negatives:  # a generator per (seed, epoch, batch): a resumed run draws the same negatives
        rng = np.random.default_rng([seed, epoch, batch.number, 0x0E])
        neg = make_negatives(np.asarray(x), max(1, len(x) // 2), rng)
    any_labelled = bool((np.asarray(batch.labels) >= 0).any())  # on the host here: no device read later
    # its own generator per (seed, epoch, batch), like the negatives': a resumed run mixes alike
    x, mix = mixup_batch(np.asarray(x), mixup, np.random.default_rng([seed, epoch, batch.number, 0x31]))
    if online is not None:
        xt = xt if mix is None else xt * np.float32(mix.lam) + xt[mix.perm] * np.float32(1.0 - mix.lam)
        feats, tl = online(xt)
        tl = tl if data.logits is not None else None
    return StudentBatch(x, batch.labels, feats, tl, idx, batch.number, neg, any_labelled,
                        None if mix is None else mix.perm, 1.0 if mix is None else mix.lam,
                        targets_mixed=online is not None)
