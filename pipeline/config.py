"""Stage configuration: typed sections, the documented default TOML, a user TOML on top, then ``--set``.

``StageConfig`` is the recipe of the teacher and distill stages as a tree of typed records
(``[model]``, ``[train]``, ``[augment]``, ``[distill]``, ``[teacher]``). Every setting's value has
one home, ``pipeline/distill_default.toml``: the records give each setting its type but no default
value. The defaults need prose next to them (why 64 px, what was measured on iBeans) and users read
and copy that file, so it stays the single source rather than a file generated from Python; because
``StageConfig.from_dict`` requires every key, a default file that lacks a setting, or has one the
code does not know, fails to load, and the two cannot drift apart.

Layers: the default file, then a user TOML (``--config``), then ``--set section.key=value``
overrides in order. A key no section knows is refused with its full name (``unknown key
'train.epoch'``) and a value of the wrong type with the layer that set it. The resolved
configuration is saved beside each stage's outputs (``config.toml``) so a run can be repeated.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from leaflens.pipeline.models.family import check_family
from leaflens.records import Record, RecordError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = CONFIG_DIR / "distill_default.toml"


class ConfigError(ValueError):
    """A configuration file or override that cannot be used (the message names it)."""


@dataclass(frozen=True)
class ModelSection(Record):
    """``[model]``: the student's architecture and input size, and the family of students to train."""

    widths: tuple[int, ...]
    dropout: float
    input_size: int  # 0: the dataset's stored size
    block: Literal["conv", "separable", "lite0"]  # 3x3 conv blocks, depthwise-separable ones after the first, or
    # the first trunk_blocks blocks of ImageNet EfficientNet-Lite0 (leaflens.pipeline.models.trunk), widths[-1] its head
    family: tuple[str, ...]  # members to train, chosen on validation (leaflens.pipeline.models.family)
    trunk_blocks: int = 8  # block = "lite0": how many of Lite0's 16 blocks (8: 254 k weights, stride 16)
    # members trained one at a time, only while the teacher leads every student so far by distill.teacher_margin
    # on validation (leaflens.pipeline.distill; one also in family is not trained twice); () in runs recorded
    # before it existed
    escalate: tuple[str, ...] = ()
    escalate_lr: float = 0.0  # the escalated members' train.lr (0: train.lr itself)
    # where a distilled Lite0-trunk student's stem and blocks start: "imagenet" (Lite0's own weights) or "teacher"
    # (the fine-tuned teacher's, when the teacher folder has its network; ImageNet's otherwise). Students trained
    # without the teacher always start from ImageNet's. "imagenet" in runs recorded before it existed.
    trunk_init: Literal["imagenet", "teacher"] = "imagenet"

    def __post_init__(self) -> None:
        if not self.widths or any(w < 1 for w in self.widths):
            raise ValueError(f"widths: at least one conv block, each at least 1 wide, got {list(self.widths)}")
        if self.input_size < 0 or 0 < self.input_size < 8:  # as the family's @<px> and preprocess --size
            raise ValueError(f"input_size: 0 (the dataset's stored size) or a side of at least 8 pixels, got "
                             f"{self.input_size}")
        _check_share(self, ("dropout",))
        if not 1 <= self.trunk_blocks <= 16:
            raise ValueError(f"trunk_blocks: 1 to 16 of EfficientNet-Lite0's blocks, got {self.trunk_blocks}")
        check_family(self.family)
        if self.escalate:
            try:
                check_family(self.escalate)
            except ValueError as exc:
                raise ValueError(f"escalate: {str(exc).removeprefix('family: ')}") from None
        if not (self.escalate_lr >= 0.0 and math.isfinite(self.escalate_lr)):
            raise ValueError(f"escalate_lr: 0 (train.lr) or a learning rate above 0, got {self.escalate_lr}")


