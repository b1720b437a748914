"""The near-duplicate threshold, measured (leaflens.data_prep.near_dup).

For a folder of photos (any layout; every image file under it): (a) the hash distance of every pair of
different files: how many pairs fall within each threshold (false matches, unless a pair really is the
same picture: the closest ones are listed to look at), and the colour distance of the pairs within the
threshold (copies when within ``COLOUR_THRESHOLD``, look-alikes otherwise); (b) for a sample of photos,
the hash and colour distances to their own altered copies: resized, re-encoded, saved as PNG, brightened,
centre-cropped 1-10 % per side, cropped on one side, cropped + resized + re-encoded, and the share found
as copies (both within their thresholds); (c) the distance between the hashes of the stored
pixels and those `leaflens preprocess --check` computes from its smaller decode; (d) the pair search's
time on 20,000 random hashes.

    python benchmarks/near_duplicates.py /work/shared/data/ibeans [--size 128] [--sample 150]
    python benchmarks/near_duplicates.py artifacts/synthetic --labelled-only   # the demo's photos (make data)

The last line of output is a JSON object.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from leaflens.data_prep.contract import decode_stored
from leaflens.data_prep.ingest import check_size
from leaflens.data_prep.near_dup import (
    COLOUR_THRESHOLD,
    HASH_COLUMNS,
    HASH_CROPS,
    NEAR_THRESHOLD,
    TURN_THRESHOLD,
    colour_distance,
    colour_signatures,
    find_copies,
    hamming,
    near_pairs,
    photo_hashes,
)
from leaflens.data_prep.scan import IMAGE_EXTENSIONS


def _jpeg(im: Image.Image, quality: int = 85) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _crop(im: Image.Image, pct: float) -> Image.Image:
    w, h = im.size
    cw, ch = round(w * pct / 100), round(h * pct / 100)
    return im.crop((cw, ch, w - cw, h - ch))


def _cropped_jpeg(im: Image.Image, pct: float) -> bytes:
    return _jpeg(_crop(im, pct))


ALTERATIONS = {
    "resize x0.5": lambda im: _jpeg(im.resize((im.width // 2, im.height // 2), Image.Resampling.LANCZOS)),
    "resize x2, PNG": lambda im: _png(im.resize((im.width * 2, im.height * 2), Image.Resampling.BICUBIC)),
    "JPEG quality 40": lambda im: _jpeg(im, 40),
    "JPEG quality 20": lambda im: _jpeg(im, 20),
    "brighter (+10)": lambda im: _jpeg(Image.fromarray(np.clip(np.asarray(im, np.int16) + 10, 0, 255)
                                                       .astype(np.uint8))),
    **{f"centre crop {p} %/side": functools.partial(_cropped_jpeg, pct=p) for p in (1, 2, 3, 4, 5, 6, 7, 8, 10)},
    "top cropped 5 %": lambda im: _jpeg(im.crop((0, round(im.height * 0.05), im.width, im.height))),
    "mirrored": lambda im: _jpeg(ImageOps.mirror(im)),
    "rotated 90°": lambda im: _jpeg(im.transpose(Image.Transpose.ROTATE_270)),
    "rotated 90°, quality 40": lambda im: _jpeg(im.transpose(Image.Transpose.ROTATE_270), 40),
    "upside down": lambda im: _jpeg(im.transpose(Image.Transpose.ROTATE_180)),
    "mirrored, centre crop 2 %": lambda im: _cropped_jpeg(ImageOps.mirror(im), 2),
    "rotated 90°, centre crop 3 %": lambda im: _cropped_jpeg(im.transpose(Image.Transpose.ROTATE_270), 3),
    "crop 4 %, x0.65, quality 50": lambda im: _jpeg(_crop(im, 4).resize((round(im.width * 0.65),
                                                                          round(im.height * 0.65))), 50),
}


def pair_distance(a: np.ndarray, b: np.ndarray) -> int:
    """The distance near_pairs uses, for one pair of (HASH_COLUMNS,) hash rows: the crops' within any distance,
    the turns' (the columns after the crops) only within TURN_THRESHOLD."""
    crops = len(HASH_CROPS)
    plain = int(min(hamming(a[0], b[:crops]).min(), hamming(b[0], a[:crops]).min()))
    turned = int(min(hamming(a[0], b[crops:]).min(), hamming(b[0], a[crops:]).min()))
    return min(plain, turned) if turned <= TURN_THRESHOLD else plain


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="folder of photos")
    p.add_argument("--size", type=int, default=128, help="stored size the hashes are taken at (default 128)")
    p.add_argument("--sample", type=int, default=150, help="photos altered in (b) and (c) (default 150)")
    p.add_argument("--closest", type=int, default=6, help="closest different-photo pairs to list")
    p.add_argument("--labelled-only", action="store_true",
                   help="leave out photos under an 'unlabeled' folder (preprocess checks the labelled ones)")
    args = p.parse_args()
    if not args.src.is_dir():
        p.error(f"{args.src} is not a folder of photos")
    if args.size < 8 or args.sample < 1 or args.closest < 0:
        p.error("--size must be 8 or more, --sample 1 or more, --closest 0 or more")

    files, datas, stored = [], [], []
    skipped = 0
    for f in sorted(args.src.rglob("*")):
        if f.suffix.lower() not in IMAGE_EXTENSIONS or not f.is_file():
            continue
        if args.labelled_only and "unlabeled" in f.relative_to(args.src).parts:
            continue
        data = f.read_bytes()
        try:
            px = decode_stored(data, args.size, "crop")
        except Exception:  # a broken file (data synth makes some): preprocess rejects it too
            skipped += 1
            continue
        files.append(f)
        datas.append(data)
        stored.append(px)
    if skipped:
        print(f"{skipped} files could not be decoded: left out")
    if len(stored) < 2:
        sys.exit(f"near_duplicates.py: {args.src} holds {len(stored)} photo(s) that decode; the benchmark needs two "
                 "or more")
    hashes = np.stack([photo_hashes(px) for px in stored])
    colours = np.stack([colour_signatures(px) for px in stored])
    n = len(files)
    i, j, d = near_pairs(hashes, threshold=16)
    pairs_total = n * (n - 1) // 2
    within = {t: int((d <= t).sum()) for t in range(0, 17, 2)}
    print(f"{n} photos, {pairs_total:,} pairs of different photos; pairs within t bits: {within}")
    order = np.argsort(d, kind="stable")[: args.closest]
    colour = colour_distance(colours[i], colours[j]) if len(i) else np.zeros(0, np.float32)
    closest = [(str(files[i[k]].relative_to(args.src)), str(files[j[k]].relative_to(args.src)), int(d[k]),
                round(float(colour[k]), 1)) for k in order]
    for a, b, dist, c in closest:
        print(f"  {dist:2d} bits, colour {c:5.1f}: {a}  {b}")
    near = d <= NEAR_THRESHOLD
    found = find_copies(hashes, colours)
    print(f"pairs within {NEAR_THRESHOLD} bits: {int(near.sum())}, of them within {COLOUR_THRESHOLD:g} grey levels "
          f"in colour (copies): {int((near & (colour <= COLOUR_THRESHOLD)).sum())}, look-alikes: "
          f"{found.look_alike_pairs}; colour distances of the pairs within {NEAR_THRESHOLD} bits: "
          f"{sorted(round(float(c), 1) for c in colour[near])}")

    rng = np.random.default_rng(0)
    sample = rng.choice(n, min(args.sample, n), replace=False)
    altered: dict[str, list[int]] = {name: [] for name in ALTERATIONS}
    altered_colour: dict[str, list[float]] = {name: [] for name in ALTERATIONS}
    check: list[int] = []
    small = check_size(args.size)
    for k in sample:
        im = ImageOps.exif_transpose(Image.open(io.BytesIO(datas[k]))).convert("RGB")  # as decode_stored turns it
        for name, alter in ALTERATIONS.items():
            px = decode_stored(alter(im), args.size, "crop")
            altered[name].append(pair_distance(hashes[k], photo_hashes(px)))
            altered_colour[name].append(float(colour_distance(colours[k], colour_signatures(px))))
        check.append(int(hamming(hashes[k], photo_hashes(decode_stored(datas[k], small, "crop"))).max()))
    print(f"\n{'altered copy (' + str(len(sample)) + ' photos)':<34}{'max':>5}{'p95':>6}{'mean':>6}"
          f"{'within ' + str(NEAR_THRESHOLD):>10}{'colour p99':>11}{'max':>6}{'found':>7}")
    summary = {}
    for name, dists in altered.items():
        a = np.array(dists)
        c = np.array(altered_colour[name])
        copies = (a <= NEAR_THRESHOLD) & (c <= COLOUR_THRESHOLD)
        summary[name] = {"max": int(a.max()), "mean": round(float(a.mean()), 2),
                         "matched": round(float((a <= NEAR_THRESHOLD).mean()), 3),
                         "colour_p99": round(float(np.percentile(c, 99)), 2), "colour_max": round(float(c.max()), 2),
                         "found": round(float(copies.mean()), 3)}
        print(f"{name:<34}{a.max():>5}{np.percentile(a, 95):>6.1f}{a.mean():>6.2f}"
              f"{100 * (a <= NEAR_THRESHOLD).mean():>9.0f}%{np.percentile(c, 99):>11.1f}{c.max():>6.1f}"
              f"{100 * copies.mean():>6.0f}%")
    c = np.array(check)
    print(f"\n--check decodes at {small} px: largest per-hash distance to the {args.size} px hashes: max {c.max()}, "
          f"mean {c.mean():.2f}")

    rand = np.random.default_rng(1).integers(0, np.iinfo(np.int64).max, (20000, HASH_COLUMNS), dtype=np.int64)
    t0 = time.perf_counter()
    near_pairs(rand.astype(np.uint64))
    search_s = time.perf_counter() - t0
    print(f"pair search, 20,000 random photos: {search_s:.2f} s")
    print(json.dumps({"photos": n, "pairs": pairs_total, "threshold": NEAR_THRESHOLD,
                      "colour_threshold": COLOUR_THRESHOLD, "pairs_within": within,
                      "pairs_within_threshold_copies": int((near & (colour <= COLOUR_THRESHOLD)).sum()),
                      "look_alike_pairs": found.look_alike_pairs,
                      "within_threshold_per_pair": within.get(NEAR_THRESHOLD, 0) / max(pairs_total, 1),
                      "closest": closest, "altered": summary, "check_mode_max_distance": int(c.max()),
                      "search_20k_seconds": round(search_s, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
