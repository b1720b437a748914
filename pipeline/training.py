"""One training loop for everything the pipeline trains: the student (distilled or from scratch), the
CNN teacher (the student's architecture made wider) and the EfficientNet teacher's fine-tune.

The caller brings a :class:`TrainingTask`: the model, its optimiser and per-step scheduler, the random
generators it draws from, its batches for an epoch, its loss for a batch and its validation. The loop
owns the rules that must be the same for all of them:

- one optimiser step per batch through :func:`leaflens.engine.amp.train_step` (float32 or mixed
  precision, gradient clipping);
- a non-finite loss or gradient is never skipped silently: the step is left out (the BatchNorm
  statistics its forward pass updated are put back: a non-finite input would otherwise poison them
  for good), counted in the epoch's ``skipped_steps``, written with the batch's dataset rows to
  ``faults.jsonl``, and
  ``max_bad_steps`` of them in a row stop the run with :class:`TrainingStopped`. A step skipped because
  its float16 gradients overflowed at a loss scale above 1 is ordinary dynamic loss scaling, counted
  apart (``amp_skipped_steps``), not a fault. Weights that turn non-finite during an epoch stop the run
  at once. A stop rewinds ``last.npz`` to the last sound state (see :class:`_RewindPoint`): the end of
  the last epoch that finished before the faults began with a finite validation loss, or the initial
  state; the message names it. A diverging run's last steps before its first non-finite loss leave
  weights that are finite but enormous, so resuming from them with a lower learning rate would only
  diverge again;
- after every epoch: validation, a line in ``metrics.jsonl``, ``last.npz`` (model, optimiser,
  scheduler, generator states, the task's position, history: everything to resume exactly), and
  ``best.npz`` when :func:`is_better_epoch` says the epoch beats the best so far (higher validation
  accuracy; at equal accuracy, lower validation loss: with ~100 validation photos ties are common and
  the earliest epoch would otherwise always win);
- early stopping after ``early_stopping_patience`` epochs without a better epoch (0: never);
- with ``ema_decay`` above 0, a running average of the weights (:class:`leaflens.engine.optim.ModelEMA`)
  moves after every step; validation, ``best.npz`` and therefore everything downstream use the average,
  while the optimiser goes on from the live weights (``last.npz`` holds both, to resume exactly);
- on a GPU a step reads the device once (``train_step``'s verdict: loss, overflow, gradient norm): the
  loss terms and the accuracy counts are summed on the device and read every ``log_every`` steps for
  the progress bar and at the epoch's end (``leaflens.pipeline.host_syncs`` counts this on the CPU).

Checkpoints are written at epoch ends (a run stopped by faults restarts from an epoch's start), and
batches carry their dataset rows (``indices``), so whatever a task looks up per row never depends on
recomputing a shuffle order.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from leaflens.engine import NonFiniteLossError, Tensor, ops
from leaflens.engine.amp import GradScaler, train_step
from leaflens.engine.checkpoint import (
    CheckpointError,
    checkpoint_meta,
    load_checkpoint,
    read_checkpoint_arrays,
    save_checkpoint,
)
from leaflens.engine.deferred import read_floats
from leaflens.engine.nn import Module
from leaflens.engine.optim.ema import ModelEMA
from leaflens.engine.optim.optimizer import Optimizer
from leaflens.engine.optim.schedulers import Scheduler
from leaflens.files import write_text_atomic

LAST, BEST, METRICS, FAULTS = "last.npz", "best.npz", "metrics.jsonl", "faults.jsonl"
REWIND = "rewind.npz"  # the state a stop on numerical faults puts back as last.npz (see _RewindPoint)


class TrainingStopped(RuntimeError):
    """The run stopped on repeated numerical faults or non-finite weights (the message says what to do)."""


class TrainBatch(Protocol):
    """What the loop reads from a task's batch (the task reads the rest)."""

    labels: Any          # (B,) integer labels, -1 = unlabelled: the training accuracy counts labelled rows
    indices: np.ndarray  # (B,) dataset rows, named in fault reports
    number: int          # the batch's position in its epoch


