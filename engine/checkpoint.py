"""Checkpoints: one ``.npz`` with model, optimiser, scheduler, counters, the states of named generators and,
when the run keeps one, the weight average (:class:`leaflens.engine.optim.ema.ModelEMA`).

The caller names the random generators its run draws from (``generators={"model": rng}``: dropout
masks, ...) and gets them back in the same state on load, so a resumed run draws exactly the numbers
an uninterrupted one would (see :mod:`leaflens.engine.random`: there is no hidden global stream to save).

Everything that is not an array goes into one JSON string stored as a unicode array, so loading
never needs pickle (``allow_pickle=False``). Files are written to a temporary name in the same
directory, synced, then renamed over the target: a crash mid-write leaves the old checkpoint intact.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.engine import random as erandom
from leaflens.engine.nn.module import Module
from leaflens.engine.optim.ema import ModelEMA
from leaflens.engine.optim.optimizer import Optimizer
from leaflens.engine.optim.schedulers import Scheduler
from leaflens.files import write_atomic

FORMAT = "leaflens-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or belongs to something else."""


@dataclass
class Checkpoint:
    path: Path
    epoch: int
    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def model_signature(model: Module) -> dict[str, list[int]]:
    """Parameter/buffer names and shapes: what must match for a checkpoint to belong to a model."""
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def save_checkpoint(path: str | os.PathLike[str], model: Module, optimizer: Optimizer | None = None,
                    scheduler: Scheduler | None = None, epoch: int = 0, step: int = 0,
                    extra: dict[str, Any] | None = None,
                    generators: Mapping[str, np.random.Generator] | None = None,
                    ema: ModelEMA | None = None) -> Path:
    """Write ``model`` (and whatever else is passed: optimiser, scheduler, the states of ``generators``
    by name, JSON-able ``extra``, the weight average ``ema``) to ``path`` atomically."""
    arrays: dict[str, np.ndarray] = {f"model/{k}": v for k, v in model.state_dict().items()}
    meta: dict[str, Any] = {
        "format": FORMAT,
        "model_class": type(model).__name__,
        "model_signature": model_signature(model),
        "epoch": int(epoch),
        "step": int(step),
        "generators": {name: erandom.state_of(rng) for name, rng in (generators or {}).items()},
        "extra": extra or {},
    }
    if optimizer is not None:
        osd = optimizer.state_dict()
        meta["optimizer"] = osd["meta"]
        arrays.update({f"optim/{k}": v for k, v in osd["arrays"].items()})
    if scheduler is not None:
        meta["scheduler"] = scheduler.state_dict()
    if ema is not None:
        esd = ema.state_dict()
        meta["ema"] = esd["meta"]
        arrays.update({f"ema/{k}": v for k, v in esd["arrays"].items()})
    arrays["meta"] = np.array(_meta_json(meta))
    # numpy's stub lets a key bind to savez's allow_pickle: bool; ours are model/..., optim/... and meta
    return write_atomic(path, lambda f: np.savez(f, **arrays), fsync=True)  # type: ignore[arg-type]


def _plain(value: Any) -> Any:
    """A NumPy scalar (a count from ``(pred == y).sum()``, ``lr=np.float32(...)``) as the Python number it is."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def _meta_json(meta: dict[str, Any]) -> str:
    """``meta`` as JSON; what cannot be written is named when it is the caller's ``extra`` (a key of it)."""
    try:
        return json.dumps(meta, default=_plain)
    except (TypeError, ValueError) as exc:
        extra = meta.get("extra")
        if _json_able(extra):
            raise
        bad = next((k for k, v in extra.items() if not _json_able(v)), None) if isinstance(extra, dict) else None
        raise TypeError(f"checkpoint extra{f'[{bad!r}]' if bad is not None else ''} cannot be written as JSON: "
                        f"{exc} (give numbers, strings, lists and dicts)") from exc


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value, default=_plain)
    except (TypeError, ValueError):
        return False
    return True


