"""The default teacher: ImageNet EfficientNet-Lite0, fine-tuned on the dataset by the engine.

Frozen ImageNet features are weaker on leaf photos than a small CNN trained from scratch (measured:
iBeans linear probe 87.5 % vs about 95 %), and a teacher weaker than its student teaches nothing.
So by default the teacher first learns the task. The network is cut before block ``k``
(``teacher.finetune_from_block``): the front (stem + blocks before ``k``) keeps its ImageNet weights and
runs in onnxruntime, the back (the other blocks, the head conv and a new classifier) is trained. By default
(``teacher.augment = "rrc"``, pipeline/teachers/finetune.py) every epoch shows each training photo as a
fresh random-resized crop, through the front and then the back. With ``"cached"`` the front runs once per
image and its output is cached (plain and mirrored views of the training photos), and the back is trained
on that cache (fast, but it learns two views per photo by heart). Either way with a low learning rate for the
pretrained layers and a higher one for the new classifier, by the pipeline's one training loop
(:mod:`leaflens.pipeline.training`, as the student: the epoch kept is the best on the validation split
by accuracy, then loss; non-finite steps are counted, logged and stop the run after a limit), BatchNorm
statistics frozen unless ``teacher.freeze_bn = false``. With unlabelled photos it then self-trains on those it
labels confidently (``teacher.self_train``, pipeline/teachers/self_train.py). The fine-tuned network then gives
every split's features (1280-d) and logits. The recipe (cut point, input size, augmentation, epochs, learning rates...)
is the ``[teacher]`` section of the stage config, recorded whole in teacher.json (``stage.recipe``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from leaflens.engine import Tensor, no_grad, ops
from leaflens.engine.checkpoint import load_checkpoint
from leaflens.engine.nn import freeze_batchnorm, set_dropout_generator
from leaflens.engine.optim import AdamW, WarmupCosine
from leaflens.pipeline.config import TeacherSection
from leaflens.pipeline.models.efficientnet import EfficientNetLite, LiteConfig, normalize_images
from leaflens.pipeline.models.pretrained import find_lite0_weights, load_efficientnet_lite0
from leaflens.pipeline.teachers.finetune import (
    FreshViewTask,
    PhotoViews,
    PseudoPhotos,
    epochs_for,
    logits_of,
    optimizer_groups,
    recipe_record,
)
from leaflens.pipeline.teachers.self_train import PseudoLabels, RunFineTune, run_self_training
from leaflens.pipeline.teachers.stage import ArrayEncoder, TeacherSettingError, iter_split_images
from leaflens.pipeline.training import BEST, BatchLoss, LoopSettings, run_training, validation_scores, warn_all_warmup


def shorter_side(size: int) -> int:
    """The classic ImageNet evaluation crop: shorter side to 256/224 of the input size, then centre crop."""
    return round(size * 256 / 224)


class FrontRunner:
    """The frozen front, run by onnxruntime on the graph our exporter makes of it (several times faster
    than the NumPy engine at 224x224); the engine itself when onnxruntime is not installed."""

    def __init__(self, front: Any, input_size: int):
        self.front = front
        self.input_size = input_size
        self.session = None
        try:
            import onnxruntime as ort  # noqa: PLC0415

            from leaflens.engine.onnx_export import export_onnx  # noqa: PLC0415
        except ImportError:
            return
        graph = export_onnx(front, (3, input_size, input_size), output_name="front")
        self.session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])

    @property
    def backend(self) -> str:
        return "onnxruntime" if self.session is not None else "engine"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Normalised NHWC float32 -> NHWC front output."""
        if self.session is None:
            with no_grad():
                return self.front(Tensor(x)).numpy()
        (h,) = self.session.run(None, {"input": np.ascontiguousarray(x.transpose(0, 3, 1, 2))})
        return h.transpose(0, 2, 3, 1)


