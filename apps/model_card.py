"""The self-description an exported leaflens model carries in its ONNX ``metadata_props``.

The exporter writes these keys and the Predictor reads them, so a ``.onnx`` file alone is enough to
serve: class names and the whole preprocessing contract (leaflens.data_prep.contract: decode at the
stored size with the resize rule, area-average to the input size, normalise) travel with the
weights and cannot drift apart from them. All values are strings (ONNX metadata is string -> string):

==============================  =========  ===============================================
key                             required   value
==============================  =========  ===============================================
leaflens.format                 yes        "4" when the contract has a centre crop, else "3" (so a leaflens
                                           that cannot apply the crop refuses the file rather than serve it
                                           wrong); "2": before the out-of-domain check; "1": before the
                                           stored size was recorded
leaflens.classes                yes        JSON list of class names
leaflens.stored_size            format 2   photos are first decoded to a stored_size square
leaflens.input_size             yes        S (input is [N, 3, S, S]), reached by area averaging
leaflens.mean / leaflens.std    yes        JSON lists of 3 floats on the [0, 1] pixel scale
leaflens.layout                 yes        "NCHW"
leaflens.resize                 yes        "crop" or "pad" (as in leaflens.data_prep.decode)
leaflens.shorter_side           no         int; "crop" with the shorter side at this size, then the centre
                                           stored_size square (a served teacher); absent: straight to stored_size
leaflens.centre_crop            format 4   float in (0, 1); the centre square of that share of the stored
                                           side is kept before the area resize; absent: the whole square
leaflens.uncertain_threshold    no         float; top probability below it (or a near tie, TIE_RATIO) => "ambiguous"
leaflens.ood                    no         JSON :class:`OODCheck`: how ``ood_score`` is judged; present
                                           exactly when the graph has the ``ood_score`` output
leaflens.val_ambiguous          no         float, share of validation photos "ambiguous" by the rule above
leaflens.tie_ratio              no         float, the near-tie ratio val_ambiguous counts (absent: the threshold alone)
leaflens.temperature            no         float; the logits were divided by it (folded into the classifier's weights)
                                           so the probabilities are calibrated on validation; absent: not calibrated
leaflens.dataset                no         JSON :class:`TrainedOn`: what the model was trained on (drawn
                                           leaves of `leaflens data synth`, or photos), from the dataset's
                                           manifest; absent in files exported before it was recorded
leaflens.dataset_use            no         JSON {"train": int, "unlabeled": int}: of those, the labelled
                                           photos trained on (the rest chose and tested it) and the
                                           unlabelled ones a distilled student learned from; with dataset
leaflens.grey_share             no         float, share of the training photos without colour
                                           (leaflens.data_prep.quality); 0: a photo without colour is
                                           refused ("no_colour"); absent: not recorded, nothing refused
leaflens.precision              no         "fp16" or "int8": made from the FP32 model, with its own accuracy
                                           and thresholds; absent: the FP32 model (or exported before it)
leaflens.run_id                 no         training run id
leaflens.accuracy               no         float, test accuracy of that run
leaflens.params                 no         int, parameter count
==============================  =========  ===============================================

Format 1 files (exported before the stored size was recorded) are read with the stored size equal to
the input size: photos are decoded straight to the input size, as leaflens did when it wrote them.
Format 2 files have no out-of-domain score: they are served with the "ambiguous" rule alone.
``leaflens.dataset`` is optional within format 3: older readers ignore it, and files without it say nothing
about their training data (the Model tab says it is not recorded).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from leaflens.data_prep.contract import ContractError, PreprocessContract
from leaflens.records import Record

if TYPE_CHECKING:
    from leaflens.data_prep.manifest import Manifest

__all__ = ["DEFAULT_UNCERTAIN_THRESHOLD", "FORMAT_VERSION", "TIE_RATIO", "ModelCard", "ModelError", "OODBranch",
           "OODCheck", "TrainedOn", "flag_confidence", "trained_on", "unsure"]

FORMAT_VERSION = "4"
# The format of a file whose contract has no centre crop: leaflens versions before format 4 serve it right.
FORMAT_WITHOUT_CROP = 3
# Used when a model carries no calibrated threshold: with 3 to 40 classes, a top probability under
# one half means the model itself rates another answer as likely as its first choice.
DEFAULT_UNCERTAIN_THRESHOLD = 0.5
# An answer whose second class has at least this share of the first's probability is "ambiguous" whatever the
# threshold: the model cannot tell the two apart (odds within 10 %), so neither is claimed. The threshold is an
# order statistic of the validation photos and lets such coin flips through on a weak model: the demo's (77 %
# on validation, threshold 0.20) answered 15 of its 181 validation photos so, "Mosaic virus (24 %), next
# Powdery mildew (24 %)" with treatment notes, and 3 of those 15 were right; the iBeans student (96 %) has
# none among its 133 (benchmarks/near_ties.py, on validation photos only).
TIE_RATIO = 0.9


def unsure(probs: Any, threshold: float) -> Any:
    """Whether the answer for each row of class probabilities (last axis) is "ambiguous": a top probability
    below ``threshold``, or a second class within :data:`TIE_RATIO` of the first. A bool for one row."""
    p = np.asarray(probs, dtype=np.float64)
    if p.shape[-1] < 2:
        out = p.max(axis=-1) < threshold
    else:
        two = -np.partition(-p, 1, axis=-1)[..., :2]
        out = (two[..., 0] < threshold) | (two[..., 1] >= TIE_RATIO * two[..., 0])
    return bool(out) if np.ndim(out) == 0 else out
PREFIX = "leaflens."
_REQUIRED = ("format", "classes", "input_size", "mean", "std", "layout", "resize")


class ModelError(ValueError):
    """An ONNX file that is not a usable leaflens model; the message names the file and the key."""


@dataclass(frozen=True)
class OODBranch(Record):
    """The generic-feature branch an out-of-domain score also reads (leaflens.pipeline.ood.GenericBranch):
    the first ``blocks`` blocks of a frozen pretrained network (``kind``), whose ``maps`` feature maps add to
    the score's blocks; ``params`` weights it adds to the file, read from ``weights``."""

    kind: str
    blocks: int
    maps: int
    params: int
    weights: str