def read_checkpoint_arrays(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of a checkpoint file, with clear errors for anything that is not one."""
    return _read(Path(path), arrays=True)


def checkpoint_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's meta record alone (what it holds: ``"optimizer"``, ``"ema"``, ...), without its arrays."""
    return _read(Path(path), arrays=False)[0]


def _read(path: Path, arrays: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            if "meta" not in data.files:
                raise CheckpointError(f"{path} is an .npz file but not a leaflens checkpoint (no 'meta' entry)")
            meta = json.loads(str(data["meta"]))
            loaded = {k: data[k] for k in data.files if k != "meta"} if arrays else {}
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc} (truncated or not a checkpoint?)") from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta, loaded


def load_checkpoint(path: str | os.PathLike[str], model: Module | None = None, optimizer: Optimizer | None = None,
                    scheduler: Scheduler | None = None,
                    generators: Mapping[str, np.random.Generator] | None = None,
                    ema: ModelEMA | None = None) -> Checkpoint:
    """Restore whatever is passed in (``generators`` are put back in their saved states, in place); refuse
    a checkpoint made for a different model, or one lacking a state asked for, naming the file."""
    path = Path(path)
    meta, arrays = read_checkpoint_arrays(path)
    for wanted, key, what in ((optimizer, "optimizer", "no optimiser state"),
                              (scheduler, "scheduler", "no scheduler state"),
                              (ema, "ema", "no weight average (it was written by a run without one)")):
        if wanted is not None and key not in meta:
            raise CheckpointError(f"checkpoint {path} holds {what}")
    # all or nothing: a state that fails to load puts back what was loaded before it
    before = (None if model is None else model.state_dict(),
              None if optimizer is None else optimizer.state_dict(),
              None if scheduler is None else scheduler.state_dict(),
              None if ema is None else ema.state_dict(),
              {name: rng.bit_generator.state for name, rng in (generators or {}).items()})
    try:
        return _load_into(path, meta, arrays, model, optimizer, scheduler, generators, ema)
    except BaseException:
        if model is not None and before[0] is not None:
            model.load_state_dict(before[0])
        if optimizer is not None and before[1] is not None:
            optimizer.load_state_dict(before[1])
        if scheduler is not None and before[2] is not None:
            scheduler.load_state_dict(before[2])
        if ema is not None and before[3] is not None:
            ema.load_state_dict(before[3])
        for name, rng in (generators or {}).items():
            rng.bit_generator.state = before[4][name]
        raise


def _load_into(path: Path, meta: dict[str, Any], arrays: dict[str, np.ndarray], model: Module | None,
               optimizer: Optimizer | None, scheduler: Scheduler | None,
               generators: Mapping[str, np.random.Generator] | None, ema: ModelEMA | None) -> Checkpoint:
    if model is not None:
        saved_sig = meta.get("model_signature", {})
        own_sig = model_signature(model)
        if saved_sig != own_sig:
            diffs = [k for k in sorted(set(saved_sig) | set(own_sig)) if saved_sig.get(k) != own_sig.get(k)]
            first = diffs[0]
            raise CheckpointError(
                f"checkpoint {path} was saved from a different model ({meta.get('model_class')}): "
                f"{len(diffs)} parameters differ, first {first!r}: checkpoint {saved_sig.get(first)}, "
                f"model {own_sig.get(first)}")
        model.load_state_dict({k[len("model/"):]: v for k, v in arrays.items() if k.startswith("model/")})
    if optimizer is not None:
        try:
            optimizer.load_state_dict({"meta": meta["optimizer"],
                                       "arrays": {k[len("optim/"):]: v for k, v in arrays.items()
                                                  if k.startswith("optim/")}})
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if ema is not None:
        try:
            ema.load_state_dict({"meta": meta["ema"],
                                 "arrays": {k[len("ema/"):]: v for k, v in arrays.items() if k.startswith("ema/")}})
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    saved_generators = meta.get("generators", {})
    if "generators" not in meta and "rng" in meta and generators is not None and len(generators) == 1:
        # Written before generators were named: the run drew from the engine's one stream, whose state
        # is "rng". A run that now draws from one generator of its own continues that stream exactly.
        saved_generators = {next(iter(generators)): meta["rng"]}
    for name, rng in (generators or {}).items():
        if name not in saved_generators:
            raise CheckpointError(f"checkpoint {path} holds no state for the random generator {name!r} "
                                  f"(it has: {sorted(saved_generators) or 'none'}), so it cannot be resumed exactly")
        try:
            erandom.restore_state(rng, saved_generators[name])
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {path}: the state of random generator {name!r} is unusable: "
                                  f"{exc}") from exc
    return Checkpoint(path=path, epoch=meta["epoch"], step=meta["step"], extra=meta.get("extra", {}), meta=meta)