@dataclass
class BatchLoss:
    """A batch's loss, its logits (for the training accuracy) and named loss terms (logged as ``train_<name>``)."""

    loss: Tensor
    logits: Any
    # floats, or 0-d arrays on the batch's device: the loop sums them where they are and reads the sums
    # once per ``log_every`` steps and at the epoch's end (a read per step would stall a GPU each step)
    parts: dict[str, Any] = field(default_factory=dict)


class TrainingTask(Protocol):
    """The model-specific half of a run; :func:`run_training` is the other half.

    The loop only reads the attributes (read-only properties here), so a task may hold a subclass: a
    ``StudentCNN`` model, an ``AdamW`` optimiser, a dict of generators.
    """

    @property
    def model(self) -> Module: ...

    @property
    def optimizer(self) -> Optimizer: ...

    @property
    def scheduler(self) -> Scheduler:
        """Stepped once per optimiser step."""
        ...

    @property
    def generators(self) -> Mapping[str, np.random.Generator]:
        """Saved in and restored from the run's checkpoints."""
        ...

    @property
    def steps_per_epoch(self) -> int: ...

    def batches(self, epoch: int) -> Iterable[Any]:
        """The batches of ``epoch`` (each a :class:`TrainBatch`), continuing from a restored position."""
        ...

    def batch_loss(self, batch: Any) -> BatchLoss:
        """The loss of one batch (called under autocast when the run uses mixed precision)."""
        ...

    def validate(self) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) on the validation split, in eval mode."""
        ...

    def position(self, epoch: int) -> dict[str, Any]:
        """JSON-able state that makes :meth:`batches` start at the beginning of ``epoch`` after a resume."""
        ...

    def restore_position(self, state: dict[str, Any]) -> None:
        """Undo :meth:`position` (refusing a state from other data)."""
        ...


def peak_rss_mb() -> float | None:
    """This process's peak resident memory so far, in MiB; None where the system does not report it (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0), 1)


