"""Any ONNX image encoder as a teacher, run by onnxruntime in batches.

What the encoder expects (input size, layout, normalisation) and which output holds the features
comes from command-line options, or from the model's metadata when leaflens exported it
("leaflens.*" keys) or the options are left out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.data_prep.arrays import sha256_file


class OnnxEncoder:
    def __init__(self, path: str | os.PathLike[str], input_size: int | None = None, layout: str | None = None,
                 mean: list[float] | None = None, std: list[float] | None = None, output: str | None = None,
                 logits_output: str | None = None, threads: int | None = None):
        import onnxruntime as ort  # noqa: PLC0415

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"ONNX encoder {self.path} does not exist")
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(self.path), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types for invalid files
            raise ValueError(f"{self.path} is not a usable ONNX model: {exc}") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise ValueError(f"{self.path} takes {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); an image "
                             "encoder takes one batch of images")
        inp = inputs[0]
        if inp.type != "tensor(float)" or len(inp.shape) != 4:
            raise ValueError(f"{self.path}: its input {inp.name!r} is {inp.type} of shape {inp.shape}; an image "
                             "encoder here takes a float32 [batch, 3, H, W] or [batch, H, W, 3] tensor")
        self.input_name = inp.name
        self.batch = inp.shape[0] if isinstance(inp.shape[0], int) and inp.shape[0] > 0 else None
        self.layout = (layout or meta.get("leaflens.layout") or _guess_layout(inp.shape)).upper()
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"{self.path}: layout must be NCHW or NHWC, got {self.layout!r} (--layout)")
        size = input_size or meta.get("leaflens.input_size") or _static_size(inp.shape, self.layout)
        if not size:
            raise ValueError(f"{self.path}: the input size is not fixed in the graph; pass --input-size")
        self.input_size = int(size)
        channels = inp.shape[1] if self.layout == "NCHW" else inp.shape[3]
        if isinstance(channels, int) and channels != 3:
            raise ValueError(f"{self.path}: its input has {channels} channel(s) in the {self.layout} layout; photos "
                             "have 3 (RGB): pass --layout if the layout was guessed wrong")
        self.mean = _rgb(mean, meta, "leaflens.mean", self.path)
        self.std = _rgb(std, meta, "leaflens.std", self.path)
        if (self.std <= 0).any():
            raise ValueError(f"{self.path}: std must be above 0 for every channel, got {self.std.tolist()}")
        names = [o.name for o in self.session.get_outputs()]
        self.output = output or meta.get("leaflens.features_output") or names[0]
        if self.output not in names:
            raise ValueError(f"{self.path} has no output {self.output!r} (outputs: {names})")
        self.logits_output = logits_output
        if logits_output and logits_output not in names:
            raise ValueError(f"{self.path} has no output {logits_output!r} (outputs: {names})")
        probe = self._run(np.zeros((1, self.input_size, self.input_size, 3), np.uint8))
        self.feature_dim = int(np.prod(probe[0].shape[1:]))
        self.num_classes = None if probe[1] is None else int(probe[1].shape[1])

    def _run(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        if self.batch is not None and len(images) != self.batch:  # a graph exported for a fixed batch size
            if len(images) % self.batch:
                raise ValueError(f"{self.path} takes batches of exactly {self.batch} photos; {len(images)} photos "
                                 "do not divide into them: export the encoder with a dynamic batch axis")
            parts = [self._run(images[i:i + self.batch]) for i in range(0, len(images), self.batch)]
            lg = [p[1] for p in parts]
            return np.concatenate([p[0] for p in parts]), (None if lg[0] is None else np.concatenate(lg))  # type: ignore[arg-type]
        x = (images.astype(np.float32) / 255.0 - self.mean) / self.std
        if self.layout == "NCHW":
            x = x.transpose(0, 3, 1, 2)
        wanted = [self.output] + ([self.logits_output] if self.logits_output else [])
        try:
            outs = self.session.run(wanted, {self.input_name: np.ascontiguousarray(x, np.float32)})
        except Exception as exc:  # onnxruntime's own exception types: the model and its input do not fit
            raise ValueError(f"{self.path} cannot run on photos given as {list(x.shape)} ({self.layout}, "
                             f"{self.input_size} px): {str(exc).splitlines()[0][:300]}; check --layout and "
                             "--input-size against the model's input") from None
        if outs[0].ndim < 2 or outs[0].shape[0] != len(images):
            raise ValueError(f"{self.path}: output {self.output!r} has shape {list(outs[0].shape)} for {len(images)} "
                             "photos; a feature output has one row per photo (choose another with --output)")
        f = outs[0].reshape(len(images), -1).astype(np.float32)
        return f, (outs[1].astype(np.float32) if self.logits_output else None)

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return self._run(images)

    def identity(self) -> dict[str, Any]:
        return {"kind": "onnx", "path": str(self.path.resolve()),
                "sha256": sha256_file(self.path).removeprefix("sha256:"), "output": self.output,
                "layout": self.layout, "mean": self.mean.tolist(), "std": self.std.tolist()}


def _rgb(given: list[float] | None, meta: dict[str, str], key: str, path: Path) -> np.ndarray:
    """Three finite numbers: the option's, else the model's ``key`` metadata, else 0.5 each."""
    if given is not None:
        values = given
    else:
        try:
            values = json.loads(meta.get(key, "[0.5,0.5,0.5]"))
        except ValueError:
            raise ValueError(f"{path}: its metadata {key!r} is not a JSON list of 3 numbers: "
                             f"{meta.get(key)!r}") from None
    arr = np.asarray(values, np.float64).reshape(-1) if isinstance(values, list) else np.zeros(0)
    if arr.shape != (3,) or not np.isfinite(arr).all():
        raise ValueError(f"{path}: {key.removeprefix('leaflens.')} must be 3 finite numbers (R, G, B), got {values!r}")
    return arr.astype(np.float32)


def _guess_layout(shape: list[Any]) -> str:
    return "NHWC" if len(shape) == 4 and shape[-1] == 3 else "NCHW"


def _static_size(shape: list[Any], layout: str) -> int | None:
    h = shape[2] if layout == "NCHW" else shape[1]
    return h if isinstance(h, int) else None
