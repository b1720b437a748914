"""Phone-edited photos: does the served model still answer them right, or wrongly with confidence?

People send photos taken farther away, in shade or sun, sent through a messenger at low JPEG quality,
with a date stamp, slightly out of focus, under warm light. This script takes an exported model and its
dataset, and serves every photo of a split (validation by default: choose recipes on it, never on test)
through the Predictor as it is and after each edit below (none random), made from the original photo file:

    zoom70, zoom50    the photo shrunk to 70 / 50 % of its side, centred on a blurred, enlarged copy of
                      itself (what a phone's "fit" or a messenger's preview does; the leaf fills less frame)
    dark50, bright150 brightness x0.5 and x1.5 (clipped), as in shade or in full sun
    jpeg20            JPEG quality 20 (a messenger's compression)
    stamp             a camera date stamp in orange in the bottom-right corner
    blur              Gaussian blur of 1 % of the side (slightly out of focus)
    warm              warm white balance (red x1.12, blue x0.85)

For each it counts right diagnoses, wrong diagnoses (a disease named with confidence, the failure that
matters), and photos not answered (ambiguous, out of domain, refused), as shares of the split.

    python benchmarks/robustness.py --model artifacts/export/student.onnx --dataset artifacts/dataset

Last line: one JSON object with ``photos``, ``split``, and per edit ``right_<edit>``, ``wrong_<edit>``,
``unanswered_<edit>`` (``plain`` for the photos as they are), plus ``mean_right_edited`` and
``mean_wrong_edited`` over the edits.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402  (benchmarks/ is not a package)

from leaflens.apps.predictor import Predictor  # noqa: E402
from leaflens.data_prep.manifest import load_dataset  # noqa: E402
from leaflens.pipeline.evaluate import PhotosUnavailable, dataset_photo_files  # noqa: E402


def _fit(im: Image.Image, side: float) -> Image.Image:
    """``im`` shrunk to ``side`` of its size, centred on a blurred copy of itself enlarged to fill the frame."""
    w, h = im.size
    small = im.resize((max(1, round(w * side)), max(1, round(h * side))), Image.Resampling.LANCZOS)
    back = im.resize((max(1, w // 8), max(1, h // 8)), Image.Resampling.BILINEAR)
    back = back.filter(ImageFilter.GaussianBlur(2)).resize((w, h), Image.Resampling.BILINEAR)
    back.paste(small, ((w - small.width) // 2, (h - small.height) // 2))
    return back


def _scaled(im: Image.Image, gains: tuple[float, float, float]) -> Image.Image:
    a = np.asarray(im, np.float32) * np.asarray(gains, np.float32)
    return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8))


def _stamp(im: Image.Image) -> Image.Image:
    out = im.copy()
    size = max(8, out.height // 14)
    font = ImageFont.load_default(size=size)
    text = "2026/07/14 16:32"
    draw = ImageDraw.Draw(out)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    xy = (out.width - (right - left) - size // 2, out.height - (bottom - top) - size // 2)
    draw.text(xy, text, fill=(255, 140, 0), font=font)
    return out


EDITS: dict[str, Callable[[Image.Image], Image.Image]] = {
    "zoom70": lambda im: _fit(im, 0.7),
    "zoom50": lambda im: _fit(im, 0.5),
    "dark50": lambda im: _scaled(im, (0.5, 0.5, 0.5)),
    "bright150": lambda im: _scaled(im, (1.5, 1.5, 1.5)),
    "jpeg20": lambda im: im,  # the edit is the save (below)
    "stamp": _stamp,
    "blur": lambda im: im.filter(ImageFilter.GaussianBlur(max(im.size) / 100)),
    "warm": lambda im: _scaled(im, (1.12, 1.0, 0.85)),
}


def write_edit(src: str, name: str, out: Path) -> Path:
    """The photo ``src`` (EXIF orientation applied) after edit ``name``, saved under ``out`` (PNG, or JPEG q20)."""
    with Image.open(src) as raw:
        im = ImageOps.exif_transpose(raw).convert("RGB")
    edited = EDITS[name](im)
    if name == "jpeg20":
        path = out.with_suffix(".jpg")
        edited.save(path, quality=20)
    else:
        path = out.with_suffix(".png")
        edited.save(path)
    return path


def score(predictor: Predictor, files: list[str], labels: list[str]) -> dict[str, float]:
    right = wrong = 0
    for p, label in zip(predictor.iter_predict_files(files, top_k=2), labels):
        if p.ok and p.verdict == "diagnosis":
            right += int(p.label == label)
            wrong += int(p.label != label)
    n = len(files)
    return {"right": right / n, "wrong": wrong / n, "unanswered": (n - right - wrong) / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="exported model (student.onnx)")
    ap.add_argument("--dataset", type=Path, required=True, help="the dataset folder the model was trained on")
    ap.add_argument("--split", default="val", help="split whose original photos are edited (default val)")
    ap.add_argument("--edits", default=",".join(EDITS), help=f"comma-separated subset of {', '.join(EDITS)}")
    ap.add_argument("--threads", type=positive_int, default=2, help="onnxruntime threads (default 2)")
    args = ap.parse_args()
    edits = [e.strip() for e in args.edits.split(",") if e.strip()]
    unknown = [e for e in edits if e not in EDITS]
    if unknown:
        ap.error(f"--edits: unknown {', '.join(unknown)} (known: {', '.join(EDITS)})")
    try:
        ds = load_dataset(args.dataset)
        if args.split not in ds.splits or not len(ds[args.split]) or ds[args.split].labels is None:
            raise ValueError(f"{args.dataset}: no labelled photos in split '{args.split}' (it has "
                             f"{', '.join(ds.splits)})")
        _, files = dataset_photo_files(ds, args.split)
        labels = [ds.classes[int(i)] for i in np.asarray(ds[args.split].labels)]
        predictor = Predictor(args.model, intra_op_threads=args.threads)
    except (OSError, ValueError, PhotosUnavailable) as e:
        print(f"robustness.py: {e}", file=sys.stderr)
        return 1
    results = {"plain": score(predictor, files, labels)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in edits:
            folder = Path(tmp) / name
            folder.mkdir()
            edited = [str(write_edit(f, name, folder / f"{i:05d}")) for i, f in enumerate(files)]
            results[name] = score(predictor, edited, labels)
    print(f"{len(files)} {args.split} photos, {args.model}")
    print(f"{'edit':10s} {'right':>7s} {'wrong':>7s} {'not answered':>13s}")
    for name, r in results.items():
        print(f"{name:10s} {r['right']:7.1%} {r['wrong']:7.1%} {r['unanswered']:13.1%}")
    out: dict[str, object] = {"photos": len(files), "split": args.split}
    for name, r in results.items():
        out.update({f"{k}_{name}": round(v, 4) for k, v in r.items()})
    if edits:
        out["mean_right_edited"] = round(float(np.mean([results[e]["right"] for e in edits])), 4)
        out["mean_wrong_edited"] = round(float(np.mean([results[e]["wrong"] for e in edits])), 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
