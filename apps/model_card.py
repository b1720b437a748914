"""The self-description an exported leaflens model carries in its ONNX ``metadata_props``.

The exporter writes these keys and the Predictor reads them, so a ``.onnx`` file alone is enough to
serve: class names, input size, normalisation and resize mode travel with the weights and cannot
drift apart from them. All values are strings (ONNX metadata is string -> string):

==============================  =========  ===============================================
key                             required   value
==============================  =========  ===============================================
leaflens.format                 yes        "1"
leaflens.classes                yes        JSON list of class names
leaflens.input_size             yes        S (input is [N, 3, S, S])
leaflens.mean / leaflens.std    yes        JSON lists of 3 floats on the [0, 1] pixel scale
leaflens.layout                 yes        "NCHW"
leaflens.resize                 yes        "crop" or "pad" (as in leaflens.data_prep.decode)
leaflens.uncertain_threshold    no         float; top probability below it => "uncertain"
leaflens.run_id                 no         training run id
leaflens.accuracy               no         float, test accuracy of that run
leaflens.params                 no         int, parameter count
==============================  =========  ===============================================
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_UNCERTAIN_THRESHOLD", "FORMAT_VERSION", "ModelCard", "ModelError"]

FORMAT_VERSION = "1"
# Used when a model carries no calibrated threshold: with 3 to 40 classes, a top probability under
# one half means the model itself rates another answer as likely as its first choice.
DEFAULT_UNCERTAIN_THRESHOLD = 0.5
PREFIX = "leaflens."
_REQUIRED = ("format", "classes", "input_size", "mean", "std", "layout", "resize")


class ModelError(ValueError):
    """An ONNX file that is not a usable leaflens model; the message names the file and the key."""


@dataclass(frozen=True)
class ModelCard:
    """What a leaflens ONNX model says about itself (see the module docstring for the keys)."""

    classes: tuple[str, ...]
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resize: str = "crop"
    layout: str = "NCHW"
    uncertain_threshold: float = DEFAULT_UNCERTAIN_THRESHOLD
    threshold_from_model: bool = False  # False: the default above was used
    run_id: str | None = None
    accuracy: float | None = None
    params: int | None = None
    format: str = FORMAT_VERSION

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def to_metadata(self) -> dict[str, str]:
        """The ``metadata_props`` entries (key -> string value) that describe this model."""
        meta = {
            "format": self.format,
            "classes": json.dumps(list(self.classes)),
            "input_size": str(self.input_size),
            "mean": json.dumps([float(v) for v in self.mean]),
            "std": json.dumps([float(v) for v in self.std]),
            "layout": self.layout,
            "resize": self.resize,
        }
        if self.threshold_from_model:
            meta["uncertain_threshold"] = repr(float(self.uncertain_threshold))
        if self.run_id is not None:
            meta["run_id"] = self.run_id
        if self.accuracy is not None:
            meta["accuracy"] = repr(float(self.accuracy))
        if self.params is not None:
            meta["params"] = str(int(self.params))
        return {PREFIX + k: v for k, v in meta.items()}

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str], source: str) -> ModelCard:
        """Parse and check ``metadata_props``; raise :class:`ModelError` naming ``source`` and the key."""

        def fail(key: str, why: str) -> ModelError:
            return ModelError(f"{source}: metadata key '{PREFIX}{key}' {why}")

        missing = [k for k in _REQUIRED if PREFIX + k not in meta]
        if missing:
            names = ", ".join(f"'{PREFIX}{k}'" for k in missing)
            raise ModelError(
                f"{source}: not a leaflens model, missing metadata key(s) {names} "
                "(export it with `leaflens export`)"
            )

        def get(key: str) -> str:
            return meta[PREFIX + key]

        if get("format") != FORMAT_VERSION:
            raise fail("format", f"is {get('format')!r}; this version reads format {FORMAT_VERSION!r}")
        try:
            classes = json.loads(get("classes"))
        except json.JSONDecodeError as exc:
            raise fail("classes", f"is not JSON: {exc}") from exc
        if not (isinstance(classes, list) and classes and all(isinstance(c, str) and c for c in classes)):
            raise fail("classes", "must be a non-empty JSON list of non-empty strings")
        if len(set(classes)) != len(classes):
            raise fail("classes", "has duplicate class names")
        try:
            input_size = int(get("input_size"))
        except ValueError as exc:
            raise fail("input_size", f"is not an integer: {get('input_size')!r}") from exc
        if input_size < 1:
            raise fail("input_size", f"must be >= 1, got {input_size}")

        def triple(key: str, positive: bool) -> tuple[float, float, float]:
            try:
                values = json.loads(get(key))
            except json.JSONDecodeError as exc:
                raise fail(key, f"is not JSON: {exc}") from exc
            if not (isinstance(values, list) and len(values) == 3
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
                raise fail(key, f"must be a JSON list of 3 numbers, got {get(key)!r}")
            if not all(math.isfinite(v) and (v > 0 or not positive) for v in values):
                raise fail(key, f"must hold finite{' positive' if positive else ''} numbers, got {values}")
            return (float(values[0]), float(values[1]), float(values[2]))

        mean, std = triple("mean", False), triple("std", True)
        if get("layout") != "NCHW":
            raise fail("layout", f"is {get('layout')!r}; only 'NCHW' is supported")
        if get("resize") not in ("crop", "pad"):
            raise fail("resize", f"must be 'crop' or 'pad', got {get('resize')!r}")

        threshold, from_model = DEFAULT_UNCERTAIN_THRESHOLD, False
        if PREFIX + "uncertain_threshold" in meta:
            try:
                threshold = float(get("uncertain_threshold"))
            except ValueError as exc:
                raise fail("uncertain_threshold", f"is not a number: {get('uncertain_threshold')!r}") from exc
            if not 0.0 <= threshold <= 1.0:
                raise fail("uncertain_threshold", f"must be in [0, 1], got {threshold}")
            from_model = True
        accuracy = params = None
        if PREFIX + "accuracy" in meta:
            try:
                accuracy = float(get("accuracy"))
            except ValueError as exc:
                raise fail("accuracy", f"is not a number: {get('accuracy')!r}") from exc
        if PREFIX + "params" in meta:
            try:
                params = int(get("params"))
            except ValueError as exc:
                raise fail("params", f"is not an integer: {get('params')!r}") from exc
        return cls(
            classes=tuple(classes), input_size=input_size, mean=mean, std=std, resize=get("resize"),
            layout=get("layout"), uncertain_threshold=threshold, threshold_from_model=from_model,
            run_id=meta.get(PREFIX + "run_id"), accuracy=accuracy, params=params, format=get("format"),
        )
