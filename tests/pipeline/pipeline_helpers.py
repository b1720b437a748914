"""Tiny datasets and teachers for pipeline tests, made from scratch in tmp_path."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data_prep"))

from dp_helpers import make_class_folders  # noqa: E402

from leaflens.data_prep.ingest import IngestOptions, ingest  # noqa: E402
from leaflens.data_prep.manifest import load_dataset  # noqa: E402


def tiny_dataset(tmp: Path, per_class: int = 16, size: int = 16, unlabeled: int = 0) -> Path:
    """Three colour classes, split 70/15/15, at ``size`` pixels (plus an optional unlabeled folder)."""
    src = make_class_folders(tmp / "photos", per_class=per_class)
    unl = None
    if unlabeled:
        unl = tmp / "unlabeled_photos"
        unl.mkdir()
        rng = np.random.default_rng(5)
        for i in range(unlabeled):
            arr = np.clip(rng.normal(120, 60, (20, 20, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(unl / f"u{i}.png")
    out = tmp / "dataset"
    ingest(src, out, IngestOptions(size=size), unlabeled=unl, workers=1, log=lambda s: None)
    return out


def class_features(dataset_dir: Path, out: Path, dim: int = 12, noise: float = 0.3, seed: int = 0) -> Path:
    """A features folder a good teacher would give: class prototypes plus noise (random for unlabelled)."""
    ds = load_dataset(dataset_dir)
    rng = np.random.default_rng(seed)
    protos = rng.standard_normal((ds.num_classes, dim))
    out.mkdir(parents=True, exist_ok=True)
    for split in ds.splits:
        n = len(ds[split])
        labels = ds[split].labels
        base = protos[np.asarray(labels)] if labels is not None else rng.standard_normal((n, dim))
        feats = (base + noise * rng.standard_normal((n, dim))).astype(np.float32)
        np.save(out / f"features_{split}.npy", feats)
        logit = (feats @ protos.T).astype(np.float32)
        np.save(out / f"logits_{split}.npy", logit)
    return out


def write_lite0_shaped(path: Path) -> Path:
    """A legacy-format .pth in EfficientNet-Lite0's real block shapes (a small head) with random weights: the
    stand-in for the ImageNet file in tests of the pretrained students."""
    from pth_checkpoint_files import TensorSpec, write_legacy  # noqa: PLC0415
    from test_efficientnet import tiny_state  # noqa: PLC0415

    from leaflens.pipeline.models.trunk import lite0_block_specs  # noqa: PLC0415

    blocks = [(s.cin, s.cout, s.hidden, s.kernel) for s in lite0_block_specs()]
    state = tiny_state(seed=5, blocks=blocks, stem=32, head=16, classes=5)
    return write_legacy(path, {k: TensorSpec.of(str(i), v) for i, (k, v) in enumerate(state.items())
                               if not k.endswith("num_batches_tracked")})


def with_moved_bn_stats(net, seed: int = 2):
    """``net`` in eval mode with its BatchNorm running statistics drawn away from (0, 1), so that a test sees
    whether they were kept, frozen or copied."""
    from leaflens.engine.nn import BatchNorm2d  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    for m in net.modules():
        if isinstance(m, BatchNorm2d):
            m.running_mean[...] = rng.normal(0, 0.2, m.num_features)
            m.running_var[...] = rng.uniform(0.5, 2.0, m.num_features)
    return net.eval()


def crash_after_checkpoints(monkeypatch, n: int) -> list[Path]:
    """Ctrl-C, once, right after the training loop has saved its ``n``-th ``last.npz`` (the end of an epoch),
    as a killed run would stop; returns the list of every ``last.npz`` saved from now on, in order."""
    import leaflens.pipeline.training as training  # noqa: PLC0415

    real, saved, crashed = training.save_checkpoint, [], []

    def save(path, *args, **kwargs):
        real(path, *args, **kwargs)
        if Path(path).name == "last.npz":
            saved.append(Path(path))
            if len(saved) == n and not crashed:
                crashed.append(True)
                raise KeyboardInterrupt(f"simulated crash after checkpoint {n}")

    monkeypatch.setattr(training, "save_checkpoint", save)
    return saved