@dataclass(frozen=True)
class LoopSettings:
    """The loop's own hyperparameters (the task holds the model's)."""

    epochs: int
    clip_grad_norm: float
    max_bad_steps: int                # consecutive non-finite steps that stop the run
    early_stopping_patience: int = 0  # epochs without a better one before stopping (0: never)
    mixed_precision: bool = False     # float16 compute, float32 master weights, dynamic loss scaling
    label: str = "model"              # names the run in progress bars and messages
    lr_setting: str = "train.lr"      # the setting a user lowers after a divergence (named in messages)
    resumable: bool = True            # whether the stage offers --resume (named in messages)
    progress: bool = True
    log_every: int = 50               # steps between reads of the running loss for the progress bar
    ema_decay: float = 0.0            # weight average's decay per step (0: none; the weights of the last step)

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.max_bad_steps < 1 or self.early_stopping_patience < 0 or self.log_every < 1:
            raise ValueError(f"LoopSettings: need epochs >= 0, max_bad_steps >= 1, early_stopping_patience >= 0 "
                             f"and log_every >= 1, got {self.epochs}, {self.max_bad_steps}, "
                             f"{self.early_stopping_patience}, {self.log_every}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"LoopSettings: ema_decay must be in [0, 1), got {self.ema_decay}")


@dataclass
class RunResult:
    run_dir: Path
    best_val_accuracy: float
    best_epoch: int                 # 1-based; 0 when no epoch ran
    epochs_run: int
    train_seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False
    device: str = "cpu"             # where it trained
    mixed_precision: bool = False   # float16 compute with float32 master weights


def is_better_epoch(val_acc: float, val_loss: float, best_acc: float, best_loss: float) -> bool:
    """Whether an epoch beats the best so far: higher val accuracy, or the same with a lower val loss.

    A validation split of a hundred photos moves in steps of about 1 %, so equal accuracies are common;
    the loss breaks the tie instead of the earliest epoch always winning, and early stopping counts
    from the last epoch that really improved. An epoch whose val loss is not finite (its logits overflowed:
    the weights are diverging) never beats one whose loss is, whatever its accuracy, and an epoch with a
    finite loss beats any that is not; ``best_acc`` below 0 means no epoch yet.
    """
    finite, best_finite = math.isfinite(val_loss), math.isfinite(best_loss)
    if best_acc >= 0 and finite != best_finite:
        return finite
    return val_acc > best_acc or (val_acc == best_acc and val_loss < best_loss)


def validation_scores(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``logits`` against ``labels``; (0, 0) for an empty split."""
    labels = np.asarray(labels)
    if not len(labels):
        return 0.0, 0.0
    accuracy = float((np.asarray(logits).argmax(1) == labels).mean())
    return accuracy, float(ops.cross_entropy(Tensor(np.asarray(logits, np.float32)), labels).item())


@dataclass
class _State:
    """What a checkpoint's ``train_state`` holds besides the task's position."""

    history: list[dict[str, Any]] = field(default_factory=list)
    best_acc: float = -1.0
    best_loss: float = math.inf
    best_epoch: int = -1  # 0-based
    train_seconds: float = 0.0
    bad_streak: int = 0   # consecutive non-finite steps so far (a streak may span epochs)


def epochs_for_steps(epochs: int, steps_per_epoch: int, min_steps: int) -> int:
    """``epochs``, raised until a run of ``steps_per_epoch`` steps an epoch takes at least ``min_steps`` steps.

    An epoch is one pass over the training photos: with few of them it is a handful of optimiser steps, too
    few for a network to learn the task in the epochs a recipe sized for hundreds of photos gives."""
    return max(int(epochs), -(-int(min_steps) // max(int(steps_per_epoch), 1)))


def warn_all_warmup(key: str, warmup_epochs: int, epochs: int, label: str) -> bool:
    """Say so on stderr when ``warmup_epochs`` (the setting ``key``) is not below the run's ``epochs``: the
    learning rate then only rises, to its peak at the last step, and the cosine decay a recipe counts on to
    settle the weights never comes. Returns whether it said so."""
    if epochs < 1 or warmup_epochs < epochs:
        return False
    print(f"warning: {label}: {key} = {warmup_epochs} is not below its {epochs} epoch{'s' if epochs != 1 else ''}: "
          f"the learning rate warms up for the whole run and never decays; lower it (--set {key}="
          f"{max(epochs // 10, 0)})", file=sys.stderr, flush=True)
    return True


def run_training(run_dir: str | os.PathLike[str], task: TrainingTask, settings: LoopSettings,
                 extra_meta: dict[str, Any], resume: bool = False, device: str = "cpu") -> RunResult:
    """Train ``task`` for ``settings.epochs`` epochs in ``run_dir``; resumes from ``last.npz`` when ``resume``
    and it exists (otherwise the run's earlier files are removed). ``extra_meta`` goes into both checkpoints.

    NumPy's overflow and invalid-value warnings are off while it runs: a step that overflows is found by its
    non-finite loss or gradients, skipped and said in a line of the loop's own, and the raw warnings (with the
    engine's source lines) only buried that line. Those warnings are also filtered out: ``np.errstate`` lives in
    a context variable that any out-of-order exit of another errstate (one left open in an abandoned generator,
    reset when it is collected) returns to NumPy's defaults half-way through the run. The filter is process-wide
    while the run lasts (other threads' warnings of those kinds are hidden too) and the filter list is put back as
    it was when the run started."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", _NUMPY_FP_WARNING, RuntimeWarning)
        return _train(run_dir, task, settings, extra_meta, resume, device)


# NumPy's floating-point warnings ("overflow encountered in matmul", ...), as np.errstate names them
_NUMPY_FP_WARNING = r"(overflow|invalid value|divide by zero|underflow) encountered in "


def _train(run_dir: str | os.PathLike[str], task: TrainingTask, settings: LoopSettings,
           extra_meta: dict[str, Any], resume: bool, device: str) -> RunResult:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    last = run_dir / LAST
    scaler = GradScaler(enabled=settings.mixed_precision)
    state = _State()
    rewind = _RewindPoint(run_dir / REWIND, last)
    ema = ModelEMA(task.model, settings.ema_decay) if settings.ema_decay else None

    def checkpoint_last(epoch_done: int, path: Path = last) -> None:
        save_checkpoint(path, task.model, task.optimizer, task.scheduler, epoch=epoch_done,
                        step=task.scheduler.last_step, generators=task.generators, ema=ema,
                        extra={**extra_meta, "train_state": {
                            "history": state.history, "best_acc": state.best_acc, "best_loss": state.best_loss,
                            "best_epoch": state.best_epoch, "train_seconds": state.train_seconds,
                            "bad_streak": state.bad_streak, "loader": task.position(epoch_done + 1),
                            "grad_scaler": scaler.state_dict() if scaler.enabled else None}})

    start_epoch = 0
    if resume and last.exists():
        start_epoch = _resume(last, task, scaler, state, run_dir, ema)
        rewind.resumed(start_epoch - 1, state.bad_streak, _sound_end(state.history))
    else:
        if not resume:
            for name in (LAST, BEST, METRICS, FAULTS, REWIND):
                (run_dir / name).unlink(missing_ok=True)
        checkpoint_last(-1, rewind.path)  # the initial state: where a stop in the first epoch rewinds to

    stopped_early = False
    for epoch in range(start_epoch, settings.epochs):
        patience = settings.early_stopping_patience
        if patience and state.best_epoch >= 0 and epoch - state.best_epoch > patience:
            stopped_early = True
            break
        task.model.train()
        t0 = time.perf_counter()
        sums = _DeviceSums()  # loss terms, correct and labelled counts: summed on the device, read rarely
        seen = steps = skipped = amp_skipped = 0
        # disable=None: tqdm draws the bar on a terminal only; a log file gets the epoch lines below, not redraws
        bar = tqdm(task.batches(epoch), total=task.steps_per_epoch, leave=False,
                   disable=None if settings.progress else True,
                   desc=f"{settings.label} epoch {epoch + 1}/{settings.epochs}", unit="batch")
        for batch in bar:
            buffers = [b for _, b in task.model.named_buffers()]
            saved = [b.copy() for b in buffers]  # BatchNorm statistics: the forward pass updates them in place
            try:
                result = train_step(task.optimizer, scaler, functools.partial(_loss_and_parts, task, batch),
                                    settings.clip_grad_norm)
            except NonFiniteLossError as exc:
                for buf, before in zip(buffers, saved):  # a batch left out leaves no trace in the model
                    buf[...] = before
                skipped += 1
                state.bad_streak += 1
                _append_jsonl(run_dir / FAULTS, {"epoch": epoch, "batch": int(batch.number),
                                                  "rows": np.asarray(batch.indices).tolist(), "error": str(exc)})
                if state.bad_streak >= settings.max_bad_steps:
                    raise TrainingStopped(
                        f"{settings.label}: {state.bad_streak} consecutive non-finite losses/gradients (last at "
                        f"epoch {epoch + 1}, batch {batch.number}; rows in {run_dir / FAULTS}). Check the data, "
                        f"or lower {settings.lr_setting} if the training loss grew before (in {run_dir / METRICS}); "
                        f"{_resume_hint(rewind.rewind(), last, settings)}") from exc
                continue
            if result.overflow:
                amp_skipped += 1
                continue
            if state.bad_streak:
                state.bad_streak = 0
                rewind.streak_ended()
            task.scheduler.step()
            if ema is not None:
                ema.update(task.model)
            steps += 1
            if settings.progress and epoch == start_epoch and steps == 2:
                per_step = (time.perf_counter() - t0) / 2
                remaining = per_step * task.steps_per_epoch * (settings.epochs - epoch)
                tqdm.write(f"{settings.label}: about {remaining / 60:.1f} min for {settings.epochs - epoch} epochs",
                           file=sys.stderr)
            batch_loss: BatchLoss = result.output
            for k, v in batch_loss.parts.items():
                sums.add(k, v)
            sums.add("loss", result.loss.data)
            labels = batch.labels
            labelled = labels >= 0
            sums.add("#labelled", labelled.sum())
            sums.add("#correct", ((batch_loss.logits.argmax(1) == labels) & labelled).sum())
            seen += len(labels)
            if settings.progress and steps % settings.log_every == 0:
                bar.set_postfix(loss=f"{sums.read(['loss'])['loss'] / steps:.4f}")
        elapsed = time.perf_counter() - t0
        state.train_seconds += elapsed
        if not _finite_state(task.model):  # a step with a finite loss blew the weights up
            raise TrainingStopped(f"{settings.label}: the weights became non-finite during epoch {epoch + 1} "
                                  f"({settings.lr_setting} too high?): lower {settings.lr_setting}; "
                                  f"{_resume_hint(rewind.rewind(), last, settings)}")
        with _evaluated(task.model, ema):
            val_acc, val_loss = task.validate()
        row: dict[str, Any] = {
            "epoch": epoch + 1, "lr": task.scheduler.get_lr()[0], "val_acc": val_acc, "val_loss": val_loss,
            "images_per_s": seen / elapsed if elapsed else 0.0, "skipped_steps": skipped,
            "peak_rss_mb": peak_rss_mb(),
            "epoch_seconds": round(elapsed, 2), "amp_skipped_steps": amp_skipped}
        if scaler.enabled:
            row["loss_scale"] = scaler.get_scale()
        totals = sums.read()
        correct, labelled_seen = int(totals.pop("#correct", 0)), int(totals.pop("#labelled", 0))
        row.update({f"train_{k}": v / max(steps, 1) for k, v in totals.items()})
        row["train_acc"] = correct / labelled_seen if labelled_seen else None
        state.history.append(row)
        _append_jsonl(run_dir / METRICS, row)
        if is_better_epoch(val_acc, val_loss, state.best_acc, state.best_loss):
            state.best_acc, state.best_loss, state.best_epoch = val_acc, val_loss, epoch
            with _evaluated(task.model, ema):
                save_checkpoint(run_dir / BEST, task.model, epoch=epoch, step=task.scheduler.last_step,
                                extra={**extra_meta, "metrics": {"val_accuracy": val_acc}})
        checkpoint_last(epoch)
        rewind.epoch_ended(epoch, state.bad_streak, _sound_end(state.history))
        if settings.progress:
            faults = (f"; {skipped} batch(es) left out for non-finite values (their rows: {run_dir / FAULTS})"
                      if skipped else "")
            tqdm.write(f"{settings.label} epoch {epoch + 1}/{settings.epochs}: loss "
                       f"{row.get('train_loss', float('nan')):.4f} val acc {val_acc:.4f} (best {state.best_acc:.4f}) "
                       f"{row['images_per_s']:.0f} img/s{faults}", file=sys.stderr)
    rewind.discard()
    return RunResult(run_dir, state.best_acc, state.best_epoch + 1, len(state.history), state.train_seconds,
                     state.history, stopped_early, device=device, mixed_precision=settings.mixed_precision)


class _RewindPoint:
    """The state a stop on numerical faults puts back as ``last.npz``: the initial state, or the end of the
    latest epoch that finished before the stopping streak of faults began, with a finite validation loss.

    ``last.npz`` is always the latest epoch's end (a killed run resumes exactly from it), but that state
    can already be on the way to divergence: an epoch that ended inside a streak of non-finite steps, or
    whose validation loss overflowed, holds weights the steps before the faults blew up. A lower learning
    rate cannot bring those back, so a stop rewinds past them. The point lives in ``rewind.npz`` in the run
    folder: a hard link to ``last.npz`` while both are the same state (no extra write per epoch), a file of
    its own once ``last.npz`` moves on to a state not yet known to be sound; a run that finishes removes it.
    """

    def __init__(self, path: Path, last: Path) -> None:
        self.path, self.last = path, last
        self.epoch = -1             # 0-based epoch whose end ``path`` holds; -1: the initial state
        self.pending: int | None = None  # last.npz's epoch, sound but ended inside a streak: kept once it ends

    def resumed(self, epoch: int, bad_streak: int, sound: bool) -> None:
        """After resuming from ``last.npz`` (the end of ``epoch``): keep the saved point when last.npz is not
        (yet) one; a run folder without a point has only last.npz to offer."""
        if not self.path.exists() or (sound and not bad_streak):
            self._take_last(epoch)
            return
        try:
            self.epoch = int(read_checkpoint_arrays(self.path)[0]["epoch"])
        except (CheckpointError, KeyError, TypeError, ValueError):
            self._take_last(epoch)
            return
        self.pending = epoch if sound else None

    def epoch_ended(self, epoch: int, bad_streak: int, sound: bool) -> None:
        """``last.npz`` now holds the end of ``epoch``: the point when sound and no streak of faults is open."""
        self.pending = None
        if sound and not bad_streak:
            self._take_last(epoch)
        elif sound:
            self.pending = epoch

    def streak_ended(self) -> None:
        """A step succeeded after faults: an epoch end inside that streak came before any later one."""
        if self.pending is not None:
            self._take_last(self.pending)
            self.pending = None

    def rewind(self) -> int | None:
        """Put the point back as ``last.npz``; its epoch (-1: the initial state), None when there is none."""
        if not self.path.exists():
            return None
        if self.last.exists() and self.path.samefile(self.last):  # rename() between two links to one file is a no-op
            self.path.unlink()
        else:
            os.replace(self.path, self.last)
        return self.epoch

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)  # left by a kill in _take_last

    def _take_last(self, epoch: int) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(self.last, tmp)
        except OSError:  # a file system without hard links: a copy costs one more write of the state
            shutil.copyfile(self.last, tmp)
        os.replace(tmp, self.path)
        self.epoch = epoch


class _DeviceSums:
    """Named running sums kept where their terms live (float64 on the device for device terms), so that
    logging costs no host read per step; :meth:`read` brings any subset back in one transfer."""

    def __init__(self) -> None:
        self.totals: dict[str, Any] = {}

    def add(self, name: str, value: Any) -> None:
        # float64, as Python floats: the sums are the ones a host-side float sum gives, to the last bit
        v = value.astype(np.float64) if hasattr(value, "astype") else float(value)
        prev = self.totals.get(name)
        self.totals[name] = v if prev is None else prev + v

    def read(self, names: Iterable[str] | None = None) -> dict[str, float]:
        keys = list(self.totals) if names is None else [k for k in names if k in self.totals]
        return dict(zip(keys, read_floats([self.totals[k] for k in keys])))


def _loss_and_parts(task: TrainingTask, batch: Any) -> tuple[Tensor, BatchLoss]:
    out = task.batch_loss(batch)
    return out.loss, out


def _evaluated(model: Module, ema: ModelEMA | None) -> contextlib.AbstractContextManager[Module]:
    """The weights validation judges and ``best.npz`` keeps: the average when the run keeps one."""
    return ema.applied(model) if ema is not None else contextlib.nullcontext(model)


def _resume(last: Path, task: TrainingTask, scaler: GradScaler, state: _State, run_dir: Path,
            ema: ModelEMA | None = None) -> int:
    """Restore a run from ``last``; returns the first epoch still to run."""
    # The configuration is the authority on resume (it is what the run's config records): a run stopped by
    # non-finite losses is meant to be resumed with a lower learning rate, which the saved groups would undo.
    configured = [(g["initial_lr"], g["weight_decay"]) for g in task.optimizer.param_groups]
    # a run resumed with a weight average it was not started with begins one from the resumed weights
    averaged = ema is not None and "ema" in checkpoint_meta(last)
    try:
        ck = load_checkpoint(last, task.model, task.optimizer, task.scheduler, generators=task.generators,
                             ema=ema if averaged else None)
    except CheckpointError as exc:
        if "different model" not in str(exc):
            raise
        raise CheckpointError(f"--resume: the network changed since the run began (model.family, model.widths, "
                              f"model.input_size...; {exc}): resume with the settings it began with (its "
                              "config.toml), or run without --resume to start over") from None
    if ema is not None and not averaged:
        ema.restart(task.model)
        tqdm.write(f"{last} holds no weight average (the run began without one): it starts from the resumed weights",
                   file=sys.stderr)
    for g, (lr, wd) in zip(task.optimizer.param_groups, configured):
        g["initial_lr"], g["weight_decay"] = lr, wd
    task.scheduler.load_state_dict(task.scheduler.state_dict())  # re-applies the schedule to the configured lr
    st = ck.extra["train_state"]
    state.history, state.best_acc, state.best_epoch = st["history"], st["best_acc"], st["best_epoch"]
    state.best_loss = st["best_loss"]
    state.train_seconds = st["train_seconds"]
    state.bad_streak = int(st.get("bad_streak", 0))  # absent from checkpoints written before it was saved
    try:
        task.restore_position(st["loader"])
    except ValueError as exc:
        raise ValueError(f"--resume: the training data settings changed since the run began (train.batch_size, "
                         f"augment.*...: {exc}); resume with the settings it began with (its config.toml), or run "
                         "without --resume to start over") from None
    if scaler.enabled and st.get("grad_scaler"):
        scaler.load_state_dict(st["grad_scaler"])
    _rewrite_metrics(run_dir / METRICS, state.history)
    return ck.epoch + 1


def _finite_state(model: Module) -> bool:
    """True when every parameter and buffer (BatchNorm statistics included) is finite."""
    return all(bool(np.isfinite(v).all()) for v in model.state_dict().values())


def _sound_end(history: list[dict[str, Any]]) -> bool:
    """Whether the latest epoch end may be rewound to: its validation loss is finite (an overflowing forward
    pass on clean validation photos means the weights already blew up); the initial state (no epoch) is."""
    return not history or math.isfinite(history[-1]["val_loss"])


def _resume_hint(rewound_to: int | None, last: Path, settings: LoopSettings) -> str:
    """The end of a stop message: how to go on, and which state ``last.npz`` now holds (``rewound_to``: the
    epoch whose end it is, 0-based; -1: the initial state; None: no sound state was kept)."""
    if not settings.resumable:
        return "then run the stage again."
    if rewound_to is None:
        return f"then rerun without --resume: no sound state was kept to resume from ({last} is not one)."
    where = ("the initial state (no epoch ended soundly before the faults began)" if rewound_to < 0 else
             f"the state at the end of epoch {rewound_to + 1}, the last sound one before the faults began")
    return f"then rerun with --resume, which starts from {where}: {last} was rewound to it."


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def _rewrite_metrics(path: Path, history: list[dict[str, Any]]) -> None:
    """After a resume, the metric lines are the checkpoint's own record of its epochs (``history``): lines
    written after that checkpoint go, and so does a line a kill cut short (the file stays JSON lines)."""
    if path.exists():
        write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in history))