def _check_ema(decay: float) -> None:
    """``train.ema`` and ``teacher.ema``: the weight average's decay per step."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema must be in [0, 1) (0: no weight average), got {decay}")


# Range checks shared by the sections: a value that would train nothing (a learning rate of 0, a clip norm of 0
# that zeroes every gradient) or fail deep inside a stage is refused when the configuration is read, by name.
def _check_at_least_one(record: Record, names: Sequence[str]) -> None:
    for name in names:
        if getattr(record, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(record, name)}")


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 2**32:  # NumPy's generators take 0 to 2**32 - 1
        raise ValueError(f"seed must be a whole number from 0 to {2**32 - 1}, got {seed}")


def _check_positive(record: Record, names: Sequence[str], zero: str = "") -> None:
    """Finite and above 0 (``zero``: also 0, which then means what ``zero`` says)."""
    for name in names:
        v = getattr(record, name)
        if not (math.isfinite(v) and (v > 0 or (zero and v == 0))):
            raise ValueError(f"{name} must be a finite number above 0{f' (or 0: {zero})' if zero else ''}, got {v}")


def _check_share(record: Record, names: Sequence[str]) -> None:
    """In [0, 1): label smoothing, dropout, a colour jitter's strength."""
    for name in names:
        if not 0.0 <= getattr(record, name) < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {getattr(record, name)}")


# The largest crop area a recipe may ask for, as a multiple of the photo's (zoomed out): the engine's own
# bound (leaflens.engine.data.MAX_ZOOM_OUT), repeated so that reading a config does not import the engine.
MAX_ZOOM_OUT = 4.0


def _check_area(name: str, pair: tuple[float, float]) -> None:
    lo, hi = pair
    if not 0.0 < lo <= hi <= MAX_ZOOM_OUT:
        raise ValueError(f"{name} is the [min, max] area fraction of the crops (above 1: zoomed out), "
                         f"0 < min <= max <= {MAX_ZOOM_OUT:g}, got {list(pair)}")


@dataclass(frozen=True)
class TrainSection(Record):
    """``[train]``: the student's optimisation (also the --train-cnn teacher's)."""

    epochs: int
    batch_size: int
    optimizer: Literal["adamw", "sgd"]
    lr: float
    weight_decay: float
    warmup_epochs: int
    clip_grad_norm: float
    label_smoothing: float
    early_stopping_patience: int
    seed: int
    max_bad_steps: int
    eval_batch_size: int
    device: Literal["auto", "cpu", "cuda"]
    mixed_precision: Literal["auto", "on", "off"]
    outlier_exposure: float = 0.0  # weight of the generated-negatives loss (leaflens.pipeline.negatives); 0: off
    # a pretrained student's (model.block = "lite0") BatchNorm layers keep their pretrained running statistics
    # in training too, as the teacher's fine-tune does (teacher.freeze_bn); false in runs recorded before it existed
    freeze_bn: bool = False
    # decay per step of a running average of the weights that validation judges and best.npz keeps
    # (leaflens.engine.optim.ModelEMA); 0: none, the last step's weights (as in runs recorded before it existed)
    ema: float = 0.0
    # the fewest optimiser steps a student takes: with few training photos ``epochs`` (and the early-stopping
    # patience with them) is raised to reach them (leaflens.pipeline.training.epochs_for_steps); 0: as given
    min_steps: int = 0

    def __post_init__(self) -> None:
        _check_ema(self.ema)
        _check_seed(self.seed)
        _check_positive(self, ("min_steps",), zero="epochs as given")
        _check_at_least_one(self, ("epochs", "batch_size", "eval_batch_size", "max_bad_steps"))
        _check_positive(self, ("lr", "clip_grad_norm"))
        _check_positive(self, ("weight_decay",), zero="no weight decay")
        _check_positive(self, ("outlier_exposure",), zero="off")
        _check_share(self, ("label_smoothing",))
        for name in ("warmup_epochs", "early_stopping_patience"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0{' (0: never stop early)' if 'patience' in name else ''}, "
                                 f"got {getattr(self, name)}")


