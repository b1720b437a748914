"""One student training run: the loop, its checkpoints, metrics and fault handling.

Used twice by `leaflens distill`: once learning from the teacher (feature + CE + KD loss, on the
labelled images and any unlabelled ones) and once from scratch (CE alone, labelled images only),
with the same recipe and seed, so that the gain from distillation is measured, never assumed.

Every epoch appends a line to ``metrics.jsonl`` and writes ``last.npz`` (model, optimiser,
scheduler, loader position, history: everything needed to resume exactly); ``best.npz`` holds the
weights with the best validation accuracy so far (equal accuracies: the lower validation loss).

``train.device`` ("auto": CUDA when a usable GPU is found) chooses where the model, the batches and
the teacher targets live; batches reach the GPU through ``leaflens.engine.device_loader.DeviceLoader``
(pinned memory, a copy stream, double buffering). ``train.mixed_precision`` ("auto": on with CUDA)
runs conv/linear in float16 under ``leaflens.engine.amp.autocast`` with float32 master weights and dynamic
loss scaling; a step skipped because its float16 gradients overflowed is counted in the metrics
(``amp_skipped_steps``), not reported as a fault. With device "cpu" and mixed precision off the
loop computes exactly what it computed before either existed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from leaflens.data_prep.contract import area_resize, normalize
from leaflens.engine import NonFiniteLossError, Tensor, no_grad, ops
from leaflens.engine.amp import GradScaler, autocast
from leaflens.engine.backend import array_module, to_device
from leaflens.engine.checkpoint import load_checkpoint, save_checkpoint
from leaflens.engine.data import ArrayDataset, Augment, Batch, DataLoader, apply_view_boxes
from leaflens.engine.device_loader import DeviceLoader, resolve_device
from leaflens.engine.nn import Module
from leaflens.engine.optim import SGD, AdamW, WarmupCosine, clip_grad_norm_
from leaflens.files import write_text_atomic
from leaflens.pipeline.config import DistillSection, StageConfig
from leaflens.pipeline.models.student import StudentCNN, StudentSpec

LAST, BEST, METRICS, FAULTS = "last.npz", "best.npz", "metrics.jsonl", "faults.jsonl"


class TrainingStopped(RuntimeError):
    """The run stopped on repeated numerical faults; ``last.npz`` lets it resume after a fix."""


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
    features: np.ndarray | None = None   # (N, D) teacher features, or None
    logits: np.ndarray | None = None     # (N, C) teacher logits, or None
    # Teacher view bank (pipeline/teachers/views.py): the student is shown view v of a photo and learns
    # the teacher's targets for that view. (N, K, 6) boxes, (N, K, D) features, (N, K, C) logits.
    views: Any = None
    view_features: Any = None
    view_logits: Any = None


@dataclass
class RunResult:
    run_dir: Path
    best_val_accuracy: float
    best_epoch: int
    epochs_run: int
    train_seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False
    device: str = "cpu"             # where it trained
    mixed_precision: bool = False   # float16 compute with float32 master weights


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
                   size: int | None = None) -> np.ndarray:
    """Logits for every row of a uint8 NHWC array, in eval mode, without recording a graph; the images
    are first area-downsampled to ``size`` px when they are stored larger. Resizing and normalising are
    the preprocessing contract's (leaflens.data_prep.contract), as the Predictor's are."""
    was_training = model.training
    model.eval()
    device = _model_device(model)
    out = []
    with no_grad():
        for i in range(0, len(images), batch):
            x = np.asarray(images[i:i + batch])
            # never in place: at its own size, x may be a view of the caller's float array
            x = normalize(x if size is None else area_resize(x, size), mean, std)
            out.append(model(Tensor(to_device(x, device))).numpy())
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


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


def distill_loss(model: StudentCNN, x: np.ndarray, y: np.ndarray, feats: np.ndarray | None,
                 tlogits: np.ndarray | None, dcfg: DistillSection,
                 label_smoothing: float) -> tuple[Tensor, dict[str, float], np.ndarray]:
    """The batch loss, its parts (feature = 2 - 2 cos, cross-entropy on labelled rows, KD) and the logits."""
    parts: dict[str, float] = {}
    labelled = bool((y >= 0).any())
    if feats is None:
        logits = model(Tensor(x))
        loss = ops.cross_entropy(logits, y, label_smoothing=label_smoothing, ignore_index=-1)
        parts["ce"] = loss.item()
        return loss, parts, logits.data
    logits, proj = model.forward_with_projection(Tensor(x))
    diff = ops.l2_normalize(proj, axis=1) - _l2n(feats)
    feat = (diff * diff).sum(axis=1).mean()
    loss = feat * float(dcfg.feature_weight)
    parts["feature"] = feat.item()
    if labelled and dcfg.alpha:
        ce = ops.cross_entropy(logits, y, label_smoothing=label_smoothing, ignore_index=-1)
        loss = loss + ce * float(dcfg.alpha)
        parts["ce"] = ce.item()
    if tlogits is not None and dcfg.kd_weight:
        t = float(dcfg.temperature)
        soft = _softmax(tlogits.astype(np.float32, copy=False) / t).astype(np.float32)
        kd = ops.cross_entropy(logits * (1.0 / t), soft) * (t * t)
        loss = loss + kd * float(dcfg.kd_weight)
        # log the KL divergence (cross-entropy minus the targets' constant entropy), which goes to 0
        xp = array_module(soft)
        entropy = float(-(soft * xp.log(xp.maximum(soft, 1e-12))).sum(axis=1).mean())
        parts["kd"] = kd.item() - t * t * entropy
    return loss, parts, logits.data


def train_run(run_dir: str | os.PathLike[str], cfg: StageConfig, data: TrainData, val_images: Any,
              val_labels: np.ndarray, mean: np.ndarray, std: np.ndarray, num_classes: int,
              extra_meta: dict[str, Any], resume: bool = False, label: str = "student",
              progress: bool = True) -> RunResult:
    """Train one student in ``run_dir``; resumes from ``last.npz`` when ``resume`` and it exists."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tcfg, dcfg = cfg.train, cfg.distill
    device = resolve_device(tcfg.device)
    use_amp = resolve_precision(tcfg.mixed_precision, device)
    seed = int(tcfg.seed)
    teacher_dim = None if data.features is None else int(data.features.shape[1])
    # The run's own generator, from the recipe's seed: the initial weights, then the dropout masks. Nothing
    # that ran earlier in the process can change them; checkpoints carry its state for an exact resume.
    model_rng = np.random.default_rng(seed)
    model = StudentSpec.from_recipe(cfg.model, num_classes).build(model_rng, teacher_dim)
    if device != "cpu":
        model.to(device)  # before the optimiser and the checkpoint: their state follows the parameters
    dataset = ArrayDataset(data.images, data.labels)
    size = student_input_size(cfg, dataset.image_shape[0])
    augment = make_augment(cfg, colour_only=data.views is not None, out_size=size)
    loader = DataLoader(dataset, int(tcfg.batch_size), shuffle=True, drop_last=len(dataset) > tcfg.batch_size,
                        seed=seed, mean=mean, std=std, augment=augment, prefetch=3, num_threads=1)
    device_loader = DeviceLoader(loader, device)
    scaler = GradScaler(enabled=use_amp)
    steps_per_epoch = len(loader)
    epochs = int(tcfg.epochs)
    if tcfg.optimizer == "adamw":
        opt = AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    elif tcfg.optimizer == "sgd":
        opt = SGD(model.parameters(), lr=tcfg.lr, momentum=0.9, nesterov=True, weight_decay=tcfg.weight_decay)
    else:
        raise ValueError(f"train.optimizer must be 'adamw' or 'sgd', got {tcfg.optimizer!r}")
    sched = WarmupCosine(opt, total_steps=max(epochs * steps_per_epoch, 1),
                         warmup_steps=min(int(tcfg.warmup_epochs) * steps_per_epoch, epochs * steps_per_epoch))

    history: list[dict[str, Any]] = []
    best_acc, best_loss, best_epoch, start_epoch, train_seconds, bad_streak = -1.0, math.inf, -1, 0, 0.0, 0
    last = run_dir / LAST
    if resume and last.exists():
        ck = load_checkpoint(last, model, opt, sched, generators={"model": model_rng})
        # The configuration is the authority on resume (it is what config.toml records): a run stopped by
        # non-finite losses is meant to be resumed with a lower train.lr, which the saved groups would undo.
        for g in opt.param_groups:
            g["initial_lr"], g["weight_decay"] = float(tcfg.lr), float(tcfg.weight_decay)
        sched.load_state_dict(sched.state_dict())  # re-applies the schedule to the configured lr
        st = ck.extra["train_state"]
        history, best_acc, best_epoch = st["history"], st["best_acc"], st["best_epoch"]
        best_loss = st.get("best_loss", history[best_epoch]["val_loss"] if 0 <= best_epoch < len(history) else math.inf)
        train_seconds, start_epoch = st["train_seconds"], ck.epoch + 1
        loader.load_state_dict(st["loader"])
        if use_amp and st.get("grad_scaler"):
            scaler.load_state_dict(st["grad_scaler"])
        _truncate_jsonl(run_dir / METRICS, len(history))
    elif not resume:
        for name in (LAST, BEST, METRICS, FAULTS):
            (run_dir / name).unlink(missing_ok=True)

    patience = int(tcfg.early_stopping_patience)
    stopped_early = False
    for epoch in range(start_epoch, epochs):
        if patience and best_epoch >= 0 and epoch - best_epoch > patience:
            stopped_early = True
            break
        model.train()
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        seen = correct = labelled_seen = steps = skipped = amp_skipped = 0
        # Host side (teacher targets looked up by the batch's dataset rows, views), then on to the device.
        host = (_host_batch(data, batch, seed, epoch, size) for batch in loader)
        bar = tqdm(device_loader.upload(host), total=steps_per_epoch, desc=f"{label} epoch {epoch + 1}/{epochs}",
                   leave=False, disable=not progress, unit="batch")
        for x, y, feats, tl, idx, b in bar:
            opt.zero_grad()
            try:
                with autocast(use_amp):
                    loss, parts, logits = distill_loss(model, x, y, feats, tl, dcfg, tcfg.label_smoothing)
                with np.errstate(over="ignore", invalid="ignore") if use_amp else contextlib.nullcontext():
                    scaler.scale(loss).backward()  # float16 overflow is expected now and then: the scaler handles it
                if scaler.unscale_(opt):  # true gradients before clipping; inf/NaN only with mixed precision
                    if scaler.get_scale() > 1.0:  # float16 overflow at this loss scale: skip, not a fault
                        amp_skipped += 1
                        scaler.update()
                        continue
                    raise NonFiniteLossError("gradients are not finite even with the loss scale at 1")
                gnorm = clip_grad_norm_(model.parameters(), float(tcfg.clip_grad_norm))
                if not math.isfinite(gnorm):
                    raise NonFiniteLossError(f"gradient norm is {gnorm}")
            except NonFiniteLossError as exc:
                scaler.update()
                skipped += 1
                bad_streak += 1
                _append_jsonl(run_dir / FAULTS, {"epoch": epoch, "batch": b, "rows": idx.tolist(),
                                                  "error": str(exc)})
                if bad_streak >= int(tcfg.max_bad_steps):
                    if _finite_state(model):  # bad data, sound weights: resume from here after fixing the data
                        save_checkpoint(last, model, opt, sched, epoch=epoch - 1, step=sched.last_step,
                                        generators={"model": model_rng},
                                        extra=_state_extra(extra_meta, history, (best_acc, best_loss), best_epoch,
                                                           train_seconds, loader, epoch, scaler))
                    raise TrainingStopped(
                        f"{label}: {bad_streak} consecutive non-finite losses/gradients (last at epoch {epoch + 1}, "
                        f"batch {b}; rows in {run_dir / FAULTS}). {_resume_hint(model, last)}") from exc
                continue
            bad_streak = 0
            scaler.step(opt)
            scaler.update()
            sched.step()
            steps += 1
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v
            sums["loss"] = sums.get("loss", 0.0) + loss.item()
            labelled = y >= 0
            labelled_seen += int(labelled.sum())
            correct += int((logits.argmax(1)[labelled] == y[labelled]).sum())
            seen += len(y)
        elapsed = time.perf_counter() - t0
        train_seconds += elapsed
        if not _finite_state(model):  # a step with a finite loss blew the weights up: keep the last good state
            raise TrainingStopped(f"{label}: the weights became non-finite during epoch {epoch + 1} (learning rate "
                                  f"too high?). {_resume_hint(model, last)}")
        val_logits = predict_logits(model, val_images, mean, std, int(tcfg.eval_batch_size), size)
        val_pred = val_logits.argmax(1) if len(val_logits) else np.zeros(0, np.int64)
        val_acc = float((val_pred == val_labels).mean()) if len(val_labels) else 0.0
        val_loss = float(ops.cross_entropy(Tensor(val_logits), val_labels).item()) if len(val_labels) else 0.0
        row = {"epoch": epoch + 1, "lr": sched.get_lr()[0], "val_acc": val_acc, "val_loss": val_loss,
               "images_per_s": seen / elapsed if elapsed else 0.0, "skipped_steps": skipped,
               "peak_rss_mb": round(_peak_rss_mb(), 1), "epoch_seconds": round(elapsed, 2),
               "amp_skipped_steps": amp_skipped}
        if use_amp:
            row["loss_scale"] = scaler.get_scale()
        row.update({f"train_{k}": v / max(steps, 1) for k, v in sums.items()})
        row["train_acc"] = correct / labelled_seen if labelled_seen else None
        history.append(row)
        _append_jsonl(run_dir / METRICS, row)
        if is_better_epoch(val_acc, val_loss, best_acc, best_loss):
            best_acc, best_loss, best_epoch = val_acc, val_loss, epoch
            save_checkpoint(run_dir / BEST, model, epoch=epoch, step=sched.last_step,
                            extra={**extra_meta, "metrics": {"val_accuracy": val_acc}})
        save_checkpoint(last, model, opt, sched, epoch=epoch, step=sched.last_step, generators={"model": model_rng},
                        extra=_state_extra(extra_meta, history, (best_acc, best_loss), best_epoch, train_seconds,
                                           loader, epoch + 1, scaler))
        if progress:
            tqdm.write(f"{label} epoch {epoch + 1}/{epochs}: loss {row.get('train_loss', float('nan')):.4f} "
                       f"val acc {val_acc:.4f} (best {best_acc:.4f}) {row['images_per_s']:.0f} img/s")
    return RunResult(run_dir, best_acc, best_epoch + 1, len(history), train_seconds, history, stopped_early,
                     device=device, mixed_precision=use_amp)


