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
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.layout = (layout or meta.get("leaflens.layout") or _guess_layout(inp.shape)).upper()
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout must be NCHW or NHWC, got {self.layout!r}")
        size = input_size or meta.get("leaflens.input_size") or _static_size(inp.shape, self.layout)
        if not size:
            raise ValueError(f"{self.path}: the input size is not fixed in the graph; pass --input-size")
        self.input_size = int(size)
        self.mean = np.asarray(mean if mean is not None else json.loads(meta.get("leaflens.mean", "[0.5,0.5,0.5]")),
                               np.float32)
        self.std = np.asarray(std if std is not None else json.loads(meta.get("leaflens.std", "[0.5,0.5,0.5]")),
                              np.float32)
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
        x = (images.astype(np.float32) / 255.0 - self.mean) / self.std
        if self.layout == "NCHW":
            x = x.transpose(0, 3, 1, 2)
        wanted = [self.output] + ([self.logits_output] if self.logits_output else [])
        outs = self.session.run(wanted, {self.input_name: np.ascontiguousarray(x, np.float32)})
        f = outs[0].reshape(len(images), -1).astype(np.float32)
        return f, (outs[1].astype(np.float32) if self.logits_output else None)

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return self._run(images)

    def identity(self) -> dict[str, Any]:
        return {"kind": "onnx", "path": str(self.path.resolve()),
                "sha256": sha256_file(self.path).removeprefix("sha256:"), "output": self.output,
                "layout": self.layout, "mean": self.mean.tolist(), "std": self.std.tolist()}


def _guess_layout(shape: list[Any]) -> str:
    return "NHWC" if len(shape) == 4 and shape[-1] == 3 else "NCHW"


def _static_size(shape: list[Any], layout: str) -> int | None:
    h = shape[2] if layout == "NCHW" else shape[1]
    return h if isinstance(h, int) else None