def _run_front(front: FrontRunner, ds: Any, split: str, normalization: str, batch: int, from_arrays: bool,
               mirror: bool, bar: tqdm) -> tuple[np.ndarray, np.ndarray | None]:
    """Front outputs (N, h, w, c) float16 for a split, and for its mirrored images when asked."""
    plain, flipped = [], []
    size = front.input_size
    for chunk in iter_split_images(ds, split, size, shorter_side(size), batch, from_arrays):
        x = normalize_images(chunk, normalization)
        plain.append(front(x).astype(np.float16))
        if mirror:
            flipped.append(front(np.ascontiguousarray(x[:, :, ::-1])).astype(np.float16))
        bar.update(len(chunk))
    return np.concatenate(plain), (np.concatenate(flipped) if mirror else None)


def _back_outputs(back: Any, h: np.ndarray, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    feats, logits = [], []
    back.eval()
    with no_grad():
        for i in range(0, len(h), batch):
            lg, f = back.forward_with_features(Tensor(h[i:i + batch].astype(np.float32)))
            feats.append(f.numpy())
            logits.append(lg.numpy())
    return np.concatenate(feats), np.concatenate(logits)


class EffnetImageEncoder:
    """The teacher as a function of pixels (front in onnxruntime, back in the engine): for view banks."""

    sees_images = True

    def __init__(self, front: FrontRunner, back: Any, normalization: str, feature_dim: int,
                 num_classes: int | None, fp16_front: bool = True):
        self.front, self.back, self.normalization = front, back, normalization
        self.input_size, self.feature_dim, self.num_classes = front.input_size, feature_dim, num_classes
        self.fp16_front = fp16_front  # round the front's output as the cached mode's cache holds it

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        h = self.front(normalize_images(images, self.normalization))
        feats, logits = _back_outputs(self.back, h.astype(np.float16) if self.fp16_front else h)
        return feats, (logits if self.num_classes else None)


def build_effnet_teacher(ds: Any, teacher: TeacherSection, weights_file: str | Path | None = None,
                         from_arrays: bool = False, progress: bool = True, max_bad_steps: int = 10,
                         work_dir: str | Path | None = None) -> tuple[ArrayEncoder, dict]:
    """The EfficientNet-Lite0 teacher for ``ds``, fine-tuned by the ``[teacher]`` recipe unless it says
    ``frozen`` (or the dataset has no labelled train split); ``weights_file`` None: the installed weights.

    The fine-tune stops after ``max_bad_steps`` consecutive non-finite steps (the recipe's
    ``train.max_bad_steps``); its checkpoints and metrics go to ``work_dir`` (None: a temporary folder). A
    ``work_dir`` that holds an interrupted fine-tune's checkpoints (``last.npz``, each round's) is continued
    from them: the caller makes sure they are this dataset's and recipe's (pipeline/teachers/stage.py).
    """
    cfg = LiteConfig(padding="same", bn_eps=1e-3, normalization="tf", dropout=teacher.dropout)
    weights = find_lite0_weights(weights_file)
    net: EfficientNetLite = load_efficientnet_lite0(weights, cfg)
    frozen = teacher.frozen or "train" not in ds or ds["train"].labels is None
    k = teacher.finetune_from_block
    if k > net.num_blocks:
        raise TeacherSettingError(f"teacher.finetune_from_block = {k}, but EfficientNet-Lite0 has {net.num_blocks} "
                                f"blocks: use 0 (every block trains) to {net.num_blocks} (only the head)")
    raised_from = None
    if not frozen:
        teacher, raised_from = _enough_steps(teacher, len(ds["train"]))
        # A generator of its own from the recipe's seed, not a stream shared with whatever ran before in this
        # process: the new head's initial weights alone moved the fine-tuned teacher's iBeans test accuracy
        # by several points.
        net.reset_classifier(ds.num_classes, np.random.default_rng(teacher.seed))
    front_module, back = net.split(k)
    size = teacher.input_size
    front = FrontRunner(front_module.eval(), size)
    if not frozen and teacher.augment == "rrc":
        fresh = _fresh_view_teacher(net, front, back, ds, teacher, weights, cfg, from_arrays, progress,
                                    max_bad_steps, work_dir)
        if raised_from is not None:
            fresh[1]["epochs_raised_from"] = raised_from
        return fresh
    t0 = time.perf_counter()
    mirror = teacher.mirror and not frozen
    total = sum(len(ds[s]) * (2 if (s == "train" and mirror) else 1) for s in ds.splits)
    bar = tqdm(total=total, desc=f"teacher: EfficientNet-Lite0 blocks 0-{k - 1} (frozen)", unit="img",
               disable=None if progress else True)
    fronts: dict[str, np.ndarray] = {}
    mirrored = None
    for split in ds.splits:
        fronts[split], m = _run_front(front, ds, split, cfg.normalization, teacher.encode_batch_size, from_arrays,
                                      mirror=(split == "train" and mirror), bar=bar)
        if m is not None:
            mirrored = m
    bar.close()
    front_seconds = time.perf_counter() - t0
    extra: dict[str, Any] = {"weights": str(weights), "config": cfg.to_dict(), "split_block": k,
                             "front_backend": front.backend,
                             "front_seconds": round(front_seconds, 1), "fine_tuned": not frozen}
    if not frozen:
        extra["recipe"] = recipe_record(teacher)
        if raised_from is not None:
            extra["epochs_raised_from"] = raised_from
    identity = _identity(weights, not frozen, k, size, cfg)
    if frozen:
        feats = {s: _back_outputs(back, h)[0] for s, h in fronts.items()}
        enc = ArrayEncoder(feats, None, weights, ds.image_size, identity)
    else:
        with contextlib.ExitStack() as stack:
            where = Path(work_dir) if work_dir is not None else Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="leaflens-finetune-")))
            run = functools.partial(_run_fine_tune, resumable=work_dir is not None)
            extra.update(_fine_tune(back, fronts, mirrored, ds, teacher, progress, max_bad_steps, where, run))
            extra["self_train"] = _self_train_cached(back, fronts, mirrored, ds, teacher, extra, progress,
                                                     max_bad_steps, where, run)
        outs = {s: _back_outputs(back, h) for s, h in fronts.items()}
        enc = ArrayEncoder({s: o[0] for s, o in outs.items()}, {s: o[1] for s, o in outs.items()}, weights,
                           ds.image_size, identity)
    enc.view_encoder = EffnetImageEncoder(front, back, cfg.normalization, enc.feature_dim, enc.num_classes)
    if not frozen:  # the whole fine-tuned network, which the stage saves and serves (pipeline/teachers/served.py)
        enc.network = net
    return enc, extra


