"""Engine versus onnxruntime: logits on a split, agreement figures, accuracy, and CPU speed.

The same float32 batch (brought to the input size and normalised once, with the preprocessing contract's
functions in leaflens.data_prep.contract, as in evaluation and serving) goes to the engine as NHWC and to
onnxruntime as NCHW, so any difference comes from the exported graph alone.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from leaflens.data_prep.contract import at_input_size, normalize
from leaflens.engine import Tensor, no_grad
from leaflens.engine.nn import Module


def cpu_session(model: str | os.PathLike[str] | bytes, threads: int) -> Any:
    """An onnxruntime CPU session with ``threads`` intra-op threads and no idle spinning."""
    import onnxruntime as ort  # noqa: PLC0415

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    src = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(src, sess_options=opts, providers=["CPUExecutionProvider"])


class AtSize:
    """Rows of a uint8 image array brought to ``size`` px when read, by the centre ``crop`` share (None:
    whole) and the area resize of the preprocessing contract (as evaluation and serving see them when the
    dataset is stored larger than the model's input). Lazy: a memmap stays on disk."""

    def __init__(self, images: Any, size: int, crop: float | None = None) -> None:
        self.images, self.size, self.crop = images, int(size), crop

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, idx: Any) -> np.ndarray:
        x = np.asarray(self.images[idx])
        if x.ndim != 4:
            raise IndexError("AtSize supports slices and index arrays only")
        return at_input_size(x, self.size, self.crop)


def at_size(images: Any, size: int, crop: float | None = None) -> Any:
    """``images`` themselves when already ``size`` px and not cropped, else an :class:`AtSize` view of them."""
    return images if images.shape[1] == size and crop is None else AtSize(images, size, crop)


def batches(images: Any, mean: np.ndarray, std: np.ndarray, batch: int):
    """Yield normalised float32 NHWC batches of a uint8 image array (memory-mapped arrays welcome)."""
    for i in range(0, len(images), batch):
        yield normalize(np.asarray(images[i:i + batch]), mean, std)


def engine_and_onnx_outputs(model: Module, sessions: dict[str, Any], images: Any, mean: np.ndarray,
                            std: np.ndarray, batch: int = 64) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Logits of the engine (key "engine") and of each named session on the very same inputs, and their
    out-of-domain scores (empty when the model returns logits alone)."""
    model.eval()
    keys = ["engine", *sessions]
    logits: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    scores: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for x in batches(images, mean, std, batch):
        with no_grad():
            y = model(Tensor(x))
        outs = [t.numpy().astype(np.float32) for t in (y if isinstance(y, tuple) else (y,))]
        logits["engine"].append(outs[0])
        if len(outs) > 1:
            scores["engine"].append(outs[1])
        x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        for k, sess in sessions.items():
            o = sess.run(None, {sess.get_inputs()[0].name: x_nchw})
            logits[k].append(o[0].astype(np.float32, copy=False))
            if len(o) > 1:
                scores[k].append(o[1].astype(np.float32, copy=False))
    return ({k: np.concatenate(v) if v else np.zeros((0, 0), np.float32) for k, v in logits.items()},
            {k: np.concatenate(v) for k, v in scores.items() if v})


def engine_and_onnx_logits(model: Module, sessions: dict[str, Any], images: Any, mean: np.ndarray,
                           std: np.ndarray, batch: int = 64) -> dict[str, np.ndarray]:
    """Logits of the engine (key "engine") and of each named session, on the very same inputs."""
    return engine_and_onnx_outputs(model, sessions, images, mean, std, batch)[0]


def onnx_scores(sess: Any, images: Any, mean: np.ndarray, std: np.ndarray, batch: int = 64) -> np.ndarray:
    """The session's out-of-domain scores (its second output)."""
    parts = [sess.run(None, {sess.get_inputs()[0].name: np.ascontiguousarray(x.transpose(0, 3, 1, 2))})[1]
             for x in batches(images, mean, std, batch)]
    return np.concatenate(parts).astype(np.float32, copy=False)