@dataclass(frozen=True)
class OODCheck(Record):
    """How a model's ``ood_score`` output is judged (leaflens.pipeline.ood): above ``threshold`` the photo
    is out of domain. The score was fitted on ``train_photos`` training photos, on ``blocks`` feature maps
    (``branch``: those of a generic-feature branch among them; None, and left out of the file, when the score
    reads the model's own maps alone, as every file before the branch did); ``val_flagged`` of the
    ``val_photos`` validation photos score above the threshold.

    ``budget``: since ``confidence`` is recorded, the share of genuine NEW photos the check may flag, held
    with probability ``confidence`` over the draw of the validation photos (the threshold is an order
    statistic chosen for that: :func:`flag_confidence`; the confidence that holds is recorded, at least the
    one asked or less with too few validation photos, where earlier files recorded the one asked:
    ``achieved_confidence`` is right for both); files without ``confidence`` were exported when the
    budget was the share of the validation photos themselves, whose expected share on new photos is higher."""

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"branch", "confidence"})
    method: str
    threshold: float
    budget: float
    val_photos: int
    val_flagged: float
    train_photos: int
    blocks: int
    branch: OODBranch | None = None
    confidence: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and np.isfinite(self.threshold)):
            raise ContractError("ood", f"threshold must be a finite number, got {self.threshold!r}")
        if not 0.0 < self.budget < 0.5:
            raise ContractError("ood", f"budget must be in (0, 0.5), got {self.budget!r}")
        if self.confidence is not None and not 0.0 < self.confidence < 1.0:
            raise ContractError("ood", f"confidence must be in (0, 1), got {self.confidence!r}")

    @property
    def achieved_confidence(self) -> float:
        """The probability, over the draw of the validation photos, that at most ``budget`` of genuine new
        photos score above the threshold: below ``confidence`` when there were too few validation photos
        to reach it (see :func:`flag_confidence`)."""
        return flag_confidence(self.val_photos, round(self.val_flagged * self.val_photos), self.budget)


def flag_confidence(n: int, flagged: int, budget: float) -> float:
    """The probability that a threshold above all but ``flagged`` of ``n`` in-domain scores flags at most
    ``budget`` of further in-domain photos drawn from the same distribution: ``P(Binomial(n, budget) >
    flagged)``. (The share of new photos above the (flagged+1)-th highest of n exchangeable scores is
    Beta(flagged+1, n-flagged)-distributed, Vovk 2012.) With 133 photos and a 3 % budget: 0.98 when none
    is flagged, 0.91 for one, 0.77 for two."""
    if n <= 0 or not 0.0 < budget < 1.0:
        return 0.0
    log_p, log_q = math.log(budget), math.log1p(-budget)
    below = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p
                         + (n - i) * log_q) for i in range(min(int(flagged), n) + 1))
    return max(0.0, 1.0 - below)