def _enough_steps(teacher: TeacherSection, num_train: int) -> tuple[TeacherSection, int | None]:
    """The recipe with its epochs raised to ``teacher.min_steps`` optimiser steps for ``num_train`` labelled
    photos, and the epochs it asked for (None when they were enough)."""
    epochs = epochs_for(teacher, num_train)
    warn_all_warmup("teacher.warmup_epochs", teacher.warmup_epochs, epochs, "teacher fine-tune")
    if epochs == teacher.epochs:
        return teacher, None
    steps = max(num_train // teacher.batch_size, 1)
    print(f"note: {num_train} labelled training photos make {steps} step{'s' if steps != 1 else ''} an "
          f"epoch; the fine-tune runs {epochs} epochs instead of {teacher.epochs} to take at least "
          f"teacher.min_steps = {teacher.min_steps} steps (--set teacher.min_steps=0: as given)",
          file=sys.stderr, flush=True)
    return dataclasses.replace(teacher, epochs=epochs), teacher.epochs


def _identity(weights: Path, fine_tuned: bool, k: int, size: int, cfg: LiteConfig) -> dict[str, Any]:
    return {"kind": "efficientnet-lite0", "weights": str(weights), "fine_tuned": fine_tuned, "split_block": k,
            "input_size": size, "shorter_side": shorter_side(size), "padding": cfg.padding,
            "normalization": cfg.normalization, "bn_eps": cfg.bn_eps}


def _fresh_view_teacher(net: EfficientNetLite, front: FrontRunner, back: Any, ds: Any, teacher: TeacherSection,
                        weights: Path, cfg: LiteConfig, from_arrays: bool, progress: bool, max_bad_steps: int,
                        work_dir: str | Path | None) -> tuple[ArrayEncoder, dict]:
    """``teacher.augment = "rrc"``: fine-tune on fresh crops (pipeline/teachers/finetune.py), then encode
    every split with the whole network, a chunk at a time (the front's output of early blocks is too big
    to cache)."""
    size, k = teacher.input_size, teacher.finetune_from_block
    task = FreshViewTask(front, back, ds, teacher, cfg.normalization, from_arrays, shorter_side(size))
    extra: dict[str, Any] = {"weights": str(weights), "config": cfg.to_dict(), "split_block": k,
                             "front_backend": front.backend, "fine_tuned": True, "recipe": recipe_record(teacher)}
    with contextlib.ExitStack() as stack:
        where = Path(work_dir) if work_dir is not None else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="leaflens-finetune-")))
        run = functools.partial(_run_fine_tune, resumable=work_dir is not None)  # a folder that outlives us
        extra.update(run(task, back, teacher, progress, max_bad_steps, where))
        extra["self_train"] = _self_train_fresh_views(task, front, back, ds, teacher, cfg, extra, from_arrays, progress,
                                                      max_bad_steps, where, run)
    encoder = EffnetImageEncoder(front, back, cfg.normalization, net.feature_dim, ds.num_classes, fp16_front=False)
    t0 = time.perf_counter()
    bar = tqdm(total=sum(len(ds[s]) for s in ds.splits), desc="teacher: fine-tuned EfficientNet-Lite0", unit="img",
               disable=None if progress else True)
    feats: dict[str, np.ndarray] = {}
    logits: dict[str, np.ndarray] = {}
    for split in ds.splits:
        parts = []
        for chunk in iter_split_images(ds, split, size, shorter_side(size), teacher.encode_batch_size, from_arrays):
            parts.append(encoder.encode(chunk))
            bar.update(len(chunk))
        dim, classes = net.feature_dim, ds.num_classes
        feats[split] = np.concatenate([p[0] for p in parts]) if parts else np.zeros((0, dim), np.float32)
        logits[split] = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, classes), np.float32)
    bar.close()
    extra["encode_seconds"] = round(time.perf_counter() - t0, 1)
    enc = ArrayEncoder(feats, logits, weights, ds.image_size, _identity(weights, True, k, size, cfg))
    enc.view_encoder = encoder
    enc.network = net
    return enc, extra


