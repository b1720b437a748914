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
        self.notes: list[str] = []  # choices made for the user that they should see (printed by the stage)
        guessed = _guess_layout(inp.shape)
        self.layout = (layout or meta.get("leaflens.layout") or guessed).upper()
        if not (layout or meta.get("leaflens.layout")):
            self.notes.append(f"{self.path.name}: input {inp.name!r} {_shape_text(inp.shape)} read as {self.layout}"
                              f"{'' if _layout_is_certain(inp.shape) else ' (a guess: its shape does not tell)'}; "
                              "--layout sets it")
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"{self.path}: layout must be NCHW or NHWC, got {self.layout!r} (--layout)")
        size = input_size or meta.get("leaflens.input_size") or _static_size(inp.shape, self.layout)
        if not size:
            raise ValueError(f"{self.path}: the input size is not fixed in the graph; pass --input-size")
        self.input_size = int(size)
        h, w = (inp.shape[2], inp.shape[3]) if self.layout == "NCHW" else (inp.shape[1], inp.shape[2])
        fixed = [d for d in (h, w) if isinstance(d, int) and d > 0]
        if len(fixed) == 2 and h != w:
            raise ValueError(f"{self.path}: its input is fixed at {h} x {w} px (height x width, {self.layout}); "
                             "leaflens feeds square photos: export the encoder with a square (or dynamic) input "
                             "size, or pass --layout if it was guessed wrong")
        if any(d != self.input_size for d in fixed):
            told = (f"--input-size {self.input_size}: pass --input-size {fixed[0]} (or leave it out)" if input_size
                    else f"its metadata's leaflens.input_size = {self.input_size}: pass --input-size {fixed[0]}")
            raise ValueError(f"{self.path}: its input is fixed at {fixed[0]} px, not {self.input_size} as {told}")
        channels = inp.shape[1] if self.layout == "NCHW" else inp.shape[3]
        if isinstance(channels, int) and channels != 3:
            raise ValueError(f"{self.path}: its input has {channels} channel(s) in the {self.layout} layout; photos "
                             "have 3 (RGB): pass --layout if the layout was guessed wrong")
        self.mean = _rgb(mean, meta, "leaflens.mean", self.path)
        self.std = _rgb(std, meta, "leaflens.std", self.path)
        if mean is None and std is None and "leaflens.mean" not in meta and "leaflens.std" not in meta:
            self.notes.append(f"{self.path.name} records no normalisation: its input is (pixel / 255 - 0.5) / 0.5, "
                              "i.e. -1 to 1; an encoder trained on ImageNet's statistics (most PyTorch exports) "
                              "wants --mean 0.485 0.456 0.406 --std 0.229 0.224 0.225")
        if (self.std <= 0).any():
            raise ValueError(f"{self.path}: std must be above 0 for every channel, got {self.std.tolist()}")
        names = [o.name for o in self.session.get_outputs()]
        self.output = output or meta.get("leaflens.features_output") or names[0]
        if self.output not in names:
            raise ValueError(f"{self.path} has no output {self.output!r} (outputs: {names})")
        self._output_shape = next(o.shape for o in self.session.get_outputs() if o.name == self.output)
        self.logits_output = logits_output
        if logits_output and logits_output not in names:
            raise ValueError(f"{self.path} has no output {logits_output!r} (outputs: {names})")
        self.pooled: list[int] | None = None  # the output axes averaged away (a feature map or tokens), if any
        probe = self._run(np.zeros((1, self.input_size, self.input_size, 3), np.uint8))
        self.feature_dim = int(probe[0].shape[1])
        self.num_classes = None if probe[1] is None else int(probe[1].shape[1])

    def _run(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        if self.batch is not None and len(images) != self.batch:  # a graph exported for a fixed batch size
            parts = [self._run(_padded(images[i:i + self.batch], self.batch))
                     for i in range(0, len(images), self.batch)]
            feats = np.concatenate([p[0] for p in parts])[:len(images)]  # the padding's rows dropped
            lg = [p[1] for p in parts]
            return feats, (None if lg[0] is None else np.concatenate(lg)[:len(images)])  # type: ignore[arg-type]
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
        if outs[0].ndim < 2:
            raise ValueError(f"{self.path}: output {self.output!r} has shape {list(outs[0].shape)} for {len(images)} "
                             "photos: one number per photo, not a feature vector; a feature output is [photos, "
                             "features] or a feature map (choose another with --output)")
        if outs[0].shape[0] != len(images):
            raise ValueError(f"{self.path}: output {self.output!r} has shape {list(outs[0].shape)} for {len(images)} "
                             "photos; a feature output has one row per photo (choose another with --output)")
        return self._pooled(outs[0]).astype(np.float32), (outs[1].astype(np.float32) if self.logits_output else None)

    def _pooled(self, out: np.ndarray) -> np.ndarray:
        """One feature vector a photo: a feature map [N, C, H, W] (or [N, H, W, C], as the input's layout) is
        averaged over its positions, tokens [N, T, D] over the tokens; flattening them would tie each feature
        to a place in the photo, which the students' random crops move."""
        if out.ndim == 2:
            return out
        if out.ndim == 3:
            axes = [1]
        elif out.ndim == 4:
            axes = [2, 3] if self.layout == "NCHW" else [1, 2]
        else:
            raise ValueError(f"{self.path}: output {self.output!r} has shape {list(out.shape)}; a feature output is "
                             "[N, D], a feature map [N, C, H, W] or tokens [N, T, D] (choose another with --output)")
        pooled = out.mean(axis=tuple(axes))
        if self.pooled is None:
            self.pooled = axes
            self.notes.append(f"{self.path.name}: output {self.output!r} {_shape_text(self._output_shape)} is averaged "
                              f"over axes {axes} into {pooled.shape[1]} features a photo")
        return pooled

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return self._run(images)

    def identity(self) -> dict[str, Any]:
        return {"kind": "onnx", "path": str(self.path.resolve()),
                "sha256": sha256_file(self.path).removeprefix("sha256:"), "output": self.output,
                "layout": self.layout, "mean": self.mean.tolist(), "std": self.std.tolist(),
                **({"pooled_axes": self.pooled} if self.pooled else {})}


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
    """NHWC when only the last axis can be the 3 colour channels, else NCHW (the usual export)."""
    return "NHWC" if len(shape) == 4 and shape[-1] == 3 and shape[1] != 3 else "NCHW"


def _layout_is_certain(shape: list[Any]) -> bool:
    """Exactly one of axes 1 and 3 is 3 (the other known, or a size other than 3)."""
    return (shape[1] == 3) != (shape[3] == 3) and (isinstance(shape[1], int) or isinstance(shape[3], int))


def _shape_text(shape: list[Any]) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) and d > 0 else (d or "?") for d in shape) + "]"


def _padded(images: np.ndarray, batch: int) -> np.ndarray:
    """``images`` filled up to ``batch`` rows with black photos, for a graph with a fixed batch size."""
    if len(images) == batch:
        return images
    return np.concatenate([images, np.zeros((batch - len(images),) + images.shape[1:], images.dtype)])


def _static_size(shape: list[Any], layout: str) -> int | None:
    """The input's side when the graph fixes its height or width (the other one may be left dynamic)."""
    sides = (shape[2], shape[3]) if layout == "NCHW" else (shape[1], shape[2])
    return next((d for d in sides if isinstance(d, int) and d > 0), None)