# TrainedOn's counts written under leaflens.dataset_use, beside leaflens.dataset (see ModelCard.to_metadata)
_DATASET_USE = ("train", "unlabeled")


@dataclass(frozen=True)
class TrainedOn(Record):
    """What a model was trained on, as the Model tab tells it: ``kind`` "synthetic" (leaves drawn by
    `leaflens data synth`, the demo), "photos", or "unknown" (the folder the dataset was made from is gone,
    so it cannot be told); ``photos``: labelled images in the dataset (all splits); ``generator``: what drew
    them, for synthetic data; ``train``: the labelled ones trained on (the rest chose and tested the model);
    ``unlabeled``: images without labels it also learned from (absent: none, or not recorded)."""

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"generator", "train", "unlabeled"})
    kind: Literal["synthetic", "photos", "unknown"]
    photos: int
    generator: str | None = None
    train: int | None = None
    unlabeled: int | None = None

    def __post_init__(self) -> None:
        for name in ("photos", "train", "unlabeled"):
            value = getattr(self, name)
            if not (value is None and name != "photos" or isinstance(value, int) and value >= 0):
                raise ContractError("dataset", f"{name} must be a count >= 0, got {value!r}")

    @property
    def synthetic(self) -> bool:
        return self.kind == "synthetic"


def trained_on(manifest: Manifest, cwd: str | os.PathLike | None = None,
               source_root: str | os.PathLike | None = None) -> TrainedOn:
    """What a dataset was made from, by its manifest: "synthetic" when the folder `leaflens preprocess` read
    (``source_root``, relative to ``cwd``; the argument, where the caller found the folder after a move,
    wins over the manifest's record) holds the ``synth.json`` that `leaflens data synth` writes there,
    "photos" when that folder is there without one, "unknown" when it is gone."""
    from leaflens.data_prep.synth import SYNTH_META, SynthInfo

    photos = sum(s.count for s in manifest.splits.values() if s.labels == "present")
    split = manifest.splits.get("train")
    unl = manifest.splits.get("unlabeled")
    train = split.count if split is not None else None
    unlabeled = unl.count if unl is not None and unl.count else None
    recorded = source_root or manifest.source_root
    if not recorded:
        return TrainedOn(kind="unknown", photos=photos, train=train, unlabeled=unlabeled)
    source = Path(recorded)
    if not source.is_absolute() and cwd is not None:
        source = Path(cwd) / source
    meta = source / SYNTH_META
    if meta.is_file():
        try:
            info = SynthInfo.from_dict(json.loads(meta.read_text(encoding="utf-8")), str(meta))
            generator: str | None = info.generator
        except (OSError, ValueError, TypeError):  # a synth.json of another version: synthetic all the same
            generator = None
        return TrainedOn(kind="synthetic", photos=photos, generator=generator, train=train, unlabeled=unlabeled)
    return TrainedOn(kind="photos" if source.is_dir() else "unknown", photos=photos, train=train,
                     unlabeled=unlabeled)


