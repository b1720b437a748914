"""Loader throughput against the engine's training step, at 64x64, batch 64.

The loader (leaflens.engine.data.DataLoader over a memory-mapped uint8 array, with random resized crop,
flips and brightness/contrast jitter) must deliver batches far faster than the engine trains on
them. Side by side in one run:

- loader batches/s in several configurations (background thread, inline, pad-and-crop, no
  augmentation) and a reference: the same augmentation done per image in a Python loop with
  Pillow (the usual torchvision-style path);
- the training step rate of the student CNN (3x3 conv 32-64-128, each BatchNorm2d + ReLU +
  MaxPool2d(2), global average pool, Linear) built with leaflens.engine.nn, SGD with momentum, on a fixed
  batch and fed by the loader (if the loader keeps up, the two rates match).

    python benchmarks/loader.py [--images 4096] [--batches 60] [--steps 8] [--quick]

Last line: JSON with loader_batches_s and train_steps_s (null when the engine's nn/optim
modules are not importable in this checkout), plus the other figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402  (benchmarks/ is not a package)

from leaflens.engine.data import ArrayDataset, Augment, DataLoader  # noqa: E402
from leaflens.pipeline.cli.runtime import configure_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MEAN, STD = (0.45, 0.5, 0.35), (0.2, 0.2, 0.2)


def make_images(path: Path, n: int, size: int) -> np.ndarray:
    """n textured uint8 images written to an .npy file, returned as a read-only memmap."""
    rng = np.random.default_rng(0)
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(n, size, size, 3))
    for start in range(0, n, 512):
        k = min(512, n - start)
        mm[start:start + k] = rng.integers(0, 256, (k, size, size, 3), dtype=np.uint8)
    mm.flush()
    del mm
    return np.load(path, mmap_mode="r")


def loader_rate(loader: DataLoader, batches: int) -> float:
    it = iter(loader)
    next(it)  # warm-up (thread start, first reads)
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        try:
            next(it)
        except StopIteration:
            it = iter(loader)
            next(it)
        n += 1
    rate = n / (time.perf_counter() - t0)
    it.close()
    return rate


def per_image_reference(images: np.ndarray, labels: np.ndarray, batch: int, batches: int) -> float:
    """Per-image Pillow augmentation loop (random resized crop, flip, jitter), then normalise."""
    rng = np.random.default_rng(0)
    n, size = images.shape[0], images.shape[1]
    mean, std = np.array(MEAN, np.float32), np.array(STD, np.float32)
    t0 = time.perf_counter()
    for _ in range(batches):
        idx = rng.integers(0, n, batch)
        out = np.empty((batch, size, size, 3), np.float32)
        for j, i in enumerate(idx):
            im = Image.fromarray(np.asarray(images[i]))
            area, r = rng.uniform(0.6, 1.0), math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = min(1.0, math.sqrt(area * r)) * size, min(1.0, math.sqrt(area / r)) * size
            ox, oy = rng.random() * (size - cw), rng.random() * (size - ch)
            im = im.resize((size, size), Image.Resampling.BILINEAR, box=(ox, oy, ox + cw, oy + ch))
            if rng.random() < 0.5:
                im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            a = np.asarray(im, np.float32)
            c, b = rng.uniform(0.8, 1.2), rng.uniform(0.8, 1.2)
            a = np.clip(((a - a.mean()) * c + a.mean()) * b, 0, 255)
            out[j] = (a / 255.0 - mean) / std
        _ = labels[idx]
    return batches / (time.perf_counter() - t0)


def build_student(num_classes: int):
    """The student CNN from leaflens.engine.nn; None when the engine's nn/optim are not available."""
    try:
        from leaflens.engine import nn
        from leaflens.engine.optim import SGD
    except ImportError:
        return None, None

    def block(cin: int, cout: int) -> list:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    model = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.GlobalAvgPool2d(),
                          nn.Linear(128, num_classes))
    return model, SGD(model.parameters(), lr=0.01, momentum=0.9)