def is_better_epoch(val_acc: float, val_loss: float, best_acc: float, best_loss: float) -> bool:
    """Whether an epoch beats the best so far: higher val accuracy, or the same with a lower val loss.

    A validation split of a hundred photos moves in steps of about 1 %, so equal accuracies are common;
    the loss breaks the tie instead of the earliest epoch always winning, and early stopping counts
    from the last epoch that really improved.
    """
    return val_acc > best_acc or (val_acc == best_acc and val_loss < best_loss)


class StudentBatch(NamedTuple):
    """A loader batch with the teacher's targets for its rows (None without a teacher)."""

    images: Any
    labels: Any
    features: Any
    logits: Any
    indices: np.ndarray  # dataset rows: stay on the host (DeviceLoader leaves ``indices`` alone)
    number: int          # the batch's position in its epoch


def _host_batch(data: TrainData, batch: Batch, seed: int, epoch: int, size: int) -> StudentBatch:
    """A loader batch with its teacher targets looked up on the host by the batch's dataset rows
    (cut to the teacher's views when there is a bank)."""
    x, idx = batch.images, batch.indices
    feats = None if data.features is None else np.asarray(data.features[idx])
    tl = None if data.logits is None else np.asarray(data.logits[idx])
    if data.views is not None:
        x, feats, tl = pick_views(data, idx, x, seed, epoch, batch.number, size)
    return StudentBatch(x, batch.labels, feats, tl, idx, batch.number)