@dataclass(frozen=True)
class AugmentSection(Record):
    """``[augment]``: the student loader's augmentation."""

    hflip: bool
    vflip: bool
    crop: Literal["resized", "pad", "none"]
    scale: tuple[float, float]
    brightness: float
    contrast: float

    def __post_init__(self) -> None:
        _check_area("scale", self.scale)
        _check_share(self, ("brightness", "contrast"))


@dataclass(frozen=True)
class DistillSection(Record):
    """``[distill]``: the distillation loss, which students are trained, and which model is kept."""

    feature_weight: float
    alpha: float
    kd_weight: float
    temperature: float
    # Beta(mixup, mixup) mixing of the student's batches with targets mixed alike (0: off)
    mixup: float
    same_view: bool
    compare_scratch: bool
    # Which model the run keeps (leaflens.pipeline.selection): the serving budget and the teacher's margin.
    max_params: int
    max_ms: float
    teacher_margin: float
    # The fine-tuned teacher's network judges every batch's own fresh views (pipeline/teachers/online.py)
    teacher_online: bool
    # Centre crops (shares of the stored side) each trained student is also scored at on validation, beside the
    # whole photo; the best is its contract's (leaflens.data_prep.contract). () in runs recorded before it existed.
    centre_crops: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _check_positive(self, ("feature_weight", "alpha", "kd_weight"), zero="that loss term off")
        _check_positive(self, ("temperature",))
        if self.feature_weight + self.alpha + self.kd_weight == 0:
            raise ValueError("feature_weight, alpha and kd_weight are all 0: the distilled student would learn nothing")
        bad = [c for c in self.centre_crops if not (isinstance(c, (int, float)) and 0.0 < c < 1.0)]
        if bad:
            raise ValueError(f"centre_crops are shares of the photo's side in (0, 1) (the whole photo is always "
                             f"tried as well), got {bad[0]!r}")
        if self.max_params < 0 or not (math.isfinite(self.max_ms) and self.max_ms >= 0):
            raise ValueError(f"max_params and max_ms must be finite numbers >= 0 (0: no limit), got "
                             f"{self.max_params} and {self.max_ms}")
        if not 0.0 <= self.teacher_margin <= 1.0:
            raise ValueError(f"teacher_margin is a share of the validation photos in [0, 1], got {self.teacher_margin}")
        if not (math.isfinite(self.mixup) and self.mixup >= 0):
            raise ValueError(f"mixup is the alpha of the Beta(alpha, alpha) mixing weight, a finite number >= 0 "
                             f"(0: no mixup; 0.2-0.4 are usual), got {self.mixup}")


@dataclass(frozen=True)
class TeacherSection(Record):
    """``[teacher]``: the EfficientNet-Lite0 fine-tune, the teacher's view bank, the --train-cnn teacher."""

    frozen: bool
    input_size: int
    finetune_from_block: int
    augment: Literal["rrc", "cached"]  # a fresh random-resized crop per photo and epoch, or cached fronts
    rrc_scale: tuple[float, float]
    freeze_bn: bool
    dropout: float
    epochs: int
    batch_size: int
    lr: float
    head_lr: float
    weight_decay: float
    warmup_epochs: int
    label_smoothing: float
    clip_grad_norm: float
    mirror: bool
    seed: int
    encode_batch_size: int
    views: int
    view_scale: tuple[float, float]
    cnn_widths: tuple[int, ...]
    cnn_epochs: int
    # Self-training on the unlabelled photos (pipeline/teachers/self_train.py): on, the val accuracy the kept
    # pseudo-labels' threshold must reach, and the second round's epochs.
    self_train: bool
    self_train_target: float
    self_train_epochs: int
    # decay per step of the fine-tune's running average of the weights (as train.ema); 0: none (as in teachers
    # recorded before it existed)
    ema: float = 0.0
    # the fewest optimiser steps of the first fine-tune: with few labelled photos ``epochs`` is raised to reach
    # them (pipeline/teachers/finetune.py epochs_for); 0: epochs as given (as in teachers recorded before it)
    min_steps: int = 0

    def __post_init__(self) -> None:
        _check_ema(self.ema)
        _check_seed(self.seed)
        _check_positive(self, ("min_steps",), zero="epochs as given")
        _check_at_least_one(self, ("input_size", "epochs", "batch_size", "encode_batch_size", "views", "cnn_epochs",
                                   "self_train_epochs"))
        if self.finetune_from_block < 0:
            raise ValueError(f"finetune_from_block must be >= 0 (0: every block trains), got "
                             f"{self.finetune_from_block}")
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        _check_positive(self, ("lr", "head_lr", "clip_grad_norm"))
        _check_positive(self, ("weight_decay",), zero="no weight decay")
        _check_area("rrc_scale", self.rrc_scale)
        _check_area("view_scale", self.view_scale)
        _check_share(self, ("dropout", "label_smoothing"))
        if not self.cnn_widths or any(w < 1 for w in self.cnn_widths):
            raise ValueError(f"cnn_widths: at least one conv block, each at least 1 wide, got {list(self.cnn_widths)}")
        if not 0.0 <= self.self_train_target <= 1.0:
            raise ValueError(f"self_train_target is a validation accuracy in [0, 1], got {self.self_train_target}")


