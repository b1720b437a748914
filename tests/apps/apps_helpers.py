"""Helpers for the serving tests: tiny leaflens-style ONNX models built with onnx.helper and small
synthetic photos, so the tests need neither the engine nor any downloaded data.

(A uniquely named module rather than conftest.py, so `import` cannot pick another test folder's.)"""

from __future__ import annotations

import argparse
import json
import socket
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


def ood_metadata(threshold: float, stored_size: int, **check: object) -> dict[str, str]:
    """Metadata of a format 3 model with the out-of-domain output: ``leaflens.ood`` as the exporter writes it
    (ModelCard.to_metadata of an OODCheck; figures other than the threshold are made up, or given)."""
    from leaflens.apps.model_card import OODCheck

    values: dict[str, object] = {"method": "grey-score-test", "threshold": float(threshold), "budget": 0.03,
                                 "val_photos": 120, "val_flagged": 0.025, "train_photos": 480, "blocks": 1}
    values.update(check)
    return {"leaflens.format": "3", "leaflens.stored_size": str(stored_size),
            "leaflens.ood": json.dumps(OODCheck(**values).to_dict())}


def build_tiny_model(path: Path, weights: dict[str, np.ndarray], size: int,
                     metadata: dict[str, str], ood: bool = False) -> Path:
    """Write the model contract's shape: input [batch,3,S,S] -> logits [batch,C], opset 17, IR 8.

    ``ood=True`` adds the second output ``ood_score`` [batch]: :func:`reference_ood`, the (negated) mean
    colourfulness of the photo, so a grey photo (R = G = B: a scan, a digit, grey noise) scores 0 and a
    colourful one about -0.33 (random RGB noise) (the metadata must then carry ``leaflens.ood``)."""
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
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", num_classes])]
    if ood:
        # 1x1 conv from the normalised input back to pixel differences R-G and G-B on the [0, 1] scale:
        # p_c = x_c * std_c + mean_c, so (p_a - p_b) = std_a x_a - std_b x_b + (mean_a - mean_b).
        w = np.zeros((2, 3, 1, 1), np.float32)
        b = np.zeros(2, np.float32)
        for o, (a, c) in enumerate(((0, 1), (1, 2))):
            w[o, a, 0, 0], w[o, c, 0, 0] = STD[a], -STD[c]
            b[o] = MEAN[a] - MEAN[c]
        inits += [numpy_helper.from_array(w, "ood_w"), numpy_helper.from_array(b, "ood_b"),
                  numpy_helper.from_array(np.array(-1.0, np.float32), "ood_scale")]
        nodes += [
            helper.make_node("Conv", ["input", "ood_w", "ood_b"], ["d"], kernel_shape=[1, 1]),
            helper.make_node("Abs", ["d"], ["ad"]),
            helper.make_node("ReduceMean", ["ad"], ["m"], axes=[1, 2, 3], keepdims=0),
            helper.make_node("Mul", ["m", "ood_scale"], ["ood_score"]),
        ]
        outputs.append(helper.make_tensor_value_info("ood_score", TensorProto.FLOAT, ["batch"]))
    graph = helper.make_graph(
        nodes, "tiny_leaflens",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        outputs,
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


def reference_ood(batch_u8: np.ndarray) -> np.ndarray:
    """What the ``ood_score`` output of ``build_tiny_model(..., ood=True)`` gives for uint8 [N, S, S, 3] at the
    input size: minus the mean over pixels of (|R - G| + |G - B|) / 2 on the [0, 1] scale."""
    p = batch_u8.astype(np.float64) / 255.0
    return -0.5 * (np.abs(p[..., 0] - p[..., 1]) + np.abs(p[..., 1] - p[..., 2])).mean(axis=(1, 2))


def write_photo(path: Path, size: tuple[int, int] = (48, 40), seed: int = 0, fmt: str | None = None) -> Path:
    """Random RGB noise: colourful (in domain for the tiny out-of-domain score), detailed (never refused)."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format=fmt)
    return path


def write_leaf(path: Path, size: tuple[int, int] = (300, 200), seed: int = 0, fmt: str | None = None) -> Path:
    """A colourful photo at any size: a random strong colour cast, veins (stripes of about a fifth of the width)
    and noise, so it stays colourful (in domain for the tiny out-of-domain score, about -0.2 to -0.5) and
    detailed (never refused) when decoded to a few dozen pixels."""
    rng = np.random.default_rng(seed)
    base = rng.permutation([rng.uniform(20, 70), rng.uniform(110, 150), rng.uniform(190, 235)])
    yy, xx = np.mgrid[0:size[1], 0:size[0]]
    angle = rng.uniform(0, np.pi)
    veins = 35 * np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / (size[0] / 5))[..., None]
    arr = base + veins + rng.normal(0, 20, (size[1], size[0], 3))
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(path, format=fmt)
    return path


def write_grey_noise(path: Path, size: tuple[int, int] = (64, 48), seed: int = 0) -> Path:
    """Random grey noise (R = G = B): detailed enough to pass the photo checks, out of domain for the tiny score."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0]), dtype=np.uint8)).convert("RGB").save(path)
    return path


def write_digit(path: Path, size: int = 96, seed: int = 0) -> Path:
    """A handwritten-looking "7": white strokes on black with some sensor noise, grey like a scanned digit."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    top = (np.abs(yy - 0.2) < 0.06) & (xx > 0.2) & (xx < 0.8)
    stem = np.abs((xx - 0.8) + 0.45 * (yy - 0.2)) < 0.06
    stroke = top | (stem & (yy > 0.2) & (yy < 0.85))
    img = np.where(stroke, 230.0, 20.0) + rng.normal(0, 6, (size, size))
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).convert("RGB").save(path)
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


def served_tiny_model(root: Path, classes: list[str], size: int, ood_threshold: float,
                      run_id: str) -> tuple[Path, dict[str, np.ndarray], Path]:
    """What the live-server tests serve: (dataset, weights, model) - a preprocessed dataset of ``classes`` and a
    tiny model with the out-of-domain output whose answers are confident (peaky logits), not "ambiguous"."""
    dataset = make_dataset(root, classes, size)
    weights = tiny_weights(len(classes), seed=4)
    weights["fc_w"] *= 6.0
    meta = leaflens_metadata(classes, size, **{"leaflens.run_id": run_id}, **ood_metadata(ood_threshold, size))
    return dataset, weights, build_tiny_model(root / "student.onnx", weights, size, meta, ood=True)


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(**kw) -> argparse.Namespace:
    """`leaflens serve` arguments as parsed from --key value options (True: a bare flag). Without ``port``, a
    free one: a server already on the default 7860 (a developer's own) must not change what a test sees."""
    from leaflens.apps import cmd_serve

    parser = cmd_serve.add_parser(argparse.ArgumentParser().add_subparsers())
    kw.setdefault("port", free_port())
    argv = []
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return parser.parse_args(argv)