def _finite_state(model: Module) -> bool:
    """True when every parameter and buffer (BatchNorm statistics included) is finite."""
    return all(bool(np.isfinite(v).all()) for v in model.state_dict().values())


def _resume_hint(model: Module, last: Path) -> str:
    """What the user can do after a stop on numerical faults, given which checkpoint is usable."""
    if _finite_state(model):
        return f"Check the data (or lower train.lr), then rerun with --resume (state saved in {last})."
    if last.exists():
        return (f"{last} still holds the last finite state (end of the previous epoch): lower train.lr, "
                "then rerun with --resume.")
    return "No epoch finished with finite weights, so there is nothing to resume: lower train.lr and rerun."


def _state_extra(meta, history, best, best_epoch, train_seconds, loader, next_epoch,
                 scaler: GradScaler | None = None) -> dict[str, Any]:
    loader.set_epoch(next_epoch)
    return {**meta, "train_state": {"history": history, "best_acc": best[0], "best_loss": best[1],
                                    "best_epoch": best_epoch,
                                    "train_seconds": train_seconds, "loader": loader.state_dict(),
                                    "grad_scaler": scaler.state_dict() if scaler is not None and scaler.enabled
                                    else None}}


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def _truncate_jsonl(path: Path, keep: int) -> None:
    """After a resume, drop metric lines written after the checkpoint the run resumed from."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()[:keep]
    write_text_atomic(path, "".join(line + "\n" for line in lines))
