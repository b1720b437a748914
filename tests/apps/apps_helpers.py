"""Helpers for the serving tests: tiny leaflens-style ONNX models built with onnx.helper and small
synthetic photos, so the tests need neither the engine nor any downloaded data.

(A uniquely named module rather than conftest.py, so `import` cannot pick another test folder's.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from PIL import Image  # noqa: E402

MEAN = [0.5, 0.4, 0.3]
STD = [0.25, 0.2, 0.3]


def tiny_weights(num_classes: int, seed: int = 0, channels: int = 4) -> dict[str, np.ndarray]:
    """Random weights for Conv3x3(3->channels, pad 1) + ReLU + GAP + Gemm(channels->num_classes)."""
    rng = np.random.default_rng(seed)
    return {
        "conv_w": rng.normal(0, 0.5, (channels, 3, 3, 3)).astype(np.float32),
        "conv_b": rng.normal(0, 0.1, channels).astype(np.float32),
        "fc_w": rng.normal(0, 1.0, (num_classes, channels)).astype(np.float32),
        "fc_b": rng.normal(0, 0.1, num_classes).astype(np.float32),
    }


def leaflens_metadata(classes: list[str], size: int, **extra: str) -> dict[str, str]:
    meta = {
        "leaflens.format": "1",
        "leaflens.classes": json.dumps(classes),
        "leaflens.input_size": str(size),
        "leaflens.mean": json.dumps(MEAN),
        "leaflens.std": json.dumps(STD),
        "leaflens.layout": "NCHW",
        "leaflens.resize": "crop",
    }
    meta.update(extra)
    return meta


def build_tiny_model(path: Path, weights: dict[str, np.ndarray], size: int,
                     metadata: dict[str, str]) -> Path:
    """Write the model contract's shape: input [batch,3,S,S] -> logits [batch,C], opset 17, IR 8."""
    num_classes, channels = weights["fc_w"].shape
    inits = [numpy_helper.from_array(v, name) for name, v in weights.items()]
    nodes = [
        helper.make_node("Conv", ["input", "conv_w", "conv_b"], ["c"], kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny_leaflens",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", num_classes])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, metadata)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def reference_probs(batch_u8: np.ndarray, weights: dict[str, np.ndarray]) -> np.ndarray:
    """The same network in plain NumPy (float64): normalise, conv, ReLU, mean, linear, softmax."""
    x = (batch_u8.astype(np.float64) / 255.0 - np.array(MEAN)) / np.array(STD)  # N,H,W,3
    n, h, w, _ = x.shape
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    cw = weights["conv_w"].astype(np.float64)  # O,3,3,3 (out, in, kh, kw)
    conv = np.zeros((n, h, w, cw.shape[0]))
    for dy in range(3):
        for dx in range(3):
            conv += np.einsum("nhwc,oc->nhwo", xp[:, dy:dy + h, dx:dx + w, :], cw[:, :, dy, dx])
    conv += weights["conv_b"]
    feats = np.maximum(conv, 0).mean(axis=(1, 2))
    logits = feats @ weights["fc_w"].T.astype(np.float64) + weights["fc_b"]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def write_photo(path: Path, size: tuple[int, int] = (48, 40), seed: int = 0, fmt: str | None = None) -> Path:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format=fmt)
    return path


def make_dataset(root: Path, classes: list[str], size: int = 16, per_class: int = 8) -> Path:
    """A real (tiny) preprocessed dataset, with the synthetic set's classes.toml carried along."""
    from leaflens.data_prep.ingest import IngestOptions, ingest
    from leaflens.data_prep.synth import classes_toml

    src = root / "photos"
    for c, cls in enumerate(classes):
        (src / cls).mkdir(parents=True)
        for i in range(per_class):
            write_photo(src / cls / f"{cls}_{i}.png", (24, 20), seed=100 * c + i)
    (src / "classes.toml").write_text(classes_toml(tuple(classes)), encoding="utf-8")
    return ingest(src, root / "dataset", IngestOptions(size=size), workers=1, log=lambda *_: None).out


def fake_run(tmp_path: Path, dataset: Path) -> Path:
    """A run folder as `leaflens distill` leaves it, as far as the app reads it."""
    run = tmp_path / "student"
    run.mkdir()
    report = {"test_accuracy": 0.9, "params": 1234, "dataset": {"root": str(dataset)},
              "test": {"accuracy": 0.9, "accuracy_ci": [0.8, 0.95], "ci_level": 0.95, "n": 60}}
    (run / "report.json").write_text(json.dumps(report))
    for name in ("curves.png", "confusion.png"):
        write_photo(run / name, (30, 20))
    return run


def serve_args(**kw) -> argparse.Namespace:
    """`leaflens serve` arguments as parsed from --key value options (True: a bare flag)."""
    from leaflens.apps import cmd_serve

    parser = cmd_serve.add_parser(argparse.ArgumentParser().add_subparsers())
    argv = []
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return parser.parse_args(argv)
