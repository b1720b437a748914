"""A trained run directory: what `leaflens distill` writes and `leaflens export` reads.

The weights chosen for use live in ``best.npz``, an engine checkpoint (see leaflens.engine.checkpoint)
whose ``extra`` entry, a :class:`RunMeta` record, describes everything needed to rebuild and use the
model:

- ``model_config``: the architecture, a :class:`~leaflens.pipeline.models.student.StudentSpec`
- ``dataset``: the data it learnt from and how images reach it (:class:`RunDataset`: classes, mean/std
  on the pixel/255 scale, stored and input size, resize rule, centre crop, the manifest's SHA-256)
- ``metrics``: val/test accuracy and the uncertain threshold (:class:`RunMetrics`, any may be absent)
- ``run_id``, ``variant`` (distilled or scratch) and ``teacher`` (teacher.json's identity entry)
- ``kept``: absent when the student in ``best.npz`` is the model the run keeps; ``"teacher"`` when the run
  kept the fine-tuned teacher (leaflens.pipeline.selection), whose network is then copied into the run as
  ``teacher_model.npz`` (pipeline/teachers/served.py) for `leaflens export` to ship, and ``kept_metrics``
  holds the teacher's figures. ``best.npz`` is the best student either way, with its own metrics.

Each variant's own ``best.npz`` carries the same record with its variant and val accuracy; the
``last.npz`` checkpoints add the loop's ``train_state`` for resuming.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from leaflens.data_prep.contract import PreprocessContract
from leaflens.engine.checkpoint import CheckpointError, read_checkpoint_arrays
from leaflens.engine.nn import Module
from leaflens.pipeline.models.student import StudentSpec
from leaflens.records import Record, RecordError

BEST = "best.npz"
TEACHER_MODEL = "teacher_model.npz"  # the kept teacher's network, when the run kept it


Variant = Literal["distilled", "scratch"]  # learnt from the teacher, or from the labels alone


@dataclass(frozen=True)
class RunDataset(Record):
    """The data a run learnt from and how an image reaches its model (best.npz's ``dataset``)."""

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"centre_crop"})  # as runs were before it existed
    classes: tuple[str, ...]
    mean: tuple[float, float, float]  # per RGB channel, pixel / 255
    std: tuple[float, float, float]
    image_size: int                   # as stored in the dataset
    input_size: int | None = None     # the model's input; absent in runs from before model.input_size
    resize: Literal["crop", "pad"] = "crop"  # absent in the first runs, which all cropped
    manifest_sha256: str | None = None
    root: str | None = None
    # the centre share of each stored photo the model looks at (chosen on validation by distill; None: whole)
    centre_crop: float | None = None

    def __post_init__(self) -> None:
        if self.centre_crop is not None:
            self.contract()  # the contract's own checks: a share in (0, 1) that keeps at least the input size

    @property
    def model_input_size(self) -> int:
        """The side of the model's input (the stored size for runs that did not record it)."""
        return self.image_size if self.input_size is None else self.input_size

    def contract(self) -> PreprocessContract:
        """How a stored photo reaches this run's model (what its export records and serving applies)."""
        return PreprocessContract(stored_size=self.image_size, input_size=self.model_input_size, mean=self.mean,
                                  std=self.std, resize=self.resize, centre_crop=self.centre_crop)


@dataclass(frozen=True)
class RunMetrics(Record):
    """best.npz's ``metrics``; each variant's own best.npz has its val accuracy only."""

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"temperature"})  # as runs were before it existed
    val_accuracy: float | None = None
    test_accuracy: float | None = None
    uncertain_threshold: float | None = None
    # the student's logits are divided by it when served (leaflens.pipeline.calibration); None: runs from before
    temperature: float | None = None


@dataclass(frozen=True)
class RunMeta(Record):
    """What a run's checkpoints record beside the weights (their ``extra``)."""

    SCHEMA_VERSION: ClassVar[int | None] = 1
    # a run that keeps its student records no "kept", as runs did before teachers could be kept
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"kept", "kept_metrics"})
    model_config: StudentSpec
    dataset: RunDataset
    run_id: str | None = None         # None: the run folder's name
    variant: Variant | None = None
    metrics: RunMetrics = field(default_factory=RunMetrics)
    teacher: dict[str, Any] | None = None  # the teacher's identity (teacher.json's ``teacher``)
    schema_version: int = 1
    kept: Literal["teacher"] | None = None  # None: the student is the kept model
    kept_metrics: RunMetrics | None = None  # the kept teacher's val/test accuracy and "ambiguous" threshold


@dataclass(frozen=True)
class RunInfo:
    """A run folder's chosen checkpoint: where it is and what its record says."""

    path: Path
    model_config: StudentSpec
    dataset: RunDataset
    metrics: RunMetrics
    run_id: str
    kept: Literal["teacher"] | None = None  # "teacher": export ships TEACHER_MODEL, not the student
    kept_metrics: RunMetrics | None = None
    variant: Variant | None = None  # the student's: learnt from the teacher or from the labels alone

    @property
    def teacher_model(self) -> Path:
        """Where the kept teacher's network is (meaningful when ``kept`` is "teacher")."""
        return self.path.parent / TEACHER_MODEL


def _run_info(path: Path, meta: dict[str, Any], run_dir: Path) -> RunInfo:
    extra = meta.get("extra", {})
    for key in ("model_config", "dataset"):
        if key not in extra:
            raise CheckpointError(f"{path} lacks '{key}': it was not written by `leaflens distill`")
    try:
        record = RunMeta.from_dict(extra, str(path))
    except RecordError as exc:
        raise CheckpointError(str(exc)) from None
    return RunInfo(path=path, model_config=record.model_config, dataset=record.dataset, metrics=record.metrics,
                   run_id=record.run_id or run_dir.name, kept=record.kept, kept_metrics=record.kept_metrics,
                   variant=record.variant)


def read_run(run_dir: str | os.PathLike[str]) -> RunInfo:
    path = Path(run_dir) / BEST
    meta, _ = read_checkpoint_arrays(path)
    return _run_info(path, meta, Path(run_dir))


def load_student_weights(model: Module, path: str | os.PathLike[str],
                         checkpoint: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Load a checkpoint's model weights into ``model``, leaving out training-only heads (the
    distillation projection); returns the checkpoint's meta. ``checkpoint`` is the file's
    (meta, arrays) when the caller has already read it."""
    meta, arrays = checkpoint or read_checkpoint_arrays(path)
    state = {k[len("model/"):]: v for k, v in arrays.items()
             if k.startswith("model/") and not k.startswith("model/projection.")}
    model.load_state_dict(state)
    return meta


def load_model(run_dir: str | os.PathLike[str]) -> tuple[Module, RunInfo]:
    """The run's chosen model in eval mode (training-only heads such as the projection are dropped)."""
    path = Path(run_dir) / BEST
    checkpoint = read_checkpoint_arrays(path)
    info = _run_info(path, checkpoint[0], Path(run_dir))
    try:
        # initial values from a fixed generator: the run's weights replace all of them
        model = info.model_config.build(np.random.default_rng(0))
    except ValueError as exc:
        raise CheckpointError(f"{info.path}: its model_config {info.model_config} cannot be built: {exc}") from exc
    try:
        load_student_weights(model, info.path, checkpoint)
    except (ValueError, KeyError) as exc:  # weights of another model behind this model_config
        raise CheckpointError(f"{info.path} holds weights of a different model than its model_config "
                              f"{info.model_config} describes: {exc}") from exc
    return model.eval(), info