def train_rates(loader: DataLoader, steps: int, num_classes: int) -> tuple[float | None, float | None]:
    """(steps/s on a fixed batch, steps/s fed by the loader); (None, None) without leaflens.engine.nn/optim."""
    model, opt = build_student(num_classes)
    if model is None:
        return None, None
    from leaflens.engine import Tensor, ops

    def step(x: np.ndarray, y: np.ndarray) -> None:
        opt.zero_grad()
        loss = ops.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        opt.step()

    it = iter(loader)
    x, y, *_ = next(it)
    y = y % num_classes
    step(x, y)  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    fixed = steps / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        xb, yb, *_ = next(it)
        step(xb, yb % num_classes)
    fed = steps / (time.perf_counter() - t0)
    it.close()
    return fixed, fed


def main(argv: list[str] | None = None) -> int:
    configure_process(engine=True)  # what the `leaflens` command runs with
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=positive_int, default=None,
                   help="images in the memmap, at least --batch (default 4096; --quick 1024)")
    p.add_argument("--size", type=positive_int, default=64)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--batches", type=positive_int, default=None,
                   help="timed loader batches per configuration (default 60; --quick 15)")
    p.add_argument("--steps", type=positive_int, default=None, help="timed training steps (default 8; --quick 3)")
    p.add_argument("--classes", type=positive_int, default=8)
    p.add_argument("--quick", action="store_true", help="smaller defaults; options given explicitly still win")
    args = p.parse_args(argv)
    for name, full, quick in (("images", 4096, 1024), ("batches", 60, 15), ("steps", 8, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.images < args.batch:  # the loaders drop the last partial batch: they would yield none
        p.error(f"--images {args.images} is fewer than one --batch of {args.batch}")

    with tempfile.TemporaryDirectory() as td:
        images = make_images(Path(td) / "train_images.npy", args.images, args.size)
        labels = np.arange(args.images, dtype=np.int64) % args.classes
        ds = ArrayDataset(images, labels)

        def mk(**kw) -> DataLoader:
            return DataLoader(ds, args.batch, seed=0, mean=MEAN, std=STD, drop_last=True, **kw)

        configs = [
            ("resized crop + flip + jitter, 1 thread", mk(augment=Augment())),
            ("resized crop + flip + jitter, inline", mk(augment=Augment(), num_threads=0)),
            ("resized crop + flip + jitter, 2 threads", mk(augment=Augment(), num_threads=2)),
            ("pad-and-crop + flip + jitter, 1 thread", mk(augment=Augment(crop="pad"))),
            ("no augmentation (normalise only)", mk()),
        ]
        rates = [(name, loader_rate(ld, args.batches)) for name, ld in configs]
        ref = per_image_reference(images, labels, args.batch, max(3, args.batches // 4))
        fixed, fed = train_rates(mk(augment=Augment()), args.steps, args.classes)

    loader_bs = rates[0][1]
    print(f"{'loader, batch ' + str(args.batch) + ' at ' + str(args.size) + 'x' + str(args.size):<48}"
          f"{'batches/s':>10}{'images/s':>10}")
    for name, r in rates:
        print(f"{name:<48}{r:>10.1f}{r * args.batch:>10.0f}")
    print(f"{'reference: per-image Pillow loop':<48}{ref:>10.1f}{ref * args.batch:>10.0f}")
    print()
    if fixed is None:
        print("training step: engine nn / optim not importable in this checkout -> train_steps_s null")
    else:
        print(f"{'student training step (engine, CPU)':<48}{'steps/s':>10}")
        print(f"{'  fixed batch':<48}{fixed:>10.2f}")
        print(f"{'  fed by the loader':<48}{fed:>10.2f}")
        print(f"loader headroom: {loader_bs / fixed:.0f}x the training step rate")
    result = {
        "loader_batches_s": round(loader_bs, 1),
        "train_steps_s": None if fixed is None else round(fixed, 3),
        "train_steps_fed_s": None if fed is None else round(fed, 3),
        "loader_inline_batches_s": round(rates[1][1], 1),
        "loader_pad_batches_s": round(rates[3][1], 1),
        "loader_noaug_batches_s": round(rates[4][1], 1),
        "reference_per_image_batches_s": round(ref, 2),
        "batch": args.batch,
        "size": args.size,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
