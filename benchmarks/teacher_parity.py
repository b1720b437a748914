"""Is the engine's EfficientNet-Lite0 right? Parity with PyTorch, speed, and feature quality on iBeans.

1. Reader: every array ``leaflens.pipeline.models.torch_weights`` reads equals ``torch.load(weights_only=True)``'s.
2. Parity: the same network written here independently with ``torch.nn.functional`` (NCHW; block
   strides hard-coded from EfficientNet-B0; TF 'same' padding computed per input like the
   reference ``Conv2dDynamicSamePadding``) gets the same state dict; 1280-d features of real photos
   (synthetic images without ``--data``) are compared for 'same' and symmetric padding.
3. Speed: images/s of the engine forward (plain and with BatchNorm folded) beside PyTorch.
4. Quality (needs ``--data``): frozen features of train/val/test for padding x normalisation, then
   1-NN (cosine) and a linear probe (softmax regression, L2 weight chosen on val) on the test split.
   Features come from the engine (``--extractor engine``, the default; slow on a CPU) or PyTorch
   (``--extractor torch``); ``--per-class N`` limits every split to N images per class.

    python benchmarks/teacher_parity.py [--data ../shared/data/ibeans] [--per-class N] [--cache DIR]

PyTorch is used only here, as the reference; without it the run is skipped (exit 0, the reason on stderr,
every figure null). The last line is JSON: ``skipped`` (why nothing was measured, else null),
``reader_identical``, ``max_abs_diff_same``, ``max_rel_diff_same``, ``max_abs_diff_symmetric``,
``max_rel_diff_symmetric``, ``engine_img_s``, ``engine_fused_img_s``, ``torch_img_s`` and, with --data,
``knn_acc`` and ``probe_acc`` per configuration ("same/tf", "same/imagenet", "symmetric/tf", "symmetric/imagenet").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from leaflens.engine import no_grad
from leaflens.files import write_path_atomic
from leaflens.pipeline.cli.runtime import configure_process
from leaflens.pipeline.models.efficientnet import EfficientNetLite, LiteConfig, normalize_images
from leaflens.pipeline.models.pretrained import find_lite0_weights
from leaflens.pipeline.models.torch_weights import load_torch_state_dict

CONFIGS = [("same", "tf"), ("same", "imagenet"), ("symmetric", "tf"), ("symmetric", "imagenet")]
B0_BLOCK_STRIDES = [1, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default=None, help="checkpoint (default: the installed package's)")
    p.add_argument("--data", default=None, help="iBeans root with {train,val,test}/<class>/*.jpg")
    p.add_argument("--per-class", type=int, default=0, help="images per class and split (0 = all)")
    p.add_argument("--extractor", choices=["engine", "torch"], default="engine")
    p.add_argument("--configs", default="all", help="comma list like same/tf,symmetric/imagenet, or all")
    p.add_argument("--parity-images", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", default=None, help="folder to keep decoded images and features between runs")
    p.add_argument("--eps", type=float, default=1e-3, help="BatchNorm epsilon")
    return p.parse_args()


# ---- the PyTorch reference, written from the state dict alone ---------------------------------------------
def torch_lite0(state, padding: str, eps: float):
    import torch
    import torch.nn.functional as F

    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}

    def conv(x, w, stride, groups=1):
        k = w.shape[-1]
        if padding == "same":
            ih, iw = x.shape[-2:]
            ph = max((-(-ih // stride) - 1) * stride + k - ih, 0)
            pw = max((-(-iw // stride) - 1) * stride + k - iw, 0)
            x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
            return F.conv2d(x, w, None, stride, 0, 1, groups)
        return F.conv2d(x, w, None, stride, k // 2, 1, groups)

    def bn(x, p):
        return F.batch_norm(x, sd[p + ".running_mean"], sd[p + ".running_var"], sd[p + ".weight"],
                            sd[p + ".bias"], False, 0.0, eps)

    def act(x):
        return F.hardtanh(x, 0.0, 6.0)

    def features(x):
        x = act(bn(conv(x, sd["_conv_stem.weight"], 2), "_bn0"))
        for i, s in enumerate(B0_BLOCK_STRIDES):
            p = f"_blocks.{i}."
            h = x
            if p + "_expand_conv.weight" in sd:
                h = act(bn(conv(h, sd[p + "_expand_conv.weight"], 1), p + "_bn0"))
            dw = sd[p + "_depthwise_conv.weight"]
            h = act(bn(conv(h, dw, s, groups=dw.shape[0]), p + "_bn1"))
            h = bn(conv(h, sd[p + "_project_conv.weight"], 1), p + "_bn2")
            x = h + x if s == 1 and h.shape == x.shape else h
        x = act(bn(conv(x, sd["_conv_head.weight"], 1), "_bn1"))
        return x.mean(dim=(2, 3))

    return features


def torch_features(fn, x_nhwc: np.ndarray, batch: int) -> np.ndarray:
    import torch

    out = []
    with torch.inference_mode():
        for i in range(0, len(x_nhwc), batch):
            xb = torch.from_numpy(np.ascontiguousarray(x_nhwc[i:i + batch].transpose(0, 3, 1, 2)))
            out.append(fn(xb).numpy())
    return np.concatenate(out)


def engine_features(model: EfficientNetLite, x_nhwc: np.ndarray, batch: int) -> np.ndarray:
    out = []
    with no_grad():
        for i in range(0, len(x_nhwc), batch):
            out.append(model.features(x_nhwc[i:i + batch]).numpy())
    return np.concatenate(out)


# ---- data ---------------------------------------------------------------------------------------------------
def list_split(root: Path, split: str, per_class: int) -> tuple[list[Path], list[int], list[str]]:
    classes = sorted(d.name for d in (root / split).iterdir() if d.is_dir())
    files, labels = [], []
    for ci, c in enumerate(classes):
        fs = sorted((root / split / c).glob("*.jpg"))
        if per_class:
            fs = fs[:per_class]
        files += fs
        labels += [ci] * len(fs)
    return files, labels, classes


def decode_split(files: list[Path]) -> np.ndarray:
    from leaflens.data_prep.decode import decode_image_at

    return np.stack([decode_image_at(f, 224, "crop", shorter_side=256) for f in files])


def cached(cache: Path | None, name: str, make):
    if cache is None:
        return make()
    path = cache / f"{name}.npy"
    if path.exists():
        return np.load(path, allow_pickle=False)
    arr = make()
    write_path_atomic(path, lambda tmp: np.save(tmp, arr, allow_pickle=False))
    return arr


# ---- evaluation ----------------------------------------------------------------------------------------------
def l2n(f: np.ndarray) -> np.ndarray:
    return f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)


def knn1(train_f, train_y, test_f, test_y) -> float:
    sim = l2n(test_f) @ l2n(train_f).T
    return float((train_y[sim.argmax(axis=1)] == test_y).mean())


def softmax_regression(x, y, classes: int, l2: float, steps: int = 1000, lr: float = 0.5) -> tuple:
    """Full-batch gradient descent with Nesterov momentum on standardised features."""
    n, d = x.shape
    w = np.zeros((d, classes), np.float64)
    b = np.zeros(classes, np.float64)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    onehot = np.eye(classes)[y]
    for _ in range(steps):
        lw, lb = w + 0.9 * vw, b + 0.9 * vb
        z = x @ lw + lb
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / n
        gw = x.T @ g + l2 * lw
        gb = g.sum(axis=0)
        vw = 0.9 * vw - lr * gw
        vb = 0.9 * vb - lr * gb
        w, b = w + vw, b + vb
    return w, b


def linear_probe(tr_f, tr_y, va_f, va_y, te_f, te_y) -> tuple[float, float]:
    mu, sd = tr_f.mean(axis=0), tr_f.std(axis=0) + 1e-6
    tr, va, te = ((f - mu) / sd for f in (tr_f, va_f, te_f))
    classes = int(tr_y.max()) + 1
    best = None
    for l2 in (1e-4, 1e-3, 1e-2, 1e-1):
        w, b = softmax_regression(tr, tr_y, classes, l2)
        val = float(((va @ w + b).argmax(axis=1) == va_y).mean())
        if best is None or val > best[0]:
            best = (val, l2, w, b)
    _, l2, w, b = best
    return float(((te @ w + b).argmax(axis=1) == te_y).mean()), l2


def timed(fn, *args) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def skipped_json(reason: str) -> dict[str, object]:
    """The JSON line of a run that measured nothing: every figure null, ``skipped`` saying why."""
    return {"skipped": reason, "reader_identical": None,
            **{f"{k}_{p}": None for k in ("max_abs_diff", "max_rel_diff") for p in ("same", "symmetric")},
            "engine_img_s": None, "engine_fused_img_s": None, "torch_img_s": None}


def main() -> int:
    configure_process(engine=True)  # what the `leaflens` command runs with
    args = parse_args()
    try:
        import torch
    except ImportError as exc:  # an optional reference: skipped, as benchmarks/gpu.py is without a GPU
        reason = (f"PyTorch, the reference the engine's teacher is compared with, is not importable ({exc}); "
                  "pip install torch==2.13.0 (benchmarks only, never the product)")
        print(f"teacher_parity.py: skipped: {reason}", file=sys.stderr)
        print(json.dumps(skipped_json(reason)))
        return 0
    torch.set_num_threads(args.threads)
    cache = Path(args.cache) if args.cache else None
    weights = find_lite0_weights(args.weights)
    state = load_torch_state_dict(weights)
    ref = torch.load(weights, map_location="cpu", weights_only=True)
    reader_ok = list(ref) == list(state) and all(
        ref[k].numpy().dtype == state[k].dtype and np.array_equal(ref[k].numpy(), state[k]) for k in ref)
    print(f"weights: {weights}")
    print(f"reader: {len(state)} arrays, identical to torch.load: {reader_ok}")
    figures: dict[str, object] = {"reader_identical": reader_ok}

    # parity images: real photos when available, otherwise smooth synthetic ones
    rng = np.random.default_rng(0)
    root = Path(args.data) if args.data else None
    if root is not None and not (root / "test").is_dir():
        print(f"--data {root} has no test/ folder", file=sys.stderr)
        return 2
    if root is not None:
        files, _, _ = list_split(root, "test", 0)
        pick = [files[i] for i in rng.choice(len(files), args.parity_images, replace=False)]
        imgs = decode_split(pick)
    else:
        base = rng.uniform(0, 255, (args.parity_images, 7, 7, 3)).astype(np.float32)
        imgs = np.stack([np.asarray(Image.fromarray(b.astype(np.uint8)).resize((224, 224), Image.BICUBIC))
                         for b in base])

    print("\nparity (1280-d pooled features, engine vs PyTorch reference)")
    print(f"{'padding':<22} {'max |diff|':>11} {'max |f|':>9} {'rel':>9}")
    for padding in ("same", "symmetric"):
        cfg = LiteConfig(padding=padding, bn_eps=args.eps)
        model = EfficientNetLite.from_torch_state_dict(state, config=cfg)
        x = normalize_images(imgs, "tf")
        fe = engine_features(model, x, args.batch)
        ft = torch_features(torch_lite0(state, padding, args.eps), x, args.batch)
        ff = engine_features(model.fused(), x, args.batch)
        scale = float(np.abs(ft).max())
        for name, f in ((padding, fe), (f"{padding} (BN folded)", ff)):
            diff = float(np.abs(f - ft).max())
            print(f"{name:<22} {diff:>11.3e} {scale:>9.3f} {diff / scale:>9.2e}")
        figures[f"max_abs_diff_{padding}"] = float(np.abs(fe - ft).max())
        figures[f"max_rel_diff_{padding}"] = figures[f"max_abs_diff_{padding}"] / scale
        figures[f"max_rel_diff_{padding}_folded"] = float(np.abs(ff - ft).max()) / scale

    # speed
    model = EfficientNetLite.from_torch_state_dict(state, config=LiteConfig(bn_eps=args.eps))
    fused = model.fused()
    xb = normalize_images(np.repeat(imgs, -(-args.batch // len(imgs)), axis=0)[:args.batch], "tf")
    tfn = torch_lite0(state, "same", args.eps)
    engine_features(model, xb[:2], 2)
    torch_features(tfn, xb[:2], 2)
    runs = {"engine": lambda: engine_features(model, xb, args.batch),
            "engine (BN folded)": lambda: engine_features(fused, xb, args.batch),
            "PyTorch": lambda: torch_features(tfn, xb, args.batch)}
    best = {k: min(timed(fn)[0] for _ in range(2)) for k, fn in runs.items()}
    print(f"\nspeed, batch {args.batch} at 224x224, {args.threads} threads")
    for k, s in best.items():
        print(f"{k:<20} {args.batch / s:>8.2f} images/s")
    figures["engine_img_s"] = args.batch / best["engine"]
    figures["engine_fused_img_s"] = args.batch / best["engine (BN folded)"]
    figures["torch_img_s"] = args.batch / best["PyTorch"]

    if root is not None:
        wanted = CONFIGS if args.configs == "all" else [tuple(c.split("/")) for c in args.configs.split(",")]
        splits = {}
        for split in ("train", "val", "test"):
            files, labels, classes = list_split(root, split, args.per_class)
            tag = f"{split}_{args.per_class or 'all'}"
            t, img = timed(cached, cache, f"images_{tag}", lambda files=files: decode_split(files))
            splits[split] = (img, np.asarray(labels))
            print(f"{split}: {len(files)} images decoded in {t:.1f}s")
        print(f"\niBeans, frozen features by {args.extractor} (shorter side 256, centre crop 224, BN eps "
              f"{args.eps}); accuracy on test")
        print(f"{'padding/normalisation':<24} {'1-NN':>7} {'probe':>7} {'probe L2':>9} {'extract s':>10}")
        knn, probe = {}, {}
        for padding, norm in wanted:
            if args.extractor == "engine":
                net = EfficientNetLite.from_torch_state_dict(state, config=LiteConfig(padding=padding,
                                                                                      bn_eps=args.eps)).fused()

                def extract(img, net=net, norm=norm):
                    return engine_features(net, normalize_images(img, norm), args.batch)
            else:
                fn = torch_lite0(state, padding, args.eps)

                def extract(img, fn=fn, norm=norm):
                    return torch_features(fn, normalize_images(img, norm), args.batch)
            feats, secs = {}, 0.0
            for split, (img, _) in splits.items():
                name = f"feat_{args.extractor}_{padding}_{norm}_{args.eps}_{split}_{args.per_class or 'all'}"
                t, feats[split] = timed(cached, cache, name, lambda img=img, extract=extract: extract(img))
                secs += t
            (tr, ytr), (va, yva), (te, yte) = ((feats[s], splits[s][1]) for s in ("train", "val", "test"))
            key = f"{padding}/{norm}"
            knn[key] = knn1(tr, ytr, te, yte)
            probe[key], l2 = linear_probe(tr, ytr, va, yva, te, yte)
            print(f"{key:<24} {knn[key]:>7.1%} {probe[key]:>7.1%} {l2:>9.0e} {secs:>10.1f}")
        figures["knn_acc"] = knn
        figures["probe_acc"] = probe
        figures["images"] = {s: len(v[1]) for s, v in splits.items()}
        figures["extractor"] = args.extractor
    print(json.dumps({"skipped": None, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