class FineTuneBatch(NamedTuple):
    """Cached front outputs of some train photos (each plain or mirrored), with their labels and rows."""

    inputs: np.ndarray   # (B, h, w, c) float32
    labels: np.ndarray   # (B,) int64
    indices: np.ndarray  # (B,) rows of the train split
    number: int          # the batch's position in its epoch


class FineTuneTask:
    """The EfficientNet back's half of a run (:class:`leaflens.pipeline.training.TrainingTask`): batches of
    cached front outputs of the train split, each photo shown plain or mirrored at random; cross-entropy
    with label smoothing; the pretrained layers at ``teacher.lr``, the new classifier at ``teacher.head_lr``;
    validation on the cached val fronts. Its generators (batch order and views, dropout) come from
    ``teacher.seed``."""

    def __init__(self, back: Any, fronts: dict[str, np.ndarray], mirrored: np.ndarray | None, labels: np.ndarray,
                 val_labels: np.ndarray, teacher: TeacherSection) -> None:
        self.model, self.teacher = back, teacher
        self.views = [fronts["train"]] + ([mirrored] if mirrored is not None else [])
        self.val_fronts, self.labels, self.val_labels = fronts["val"], labels, val_labels
        freeze_batchnorm(back, teacher.freeze_bn)
        self.optimizer = AdamW(optimizer_groups(back, teacher), lr=teacher.lr, weight_decay=teacher.weight_decay)
        self.steps_per_epoch = max(len(labels) // teacher.batch_size, 1)
        total = teacher.epochs * self.steps_per_epoch
        self.scheduler = WarmupCosine(self.optimizer, total_steps=max(total, 1),
                                      warmup_steps=min(teacher.warmup_epochs * self.steps_per_epoch, total))
        self.order_rng = np.random.default_rng(teacher.seed)
        dropout_rng = np.random.default_rng(teacher.seed)
        set_dropout_generator(back, dropout_rng)  # the head's dropout masks
        self.generators = {"batches": self.order_rng, "dropout": dropout_rng}

    def batches(self, epoch: int) -> Iterator[FineTuneBatch]:
        n, size = len(self.labels), self.teacher.batch_size
        order = self.order_rng.permutation(n)
        view = self.order_rng.integers(0, len(self.views), n)
        for s in range(self.steps_per_epoch):
            idx = order[s * size:(s + 1) * size]
            h = np.stack([self.views[v][i] for v, i in zip(view[idx], idx)]).astype(np.float32)
            yield FineTuneBatch(h, self.labels[idx], idx, s)

    def batch_loss(self, batch: FineTuneBatch) -> BatchLoss:
        logits = self.model(Tensor(batch.inputs))
        loss = ops.cross_entropy(logits, batch.labels, label_smoothing=self.teacher.label_smoothing)
        return BatchLoss(loss, logits.data)

    def validate(self) -> tuple[float, float]:
        _, val_logits = _back_outputs(self.model, self.val_fronts)
        return validation_scores(val_logits, self.val_labels)

    def position(self, epoch: int) -> dict[str, Any]:
        # The batch order lives in the "batches" generator, which the checkpoint saves.
        return {"num_samples": len(self.labels), "batch_size": self.teacher.batch_size}

    def restore_position(self, state: dict[str, Any]) -> None:
        mine = self.position(0)
        if state != mine:
            raise ValueError(f"fine-tune state is for {state}, this run has {mine}")


def _fine_tune(back: Any, fronts: dict[str, np.ndarray], mirrored: np.ndarray | None, ds: Any,
               teacher: TeacherSection, progress: bool, max_bad_steps: int, work_dir: Path,
               run: RunFineTune | None = None) -> dict:
    """Train the back on cached front outputs of the train split with the pipeline's training loop, then
    load the best epoch's weights (best on val: accuracy, then loss)."""
    task = FineTuneTask(back, fronts, mirrored, np.asarray(ds["train"].labels), np.asarray(ds["val"].labels),
                        teacher)
    return (run or _run_fine_tune)(task, back, teacher, progress, max_bad_steps, work_dir)


def _run_fine_tune(task: Any, back: Any, teacher: TeacherSection, progress: bool, max_bad_steps: int,
                   work_dir: Path, label: str = "teacher fine-tune", resumable: bool = False) -> dict:
    """One round of the fine-tune in ``work_dir``, continued from its ``last.npz`` when there is one (a fresh
    or temporary folder has none); ``resumable``: the folder outlives the process, so a stop says --resume."""
    settings = LoopSettings(epochs=teacher.epochs, clip_grad_norm=teacher.clip_grad_norm, max_bad_steps=max_bad_steps,
                            label=label, lr_setting="teacher.lr", resumable=resumable, progress=progress,
                            ema_decay=float(teacher.ema))
    t0 = time.perf_counter()
    result = run_training(work_dir, task, settings, {"teacher": "efficientnet-lite0 fine-tune"}, resume=True)
    load_checkpoint(work_dir / BEST, back)
    return {"fine_tune_history": result.history, "fine_tune_best_epoch": result.best_epoch,
            "fine_tune_val_acc": result.best_val_accuracy, "fine_tune_seconds": round(time.perf_counter() - t0, 1)}


def _self_train_fresh_views(task: FreshViewTask, front: FrontRunner, back: Any, ds: Any, teacher: TeacherSection,
                            cfg: LiteConfig, first_round: dict, from_arrays: bool, progress: bool, max_bad_steps: int,
                            work_dir: Path, run: RunFineTune) -> dict:
    """Self-training after the fresh-view fine-tune (pipeline/teachers/self_train.py): the unlabelled photos
    are labelled on their plain centre crop, and the pseudo-labelled ones are shown as fresh crops too."""
    size, batch = teacher.input_size, teacher.encode_batch_size

    def unlabeled_logits() -> np.ndarray:
        bar = tqdm(total=len(ds["unlabeled"]), desc="teacher: labelling the unlabelled photos", unit="img",
                   disable=None if progress else True)
        parts = []
        for chunk in iter_split_images(ds, "unlabeled", size, shorter_side(size), batch, from_arrays):
            parts.append(logits_of(front, back, chunk, cfg.normalization, batch))
            bar.update(len(chunk))
        bar.close()
        return np.concatenate(parts)

    def make_task(kept: PseudoLabels, recipe: TeacherSection) -> FreshViewTask:
        unlabeled = PhotoViews(ds, "unlabeled", size, from_arrays)
        return FreshViewTask(front, back, ds, recipe, cfg.normalization, from_arrays, shorter_side(size),
                             photos=task.photos, pseudo=PseudoPhotos(unlabeled, kept.rows, kept.labels), stream=1)

    def test_accuracy() -> float | None:
        if "test" not in ds.splits or ds["test"].labels is None:
            return None
        parts = [logits_of(front, back, chunk, cfg.normalization, batch)
                 for chunk in iter_split_images(ds, "test", size, shorter_side(size), batch, from_arrays)]
        return validation_scores(np.concatenate(parts), ds["test"].labels)[0]

    val_logits = logits_of(front, back, task.val_images, cfg.normalization, batch)
    return run_self_training(back, ds, teacher, first_round, val_logits, unlabeled_logits, make_task,
                             run, work_dir, progress, max_bad_steps, test_accuracy)


def _self_train_cached(back: Any, fronts: dict[str, np.ndarray], mirrored: np.ndarray | None, ds: Any,
                       teacher: TeacherSection, first_round: dict, progress: bool, max_bad_steps: int,
                       work_dir: Path, run: RunFineTune) -> dict:
    """Self-training on cached fronts: the unlabelled photos' fronts are already cached (plain only), so the
    pseudo-labelled photos' noise is the dropout alone (their mirrored fronts are not computed)."""

    def make_task(kept: PseudoLabels, recipe: TeacherSection) -> FineTuneTask:
        extra_fronts = np.asarray(fronts["unlabeled"])[kept.rows]
        both = {**fronts, "train": np.concatenate([fronts["train"], extra_fronts])}
        flipped = None if mirrored is None else np.concatenate([mirrored, extra_fronts])
        labels = np.concatenate([np.asarray(ds["train"].labels, np.int64), kept.labels])
        return FineTuneTask(back, both, flipped, labels, np.asarray(ds["val"].labels), recipe)

    def test_accuracy() -> float | None:
        if "test" not in fronts or ds["test"].labels is None:
            return None
        return validation_scores(_back_outputs(back, fronts["test"])[1], ds["test"].labels)[0]

    val_logits = _back_outputs(back, fronts["val"])[1]
    return run_self_training(back, ds, teacher, first_round, val_logits,
                             lambda: _back_outputs(back, fronts["unlabeled"])[1], make_task, run,
                             work_dir, progress, max_bad_steps, test_accuracy)
