"""INT8 variant of an exported model: onnxruntime static quantisation calibrated on training images.

QDQ format (QuantizeLinear/DequantizeLinear pairs around each quantised op, which onnxruntime fuses
into integer kernels and which other runtimes such as TensorRT read too), per-channel symmetric
int8 weights, activation ranges from min/max over the calibration images. The model card
(metadata_props) of the FP32 model is carried over, so the INT8 file is self-describing too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from leaflens.engine.onnx_export import save_onnx
from leaflens.pipeline.export.parity import batches


def calibration_indices(n_available: int, n_wanted: int, seed: int = 0) -> np.ndarray:
    """A seeded random subset (sorted, so memory-mapped reads go forward) of the training images."""
    if n_available == 0:
        raise ValueError("no training images to calibrate INT8 quantisation with")
    n = min(n_wanted, n_available)
    return np.sort(np.random.default_rng(seed).choice(n_available, size=n, replace=False))


def quantize_int8(fp32_path: str | os.PathLike[str], out_path: str | os.PathLike[str], images: Any,
                  mean: np.ndarray, std: np.ndarray, batch: int = 32, activations: str = "uint8",
                  preprocess: bool = True) -> Path:
    """Write the INT8 (QDQ) version of ``fp32_path`` to ``out_path``, calibrated on uint8 NHWC ``images``.

    ``activations``: "uint8" (asymmetric, the usual choice for post-ReLU activations) or "int8".
    ``preprocess`` runs onnxruntime's recommended quant_pre_process first (shape inference and
    graph optimisation, so e.g. Conv+Relu pairs are quantised as one).
    """
    from onnxruntime.quantization import (  # noqa: PLC0415
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process  # noqa: PLC0415

    if activations not in ("uint8", "int8"):
        raise ValueError(f"activations must be 'uint8' or 'int8', got {activations!r}")
    fp32 = onnx.load(str(fp32_path))
    input_name = fp32.graph.input[0].name

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = batches(images, mean, std, batch)

        def get_next(self) -> dict[str, np.ndarray] | None:
            x = next(self._it, None)
            return None if x is None else {input_name: np.ascontiguousarray(x.transpose(0, 3, 1, 2))}

    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.quant-{os.getpid()}")
    pre = out_path.with_name(f".{out_path.name}.pre-{os.getpid()}")
    try:
        source = fp32_path
        if preprocess:
            # our graphs have static shapes but for the batch, so ONNX's own shape inference is enough
            # (the symbolic one needs sympy, which leaflens does not depend on)
            quant_pre_process(str(fp32_path), str(pre), skip_symbolic_shape=True)
            source = pre
        quantize_static(str(source), str(tmp), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8 if activations == "uint8" else QuantType.QInt8,
                        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
        q = onnx.load(str(tmp))
    finally:
        for p in (tmp, pre):
            if p.exists():
                p.unlink()
    del q.metadata_props[:]
    q.metadata_props.extend(fp32.metadata_props)
    q.doc_string = (fp32.doc_string + " (INT8 QDQ, static quantisation)").strip()
    onnx.checker.check_model(q, full_check=True)
    return save_onnx(q, out_path)
