"""A trained run directory: what `leaflens distill` writes and `leaflens export` reads.

The weights chosen for use live in ``best.npz``, an engine checkpoint (see leaflens.engine.checkpoint)
whose ``extra`` entry describes everything needed to rebuild and use the model:

- ``model_config``: {"kind": "student_cnn", "num_classes", "widths", "in_channels", "dropout"}
- ``dataset``: {"classes": [...], "mean": [r, g, b], "std": [r, g, b] (pixel/255 scale),
  "image_size": S (as stored), "input_size": s (the model's input; absent in older runs: S),
  "resize": "crop" | "pad", "manifest_sha256": "..."}
- ``metrics``: {"val_accuracy", "test_accuracy", "uncertain_threshold"} (any may be absent)
- ``run_id``: a string naming the run
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.engine.checkpoint import CheckpointError, read_checkpoint_arrays
from leaflens.engine.nn import Module
from leaflens.pipeline.models.student import StudentCNN

BEST = "best.npz"


@dataclass
class RunInfo:
    path: Path
    model_config: dict[str, Any]
    dataset: dict[str, Any]
    metrics: dict[str, Any]
    run_id: str


def build_model(config: dict[str, Any]) -> Module:
    """The engine model described by a run's ``model_config``, to load the run's weights into (its initial
    values, drawn from a fixed generator, are all replaced)."""
    kind = config.get("kind")
    if kind == "student_cnn":
        return StudentCNN(int(config["num_classes"]), widths=config["widths"],
                          in_channels=int(config.get("in_channels", 3)), dropout=float(config.get("dropout", 0.0)),
                          rng=np.random.default_rng(0))
    raise ValueError(f"unknown model kind {kind!r} in model_config")


def _run_info(path: Path, meta: dict[str, Any], run_dir: Path) -> RunInfo:
    extra = meta.get("extra", {})
    for key in ("model_config", "dataset"):
        if key not in extra:
            raise CheckpointError(f"{path} lacks '{key}': it was not written by `leaflens distill`")
    return RunInfo(path=path, model_config=extra["model_config"], dataset=extra["dataset"],
                   metrics=extra.get("metrics", {}), run_id=str(extra.get("run_id", run_dir.name)))


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
        model = build_model(info.model_config)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{info.path}: its model_config {info.model_config} cannot be built: {exc}") from exc
    try:
        load_student_weights(model, info.path, checkpoint)
    except (ValueError, KeyError) as exc:  # weights of another model behind this model_config
        raise CheckpointError(f"{info.path} holds weights of a different model than its model_config "
                              f"{info.model_config} describes: {exc}") from exc
    return model.eval(), info