def onnx_logits(sess: Any, images: Any, mean: np.ndarray, std: np.ndarray, batch: int = 64) -> np.ndarray:
    parts = [sess.run(None, {sess.get_inputs()[0].name: np.ascontiguousarray(x.transpose(0, 3, 1, 2))})[0]
             for x in batches(images, mean, std, batch)]
    return np.concatenate(parts).astype(np.float32, copy=False)


def relative_tolerance(tolerance: float, max_abs_logit: float) -> float:
    """``tolerance`` per unit of the largest |logit| (at least 1): float rounding grows with the logits, and a
    calibration temperature below 1 scales them up."""
    return tolerance * max(1.0, float(max_abs_logit))


def fp32_failure(figures: dict[str, Any], tolerance: float) -> str | None:
    """Why :func:`compare`'s ``figures`` of an FP32 file fail its gate (``tolerance`` relative, as
    :func:`relative_tolerance`), or None when they pass."""
    allowed = relative_tolerance(tolerance, figures.get("max_abs_logit", 1.0))
    if figures["finite"] and figures["max_abs_diff"] <= allowed:
        return None
    return (f"max |logit difference| {figures['max_abs_diff']:.3g} > {allowed:.3g} ({tolerance:g} x the largest "
            "|logit|, at least 1)")


def compare(reference: np.ndarray, other: np.ndarray, tie_margin: float = 0.0) -> dict[str, Any]:
    """Max/mean absolute logit difference and top-1 agreement of ``other`` with ``reference``.

    A disagreement on an image whose two best reference logits are within ``tie_margin`` is
    counted as a tie: a difference of d per logit can flip an argmax only where the margin is
    at most 2d, so with ``tie_margin = 2 * tolerance`` a tie is a flip the tolerance allows.
    """
    if reference.shape != other.shape:
        raise ValueError(f"logit shapes differ: {reference.shape} vs {other.shape}")
    n = len(reference)
    if n == 0:
        raise ValueError("no images to compare")
    diff = np.abs(reference.astype(np.float64) - other.astype(np.float64))
    agree = reference.argmax(1) == other.argmax(1)
    top2 = np.sort(reference, axis=1)[:, -2:] if reference.shape[1] > 1 else np.zeros((n, 2))
    margin = top2[:, 1] - top2[:, 0]
    ties = int(np.sum(~agree & (margin <= tie_margin)))
    return {
        "images": int(n),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "max_abs_logit": float(np.abs(reference).max()),
        "finite": bool(np.isfinite(other).all()),
        "top1_agreement": float(agree.mean()),
        "disagreements": int(np.sum(~agree)),
        "ties": ties,
    }


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(logits.argmax(1) == np.asarray(labels))) if len(labels) else float("nan")


def speed(sess: Any, x_batch: np.ndarray, seconds: float) -> dict[str, float]:
    """Images/s for batches like ``x_batch`` (NCHW float32), and batch-1 latency percentiles, on this CPU."""
    name = sess.get_inputs()[0].name
    for _ in range(2):  # warm-up: first runs allocate and pick kernels
        sess.run(None, {name: x_batch})
    runs, t0 = 0, time.perf_counter()
    while True:
        sess.run(None, {name: x_batch})
        runs += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and runs >= 3:
            break
    one = x_batch[:1]
    sess.run(None, {name: one})
    lat: list[float] = []
    t_end = time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end or len(lat) < 10:
        t = time.perf_counter()
        sess.run(None, {name: one})
        lat.append((time.perf_counter() - t) * 1e3)
    return {"batch": int(len(x_batch)), "img_s": runs * len(x_batch) / elapsed,
            "b1_p50_ms": float(np.percentile(lat, 50)), "b1_p95_ms": float(np.percentile(lat, 95))}
