"""INT8 variant of an exported model: onnxruntime static quantisation calibrated on training images.

QDQ format (QuantizeLinear/DequantizeLinear pairs around each quantised op, which onnxruntime fuses
into integer kernels and which other runtimes such as TensorRT read too), int8 weights, uint8
activations. :class:`Int8Recipe` says how: the calibration method that sets each activation's range
(``minmax``: the extremes seen; ``percentile``: the range holding e.g. 99.999 % of the values;
``entropy``: the range whose quantised histogram loses the least information), how many training
images calibrate it, per-channel or per-tensor weights, and whether the first convolution (it sees
the normalised pixels, quantised to 256 levels shared by three differently normalised channels) and
the classifier (its outputs are the logits, whose small differences decide the answer) stay in float.

What measured best on the validation splits of the demo and iBeans (``benchmarks/int8.py``, figures
in the README): keeping the classifier in float costs no measurable speed and removed the whole loss
on iBeans (a little of the disagreement on the demo); keeping the first convolution in float too
removes the rest but gives back most of INT8's speed (that layer works at full resolution); the
calibration method, more images and per-tensor weights changed little, and min/max is the fastest.
Hence :func:`int8_ladder`: the export tries the fast recipe first and the one with the first
convolution in float only when the fast one loses too much.

The model card (metadata_props) of the FP32 model is carried over, so the INT8 file is
self-describing too.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from leaflens.pipeline.export.parity import batches
from leaflens.records import Record

if TYPE_CHECKING:  # onnx is imported where it is used: the recipe and the rule need neither onnx nor onnxruntime
    import onnx

CLASSIFIER_OPS = ("Gemm", "MatMul")


@dataclass(frozen=True)
class Int8Recipe(Record):
    """How the INT8 model is calibrated, and which layers stay in float (recorded in parity.json)."""

    calibration: Literal["minmax", "percentile", "entropy"] = "minmax"
    percentile: float = 99.999  # used by "percentile" only
    calib_images: int = 256
    per_channel: bool = True
    float_first_conv: bool = False
    float_classifier: bool = True
    activations: Literal["uint8", "int8"] = "uint8"
    # Weights on 7 bits (-64..64, onnxruntime's reduce_range) instead of 8. x86 CPUs without VNNI (most laptops
    # before 2020) multiply uint8 activations by int8 weights in pairs summed into 16 bits, which can saturate
    # with 8-bit weights; VNNI CPUs and ARM do not. 7 bits never saturate, so the export's check holds on any
    # CPU, but cost the demo student 1.1 points on validation (benchmarks/int8.py --grid): off by default, and
    # parity.json records whether the CPU that checked the file had VNNI.
    reduce_range: bool = False

    def __post_init__(self) -> None:
        if self.calibration not in ("minmax", "percentile", "entropy"):
            raise ValueError(f"calibration must be minmax, percentile or entropy, got {self.calibration!r}")
        if self.activations not in ("uint8", "int8"):
            raise ValueError(f"activations must be 'uint8' or 'int8', got {self.activations!r}")
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.calib_images < 1:
            raise ValueError(f"calib_images must be at least 1, got {self.calib_images}")

    def describe(self) -> str:
        """One line for logs: ranges, weights and the layers left in float."""
        kept = [name for name, on in (("first conv", self.float_first_conv), ("classifier", self.float_classifier))
                if on]
        ranges = f"percentile {self.percentile:g}" if self.calibration == "percentile" else self.calibration
        return (f"{ranges} ranges, {'per-channel' if self.per_channel else 'per-tensor'} "
                f"{7 if self.reduce_range else 8}-bit weights, {self.activations} activations"
                + (f", {' and '.join(kept)} in float" if kept else ""))


def int8_ladder(base: Int8Recipe = Int8Recipe()) -> tuple[Int8Recipe, ...]:
    """The recipes the export tries in order: ``base``, then (when ``base`` quantises it) the same with
    the first convolution in float too: more accurate, but most of INT8's speed-up is gone."""
    return (base,) if base.float_first_conv else (base, replace(base, float_first_conv=True))


def int8_shortfall(val_fp32: float, val_int8: float, max_drop: float) -> str | None:
    """Why the INT8 model is not worth shipping, or None when its validation accuracy is at most
    ``max_drop`` (a fraction: 0.01 is one point) below FP32's."""
    if not val_int8 >= val_fp32 - max_drop - 1e-9:  # the tolerance absorbs float rounding of the difference
        return (f"its validation accuracy {val_int8:.2%} is {100 * (val_fp32 - val_int8):.1f} points below "
                f"FP32's {val_fp32:.2%} (at most {100 * max_drop:g} allowed)")
    return None


@dataclass(frozen=True)
class Quantized:
    """What :func:`quantize_int8` wrote: the file, the nodes left in float, the images and time it took."""

    path: Path
    float_nodes: tuple[str, ...]
    calibration_images: int
    seconds: float


def calibration_indices(n_available: int, n_wanted: int, seed: int = 0) -> np.ndarray:
    """A seeded random subset (sorted, so memory-mapped reads go forward) of the training images."""
    if n_available == 0:
        raise ValueError("no training images to calibrate INT8 quantisation with")
    n = min(n_wanted, n_available)
    return np.sort(np.random.default_rng(seed).choice(n_available, size=n, replace=False))


