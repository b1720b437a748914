"""How often a student training step makes the host wait for the GPU, measured on any machine.

A GPU runs a small-batch step in a few milliseconds; every host read of a device value in that step
(``float()``, ``.item()``, ``bool()`` of a device array, a boolean mask, ...) stops Python until the
device has caught up, and the device then idles while Python queues the next kernels. The training
step is built to read the device once (``leaflens.engine.amp.train_step``: loss, overflow flag and
gradient norm in one transfer) plus once every ``log_every`` steps for the progress bar's running loss.

:func:`measure_host_syncs` proves it without a GPU: it trains a tiny student (distillation from
teacher features and logits, some unlabelled rows, gradient clipping, mixed precision) on the
engine's counting stand-in for CuPy (:mod:`leaflens.engine.sync_count`), through the pipeline's own
:func:`leaflens.pipeline.train_student.student_run` and training loop, and counts the reads of each
step, loader included. ``tests/pipeline/test_host_syncs.py`` asserts the bound and
``benchmarks/gpu.py`` reports ``host_syncs_per_step``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.engine.sync_count import SyncCounter, counting_device
from leaflens.pipeline.config import load_config
from leaflens.pipeline.train_student import TrainData, student_run
from leaflens.pipeline.training import run_training

__all__ = ["HostSyncReport", "measure_host_syncs"]


@dataclass
class HostSyncReport:
    """Host synchronisations per training step of a tiny run on the counting stand-in."""

    per_step: list[int]      # every step of the run, in order
    steady: list[int]        # the steps after the run's first (which pays one-off costs, if any)
    log_every: int           # steps between the progress bar's reads of the running loss
    sites: Counter[str] = field(default_factory=Counter)  # where the steady steps' reads come from

    @property
    def max_per_step(self) -> int:
        return max(self.steady, default=0)

    @property
    def mean_per_step(self) -> float:
        return sum(self.steady) / len(self.steady) if self.steady else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"max": self.max_per_step, "mean": round(self.mean_per_step, 3), "steps": len(self.per_step),
                "log_every": self.log_every, "per_step": self.per_step, "sites": dict(self.sites)}


class _CountedTask:
    """A training task whose batches note the host reads made between one batch and the next."""

    def __init__(self, task: Any, counter: SyncCounter) -> None:
        self._task, self._counter = task, counter
        self.per_step: list[list[tuple[str, str]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def batches(self, epoch: int) -> Iterator[Any]:
        start = self._counter.total  # the upload of the first batch counts with its step
        for batch in self._task.batches(epoch):
            yield batch
            self.per_step.append(self._counter.since(start))
            start = self._counter.total


def _tiny_data(rows: int, size: int, classes: int, dim: int) -> tuple[TrainData, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (rows, size, size, 3), dtype=np.uint8)
    labels = (np.arange(rows) % classes).astype(np.int64)
    labels[::3] = -1  # unlabelled rows: the student learns them from the teacher alone
    features = rng.normal(size=(rows, dim)).astype(np.float32)
    logits = rng.normal(size=(rows, classes)).astype(np.float32)
    return TrainData(images, labels, features, logits), images[:8], np.arange(8) % classes


def measure_host_syncs(optimizer: str = "adamw", mixed_precision: bool = True, epochs: int = 2,
                       log_every: int = 4, batch_size: int = 8, batches_per_epoch: int = 6,
                       overrides: Sequence[str] = ()) -> HostSyncReport:
    """Train a tiny distilled student for ``epochs`` on the counting stand-in; count host reads per step.
    ``overrides``: further ``--set`` settings of the recipe (e.g. ``distill.mixup=0.4``).

    Each step's count covers everything between handing out one batch and the next: the loop, the
    loss, backward, clipping, the optimiser, the scaler, the loop's bookkeeping and the upload of the
    next batch. Validation and checkpoints at the epoch's end are not in any step.
    """
    classes, dim = 3, 6
    data, val_images, val_labels = _tiny_data(batch_size * batches_per_epoch, 8, classes, dim)
    # exactly ``epochs`` of ``batches_per_epoch`` steps: the count is per step (no raise to train.min_steps)
    cfg = load_config(None, [f"train.epochs={epochs}", "train.min_steps=0", f"train.batch_size={batch_size}",
                             "model.widths=[4, 8]",
                             "train.warmup_epochs=0", f"train.optimizer={optimizer}", "train.clip_grad_norm=1.0",
                             f"train.mixed_precision={'on' if mixed_precision else 'off'}",
                             "distill.kd_weight=1.0", "distill.alpha=1.0", *overrides])
    mean, std = np.full(3, 0.5, np.float32), np.full(3, 0.25, np.float32)
    with counting_device() as counter, tempfile.TemporaryDirectory(prefix="leaflens-syncs-") as tmp, \
            contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        task, settings, device = student_run(cfg, data, val_images, val_labels, mean, std, classes,
                                             label="sync-probe", device="cuda")
        # the progress bar on: its running loss is the periodic read being measured
        settings = dataclasses.replace(settings, progress=True, log_every=log_every)
        counted = _CountedTask(task, counter)
        run_training(Path(tmp) / "run", counted, settings, {}, device=device)
    per_step = [len(events) for events in counted.per_step]
    sites: Counter[str] = Counter()
    for events in counted.per_step[1:]:
        sites.update(f"{kind} at {where}" for kind, where in events)
    return HostSyncReport(per_step, per_step[1:], log_every, sites)