@dataclass(frozen=True)
class ModelCard(Record):
    """What a leaflens ONNX model says about itself (see the module docstring for the keys)."""

    SCHEMA_VERSION: ClassVar[int | None] = int(FORMAT_VERSION)
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"trained_on", "grey_share", "tie_ratio",
                                                          "precision", "temperature"})  # as before them

    classes: tuple[str, ...]
    contract: PreprocessContract
    layout: Literal["NCHW"] = "NCHW"
    uncertain_threshold: float = DEFAULT_UNCERTAIN_THRESHOLD
    threshold_from_model: bool = False  # False: the default above was used
    run_id: str | None = None
    accuracy: float | None = None
    params: int | None = None
    ood: OODCheck | None = None  # None: the model has no out-of-domain output (format <= 2, or not fitted)
    val_ambiguous: float | None = None
    trained_on: TrainedOn | None = None  # None: not recorded (exported before leaflens.dataset existed)
    grey_share: float | None = None  # share of training photos without colour; None: not recorded
    # the near-tie ratio val_ambiguous was measured with (TIE_RATIO at export); None: exported before near ties
    # counted as "ambiguous", so val_ambiguous counts the threshold alone
    tie_ratio: float | None = None
    # "fp16" or "int8" for a file made from the FP32 model, whose accuracy and thresholds are its own; None: the
    # FP32 model itself, or a file exported before it was recorded
    precision: Literal["fp16", "int8"] | None = None
    # the temperature the served logits were divided by (leaflens.pipeline.calibration); None: not calibrated
    temperature: float | None = None
    schema_version: int = int(FORMAT_VERSION)

    def __post_init__(self) -> None:
        classes = self.classes
        if not (isinstance(classes, (list, tuple)) and classes and all(isinstance(c, str) and c for c in classes)):
            raise ContractError("classes", "must be a non-empty JSON list of non-empty strings")
        if len(set(classes)) != len(classes):
            raise ContractError("classes", "has duplicate class names")
        object.__setattr__(self, "classes", tuple(classes))
        if self.layout != "NCHW":
            raise ContractError("layout", f"is {self.layout!r}; only 'NCHW' is supported")
        if not 0.0 <= self.uncertain_threshold <= 1.0:
            raise ContractError("uncertain_threshold", f"must be in [0, 1], got {self.uncertain_threshold}")
        if self.temperature is not None and not (np.isfinite(self.temperature) and self.temperature > 0):
            raise ContractError("temperature", f"must be a finite number above 0, got {self.temperature}")

    # -- the contract's figures, where callers look for them --------------------------------------
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_size(self) -> int:
        return self.contract.input_size

    @property
    def stored_size(self) -> int:
        return self.contract.stored_size

    @property
    def mean(self) -> tuple[float, float, float]:
        return self.contract.mean

    @property
    def std(self) -> tuple[float, float, float]:
        return self.contract.std

    @property
    def resize(self) -> str:
        return self.contract.resize

    # -- ONNX metadata ------------------------------------------------------------------------------
    def to_metadata(self) -> dict[str, str]:
        """The ``metadata_props`` entries (key -> string value) that describe this model."""
        meta = {
            "format": str(self.schema_version if self.contract.centre_crop is not None else FORMAT_WITHOUT_CROP),
            "classes": json.dumps(list(self.classes)),
            "stored_size": str(self.stored_size),
            "input_size": str(self.input_size),
            "mean": json.dumps([float(v) for v in self.mean]),
            "std": json.dumps([float(v) for v in self.std]),
            "layout": self.layout,
            "resize": self.resize,
        }
        if self.contract.shorter_side is not None:
            meta["shorter_side"] = str(int(self.contract.shorter_side))
        if self.contract.centre_crop is not None:
            meta["centre_crop"] = repr(float(self.contract.centre_crop))
        if self.threshold_from_model:
            meta["uncertain_threshold"] = repr(float(self.uncertain_threshold))
        if self.run_id is not None:
            meta["run_id"] = self.run_id
        if self.accuracy is not None:
            meta["accuracy"] = repr(float(self.accuracy))
        if self.params is not None:
            meta["params"] = str(int(self.params))
        if self.ood is not None:
            meta["ood"] = json.dumps(self.ood.to_dict())
        if self.val_ambiguous is not None:
            meta["val_ambiguous"] = repr(float(self.val_ambiguous))
        if self.trained_on is not None:
            # the counts of its use go under a key of their own: a leaflens that reads leaflens.dataset but not
            # them (strict about that record's keys) still serves the file
            record = self.trained_on.to_dict()
            use = {k: record.pop(k) for k in _DATASET_USE if k in record}
            meta["dataset"] = json.dumps(record)
            if use:
                meta["dataset_use"] = json.dumps(use)
        if self.grey_share is not None:
            meta["grey_share"] = repr(float(self.grey_share))
        if self.tie_ratio is not None:
            meta["tie_ratio"] = repr(float(self.tie_ratio))
        if self.precision is not None:
            meta["precision"] = self.precision
        if self.temperature is not None:
            meta["temperature"] = repr(float(self.temperature))
        return {PREFIX + k: v for k, v in meta.items()}

    @property
    def refuses_grey(self) -> bool:
        """Whether a photo without colour is refused: the training photos all had colour."""
        return self.grey_share == 0.0

    @classmethod
    def _upgrade(cls, data: dict[str, Any], version: int, where: str) -> dict[str, Any]:
        """Format 1 recorded no stored size: its photos were decoded straight to the input size.
        Format 2 had no out-of-domain output: nothing to add (``ood`` stays None). Format 3 had no centre
        crop: the whole stored square (``centre_crop`` stays None)."""
        if version == 1:
            contract = dict(data["contract"])
            contract.setdefault("stored_size", contract["input_size"])
            return {**data, "contract": contract}
        if version in (2, 3):
            return data
        return super()._upgrade(data, version, where)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str], source: str) -> ModelCard:
        """Parse and check ``metadata_props``; raise :class:`ModelError` naming ``source`` and the key."""

        def fail(key: str, why: str) -> ModelError:
            return ModelError(f"{source}: metadata key '{PREFIX}{key}' {why}")

        def get(key: str) -> str:
            return meta[PREFIX + key]

        missing = [k for k in _REQUIRED if PREFIX + k not in meta]
        if missing:
            names = ", ".join(f"'{PREFIX}{k}'" for k in missing)
            raise ModelError(
                f"{source}: not a leaflens model, missing metadata key(s) {names} "
                "(export it with `leaflens export`)"
            )
        newest = cls.SCHEMA_VERSION or 1
        if get("format") not in {str(v) for v in range(1, newest + 1)}:
            raise fail("format", f"is {get('format')!r}; this version of leaflens reads formats 1 to {newest} "
                                 "(a newer leaflens wrote it? upgrade leaflens)")
        version = int(get("format"))
        if version >= 2 and PREFIX + "stored_size" not in meta:
            raise fail("stored_size", f"is missing (format {version} records it)")

        def json_value(key: str) -> Any:
            try:
                return json.loads(get(key))
            except json.JSONDecodeError as exc:
                raise fail(key, f"is not JSON: {exc}") from exc

        def number(key: str, kind: type) -> Any:
            try:
                return kind(get(key))
            except ValueError as exc:
                what = "an integer" if kind is int else "a number"
                raise fail(key, f"is not {what}: {get(key)!r}") from exc

        contract = {"input_size": number("input_size", int), "mean": json_value("mean"),
                    "std": json_value("std"), "resize": get("resize")}
        if PREFIX + "stored_size" in meta:
            contract["stored_size"] = number("stored_size", int)
        if PREFIX + "shorter_side" in meta:  # absent (every student, older files): decoded straight to stored_size
            contract["shorter_side"] = number("shorter_side", int)
        if PREFIX + "centre_crop" in meta:
            if version < 4:
                raise fail("centre_crop", f"is in a format {version} file; format 4 carries it")
            contract["centre_crop"] = number("centre_crop", float)
        data: dict[str, Any] = {"classes": json_value("classes"), "contract": contract, "layout": get("layout")}
        if PREFIX + "uncertain_threshold" in meta:
            data["uncertain_threshold"] = number("uncertain_threshold", float)
            data["threshold_from_model"] = True
        data["run_id"] = meta.get(PREFIX + "run_id")
        data["accuracy"] = number("accuracy", float) if PREFIX + "accuracy" in meta else None
        data["params"] = number("params", int) if PREFIX + "params" in meta else None
        data["val_ambiguous"] = number("val_ambiguous", float) if PREFIX + "val_ambiguous" in meta else None
        if PREFIX + "tie_ratio" in meta:
            data["tie_ratio"] = number("tie_ratio", float)
        if PREFIX + "temperature" in meta:
            data["temperature"] = number("temperature", float)
        if PREFIX + "precision" in meta:
            if get("precision") not in ("fp16", "int8"):
                raise fail("precision", f"must be fp16 or int8, got {get('precision')!r}")
            data["precision"] = get("precision")
        if PREFIX + "grey_share" in meta:
            data["grey_share"] = number("grey_share", float)
            if not 0.0 <= data["grey_share"] <= 1.0:
                raise fail("grey_share", f"must be a share from 0 to 1, got {data['grey_share']}")
        if PREFIX + "dataset" in meta:
            try:
                record = json_value("dataset")
                use = json_value("dataset_use") if PREFIX + "dataset_use" in meta else {}
                if not isinstance(use, dict) or set(use) - set(_DATASET_USE):
                    raise fail("dataset_use", f"must be an object with {' and/or '.join(_DATASET_USE)}, got {use!r}")
                record = {**record, **use} if isinstance(record, dict) else record
                data["trained_on"] = TrainedOn.from_dict(record, f"{source} metadata '{PREFIX}dataset'")
            except (ValueError, TypeError) as exc:
                raise fail("dataset", f"is not a valid description of the training data: {exc}") from exc
        if PREFIX + "ood" in meta:
            try:
                data["ood"] = OODCheck.from_dict(json_value("ood"), f"{source} metadata '{PREFIX}ood'")
            except (ValueError, TypeError) as exc:
                raise fail("ood", f"is not a valid out-of-domain check: {exc}") from exc
        if version < newest:
            data = cls._upgrade(data, version, source)
        try:
            return cls(**{**data, "contract": PreprocessContract(**data["contract"])})
        except ContractError as exc:
            raise fail(exc.field, exc.why) from exc