def float_nodes(model: onnx.ModelProto, first_conv: bool, classifier: bool) -> list[str]:
    """Names of the nodes to keep in float: the first Conv on the logits' side, and the classifier (the last
    Gemm/MatMul and the nodes between it and the graph output, e.g. a bias Add).

    Nodes without a name cannot be excluded by onnxruntime, so a graph whose chosen nodes are unnamed
    is refused with a message rather than quantised whole without saying so.
    """
    nodes = list(model.graph.node)  # ONNX keeps nodes in topological order
    chosen: list[onnx.NodeProto] = []
    logits_side = _ancestors(nodes, [model.graph.output[0].name])
    if first_conv:
        # the classifier's first convolution (the out-of-domain score's generic branch has convolutions of its
        # own on the same input, which feed only that score and stay in float anyway)
        convs = [n for n in nodes if n.op_type == "Conv" and id(n) in logits_side]
        if not convs:
            raise ValueError("the graph has no Conv node to keep in float (float_first_conv)")
        chosen.append(convs[0])
    if classifier:
        heads = [i for i, n in enumerate(nodes) if n.op_type in CLASSIFIER_OPS and id(n) in logits_side]
        if not heads:
            raise ValueError(f"the graph has no {'/'.join(CLASSIFIER_OPS)} node to keep in float "
                             "(float_classifier)")
        downstream = set(nodes[heads[-1]].output)
        chosen.append(nodes[heads[-1]])
        for n in nodes[heads[-1] + 1:]:
            if downstream.intersection(n.input) and id(n) in logits_side:
                chosen.append(n)
                downstream.update(n.output)
    chosen += _only_feeding(nodes, model.graph.output[0].name, [o.name for o in model.graph.output[1:]])
    unnamed = [n.op_type for n in chosen if not n.name]
    if unnamed:
        raise ValueError(f"cannot keep unnamed {', '.join(unnamed)} node(s) in float: onnxruntime excludes "
                         "nodes by name")
    return [n.name for n in chosen]


def _ancestors(nodes: list[onnx.NodeProto], outputs: list[str]) -> set[int]:
    """ids of the nodes whose results reach any of ``outputs``."""
    from leaflens.engine.onnx_export import nodes_reaching  # noqa: PLC0415

    return {id(n) for n in nodes_reaching(nodes, outputs)}


def _only_feeding(nodes: list[onnx.NodeProto], logits: str, others: list[str]) -> list[onnx.NodeProto]:
    """The nodes that feed the extra outputs (the out-of-domain score) but not the logits: kept in float,
    because its distances are sums of many squared terms that 8-bit ranges would flatten, and it costs
    a few small matrix products."""
    if not others:
        return []
    main = _ancestors(nodes, [logits])
    extra = _ancestors(nodes, others)
    return [n for n in nodes if id(n) in extra and id(n) not in main]


def quantize_int8(fp32_path: str | os.PathLike[str], out_path: str | os.PathLike[str], images: Any,
                  mean: np.ndarray, std: np.ndarray, recipe: Int8Recipe = Int8Recipe(), batch: int = 32,
                  preprocess: bool = True) -> Quantized:
    """Write the INT8 (QDQ) version of ``fp32_path`` to ``out_path``, calibrated on uint8 NHWC ``images``
    (all of them: pick ``recipe.calib_images`` of them with :func:`calibration_indices`).

    ``preprocess`` runs onnxruntime's recommended quant_pre_process first (shape inference and
    graph optimisation, so e.g. Conv+Relu pairs are quantised as one).
    """
    import onnx  # noqa: PLC0415
    from onnxruntime.quantization import (  # noqa: PLC0415
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process  # noqa: PLC0415

    from leaflens.engine.onnx_export import save_onnx  # noqa: PLC0415

    t0 = time.perf_counter()
    fp32 = onnx.load(str(fp32_path))
    input_name = fp32.graph.input[0].name
    methods = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
               "entropy": CalibrationMethod.Entropy}
    # percentile: the range of |x| holding that share of the values, clipped to the values' own min/max
    extra = {"CalibPercentile": recipe.percentile} if recipe.calibration == "percentile" else {}

    # equal batches: the histogram calibrators stack the outputs of all batches into one array
    step = max(d for d in range(1, batch + 1) if len(images) % d == 0)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = batches(images, mean, std, step)

        def get_next(self) -> dict[str, np.ndarray] | None:
            x = next(self._it, None)
            return None if x is None else {input_name: np.ascontiguousarray(x.transpose(0, 3, 1, 2))}

    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.quant-{os.getpid()}")
    pre = out_path.with_name(f".{out_path.name}.pre-{os.getpid()}")
    try:
        source = Path(fp32_path)
        if preprocess:
            # our graphs have static shapes but for the batch, so ONNX's own shape inference is enough
            # (the symbolic one needs sympy, which leaflens does not depend on)
            quant_pre_process(str(fp32_path), str(pre), skip_symbolic_shape=True)
            source = pre
        keep_float = float_nodes(onnx.load(str(source)), recipe.float_first_conv, recipe.float_classifier)
        # the histogram calibrators print their settings to stdout, which is the CLI's summary stream
        with contextlib.redirect_stdout(io.StringIO()):
            quantize_static(str(source), str(tmp), Reader(), quant_format=QuantFormat.QDQ,
                            per_channel=recipe.per_channel, reduce_range=recipe.reduce_range,
                            nodes_to_exclude=keep_float,
                            activation_type=QuantType.QUInt8 if recipe.activations == "uint8" else QuantType.QInt8,
                            weight_type=QuantType.QInt8, calibrate_method=methods[recipe.calibration],
                            extra_options=extra)
        q = onnx.load(str(tmp))
    finally:
        for p in (tmp, pre):
            if p.exists():
                p.unlink()
    del q.metadata_props[:]
    q.metadata_props.extend(fp32.metadata_props)
    q.doc_string = (fp32.doc_string + f" (INT8 QDQ, static quantisation, {recipe.calibration} ranges)").strip()
    onnx.checker.check_model(q, full_check=True)
    path = save_onnx(q, out_path)
    return Quantized(path=path, float_nodes=tuple(keep_float), calibration_images=len(images),
                     seconds=time.perf_counter() - t0)
