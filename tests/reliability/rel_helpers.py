"""Helpers for the reliability tests: tiny photos, datasets and ONNX models made from scratch.

(A uniquely named module rather than conftest.py, so test folders cannot shadow each other; the
fuzzer's worker process imports it too, so it must not import pytest.)
"""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("blight", "healthy", "rust")
COLOURS = {"blight": (140, 90, 40), "healthy": (40, 150, 50), "rust": (200, 120, 30)}


@functools.lru_cache(maxsize=4)
def _noise(h: int, w: int) -> np.ndarray:
    return np.random.default_rng(12345).normal(0, 25, (2 * h, 2 * w, 3)).astype(np.float32)


def photo(seed: int, colour: tuple[int, int, int], w: int = 40, h: int = 32) -> Image.Image:
    """A textured image around ``colour`` (unique per seed, so no accidental duplicates). Large ones
    take a seed-chosen window of one cached noise field, which is much faster than fresh noise."""
    base = np.array(colour, np.float32)[None, None, :]
    if w * h <= 64 * 64:
        noise = np.random.default_rng(seed).normal(0, 25, (h, w, 3))
    else:
        rng = np.random.default_rng(seed)
        y, x = int(rng.integers(0, h)), int(rng.integers(0, w))
        noise = _noise(h, w)[y:y + h, x:x + w]
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def class_folders(root: Path, per_class: int = 12, seed: int = 0, w: int = 40, h: int = 32) -> Path:
    """ROOT/<class>/img_XX.{jpg,png}: distinct textured photos, one colour per class."""
    for c, (name, colour) in enumerate(COLOURS.items()):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            fmt, ext = ("PNG", "png") if i % 3 == 0 else ("JPEG", "jpg")
            (d / f"img_{i:03d}.{ext}").write_bytes(encode(photo(seed * 10_000 + c * 1000 + i, colour, w, h), fmt))
    return root


def tiny_model(path: Path, classes: tuple[str, ...] = CLASSES, size: int = 32, seed: int = 0,
               channels: int = 4) -> Path:
    """A leaflens-style ONNX model: Conv3x3 + ReLU + GAP + Gemm, with the model-card metadata."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weights = {
        "conv_w": rng.normal(0, 0.5, (channels, 3, 3, 3)).astype(np.float32),
        "conv_b": rng.normal(0, 0.1, channels).astype(np.float32),
        "fc_w": rng.normal(0, 1.0, (len(classes), channels)).astype(np.float32),
        "fc_b": rng.normal(0, 0.1, len(classes)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["input", "conv_w", "conv_b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny_leaflens",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", len(classes)])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {
        "leaflens.format": "1", "leaflens.classes": json.dumps(list(classes)), "leaflens.input_size": str(size),
        "leaflens.mean": "[0.5, 0.4, 0.3]", "leaflens.std": "[0.25, 0.2, 0.3]", "leaflens.layout": "NCHW",
        "leaflens.resize": "crop"})
    onnx.save(model, str(path))
    return path


def cli_env() -> dict[str, str]:
    """Environment for `python -m leaflens` subprocesses: one BLAS thread."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cli_command(*args: str) -> list[str]:
    """``nice -n 19 python -m leaflens.pipeline.cli ARGS`` (the machine is shared with measurements)."""
    return ["nice", "-n", "19", sys.executable, "-m", "leaflens", *args]


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a `leaflens` subcommand to completion in a subprocess, capturing its output."""
    return subprocess.run(cli_command(*args), cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


def start_cli(*args: str) -> subprocess.Popen:
    """Start a `leaflens` subcommand in its own process group (so kill -9 reaches nothing else)."""
    return subprocess.Popen(cli_command(*args), cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill9(proc: subprocess.Popen) -> int | None:
    """SIGKILL the process group of ``proc`` (the stage and any worker it forked); its return code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    if proc.stderr is not None:
        proc.stderr.close()
    return proc.returncode


def wait_for(pred, timeout: float, interval: float = 0.02) -> bool:
    """Poll ``pred()`` until it is true or ``timeout`` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