@dataclass(frozen=True)
class StageConfig(Record):
    """The whole recipe; ``load_config`` builds it."""

    model: ModelSection
    train: TrainSection
    augment: AugmentSection
    distill: DistillSection
    teacher: TeacherSection


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    try:
        data = path.read_bytes()
        # Windows Notepad's "UTF-8 with BOM": the mark is not TOML, but the text after it is what was meant
        return tomllib.loads(data.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder; give a .toml file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8 TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _section_type(hint: Any) -> type[Record] | None:
    return hint if isinstance(hint, type) and issubclass(hint, Record) else None


def overlay(base: dict[str, Any], top: dict[str, Any], where: str, record: type[Record] = StageConfig,
            prefix: str = "") -> dict[str, Any]:
    """``top``'s settings over ``base`` (raw TOML tables); a key ``record`` does not know is refused by
    its full dotted name, so a typo never passes silently."""
    hints = typing.get_type_hints(record)
    names = names_of(record)
    out = dict(base)
    for key, value in top.items():
        dotted = prefix + key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {prefix + close[0]!r}? " if close else ""
            raise ConfigError(f"{where}: unknown key {dotted!r} ({hint}known: {', '.join(prefix + n for n in names)})")
        section = _section_type(hints[key])
        if section is None:
            out[key] = value
        elif not isinstance(value, dict):
            raise ConfigError(f"{where}: {dotted!r} is a section; set one of its keys, e.g. "
                              f"{dotted}.{names_of(section)[0]}")
        else:
            out[key] = overlay(dict(base.get(key, {})), value, where, section, dotted + ".")
    return out


def names_of(record: type[Record]) -> list[str]:
    """The keys a record knows, in declaration order."""
    return [f.name for f in dataclasses.fields(record)]


def _build(data: dict[str, Any], where: str) -> StageConfig:
    try:
        return StageConfig.from_dict(data, where)
    except RecordError as exc:
        raise ConfigError(str(exc)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.epochs=5`` -> (["train", "epochs"], 5); values are read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip().split("."), value


def sets_a_flag_overrides(overrides: Sequence[str | tuple[str, str]]) -> list[tuple[str, str]]:
    """(``--set`` as typed, the flag) for each ``--set`` whose key a flag given with it sets too (``--set
    train.seed=5 --seed 7``): the flag wins, as documented, and the person should hear that their --set did
    nothing."""
    sets = [(item.split("=", 1)[0].strip(), item) for item in overrides if isinstance(item, str)]
    out: list[tuple[str, str]] = []
    for item in overrides:
        if isinstance(item, tuple):
            key = item[0].split("=", 1)[0].strip()
            out.extend((f"--set {typed}", item[1]) for k, typed in sets if k == key)
    return out


def settings_not_read(overrides: Sequence[str | tuple[str, str]], read: Sequence[str]) -> list[str]:
    """The ``--set`` overrides (as typed) whose key is none of ``read`` (sections, ``"train"``, or single keys,
    ``"train.max_bad_steps"``): settings the command at hand never looks at, as ``distill --set
    teacher.epochs=2``, which a person expects to change something."""
    out = []
    for item in overrides:
        if not isinstance(item, str):
            continue  # a flag's own override: the command reads it
        key = item.split("=", 1)[0].strip()
        if not any(key == r or key.startswith(r + ".") for r in read):
            out.append(item)
    return out


_EPOCH_FLOORS = {  # (epochs, their min_steps) of what each command trains
    "distill": (("train.epochs", "train.min_steps"),),
    "teacher": (("teacher.epochs", "teacher.min_steps"), ("teacher.cnn_epochs", "train.min_steps")),
}


def given_settings(overrides: Sequence[str | tuple[str, str]],
                   config_file: str | os.PathLike[str] | None = None) -> set[str]:
    """The settings (``section.key``) the user named, on the command line or in their own ``--config`` file, as
    opposed to those left to the recipe. Raises :class:`ConfigError` for a file it cannot read."""
    keys = {(item if isinstance(item, str) else item[0]).split("=", 1)[0].strip() for item in overrides}
    if config_file:
        keys |= {f"{section}.{key}" for section, table in read_toml(config_file).items()
                 if isinstance(table, dict) for key in table}
    return keys


def epochs_as_given(overrides: Sequence[str | tuple[str, str]],
                    config_file: str | os.PathLike[str] | None = None,
                    command: str | None = None) -> list[tuple[str, str]]:
    """``min_steps = 0`` overrides for the sections whose epochs the command line or the user's ``--config``
    file names without naming their ``min_steps``: ``--epochs 2`` (or ``--set train.epochs=2``, or
    ``epochs = 2`` under ``[train]`` in the file) means two epochs, not "at least 240 steps" (the recipe's
    ``min_steps`` is for the epochs it chose itself, on few photos). ``teacher.cnn_epochs`` is the --train-cnn
    teacher's, which trains with ``[train]``. ``command`` ("distill", "teacher"): only the epochs it trains count
    (a config file shared by both stages names the other's too); None: both. Raises :class:`ConfigError` for a
    file it cannot read."""
    keys = given_settings(overrides, config_file)
    out: dict[str, tuple[str, str]] = {}  # one override per min_steps key (train.epochs and cnn_epochs share one)
    pairs = _EPOCH_FLOORS[command] if command is not None else tuple(p for v in _EPOCH_FLOORS.values() for p in v)
    for epochs, steps in pairs:
        if epochs in keys and steps not in keys:
            out.setdefault(steps, (f"{steps}=0", f"{epochs} as given ({steps} = 0)"))
    return list(out.values())


def load_config(user_file: str | os.PathLike[str] | None = None,
                overrides: Sequence[str | tuple[str, str]] = ()) -> StageConfig:
    """The default TOML (shipped in pipeline/) <- ``user_file`` <- ``overrides``, each layer checked.

    An override is ``"section.key=value"`` (an error names it as ``--set section.key=value``) or a pair of it
    and what the person typed, e.g. ``("train.epochs=0", "--epochs 0")``, for the flags that set one key."""
    data = read_toml(DEFAULT_CONFIG)
    cfg = _build(data, str(DEFAULT_CONFIG))
    layers: list[tuple[str, dict[str, Any]]] = []
    if user_file:
        layers.append((str(user_file), read_toml(user_file)))
    for item in overrides:
        text, given = (item, f"--set {item}") if isinstance(item, str) else item
        keys, value = parse_override(text)
        patch: dict[str, Any] = {}
        node = patch
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        layers.append((given, patch))
    for where, top in layers:
        data = overlay(data, top, where)
        cfg = _build(data, where)
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} to TOML")


def dump_toml(cfg: Record) -> str:
    """TOML text for a two-level record (top-level scalars, then one table per section)."""
    data = cfg.to_dict()
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict) and v is not None]
    for section, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines).lstrip("\n") + "\n"
