"""The near-duplicate threshold, measured (leaflens.data_prep.near_dup).

For a folder of photos (any layout; every image file under it): (a) the hash distance of every pair of
different files: how many pairs fall within each threshold (false matches, unless a pair really is the
same picture: the closest ones are listed to look at); (b) for a sample of photos, the distance to
their own altered copies: resized, re-encoded, saved as PNG, brightened, centre-cropped 1-10 % per side,
cropped on one side, cropped + resized + re-encoded; (c) the distance between the hashes of the stored
pixels and those `leaflens preprocess --check` computes from its smaller decode; (d) the pair search's
time on 20,000 random hashes.

    python benchmarks/near_duplicates.py /work/shared/data/ibeans [--size 128] [--sample 150]

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
from PIL import Image

from leaflens.data_prep.contract import decode_stored
from leaflens.data_prep.ingest import check_size
from leaflens.data_prep.near_dup import HASH_CROPS, NEAR_THRESHOLD, hamming, near_pairs, photo_hashes
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
    "crop 4 %, x0.65, quality 50": lambda im: _jpeg(_crop(im, 4).resize((round(im.width * 0.65),
                                                                          round(im.height * 0.65))), 50),
}


def pair_distance(a: np.ndarray, b: np.ndarray) -> int:
    """The distance near_pairs uses, for one pair of (len(HASH_CROPS),) hash rows."""
    return int(min(hamming(a[0], b).min(), hamming(b[0], a).min()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="folder of photos")
    p.add_argument("--size", type=int, default=128, help="stored size the hashes are taken at (default 128)")
    p.add_argument("--sample", type=int, default=150, help="photos altered in (b) and (c)")
    p.add_argument("--closest", type=int, default=6, help="closest different-photo pairs to list")
    args = p.parse_args()

    files = sorted(f for f in args.src.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file())
    datas = [f.read_bytes() for f in files]
    hashes = np.stack([photo_hashes(decode_stored(d, args.size, "crop")) for d in datas])
    n = len(files)
    i, j, d = near_pairs(hashes, threshold=16)
    pairs_total = n * (n - 1) // 2
    within = {t: int((d <= t).sum()) for t in range(0, 17, 2)}
    print(f"{n} photos, {pairs_total:,} pairs of different photos; pairs within t bits: {within}")
    order = np.argsort(d, kind="stable")[: args.closest]
    closest = [(str(files[i[k]].relative_to(args.src)), str(files[j[k]].relative_to(args.src)), int(d[k]))
               for k in order]
    for a, b, dist in closest:
        print(f"  {dist:2d} bits: {a}  {b}")

    rng = np.random.default_rng(0)
    sample = rng.choice(n, min(args.sample, n), replace=False)
    altered: dict[str, list[int]] = {name: [] for name in ALTERATIONS}
    check: list[int] = []
    small = check_size(args.size)
    for k in sample:
        im = Image.open(io.BytesIO(datas[k])).convert("RGB")
        for name, alter in ALTERATIONS.items():
            altered[name].append(pair_distance(hashes[k], photo_hashes(decode_stored(alter(im), args.size, "crop"))))
        check.append(int(hamming(hashes[k], photo_hashes(decode_stored(datas[k], small, "crop"))).max()))
    print(f"\n{'altered copy (' + str(len(sample)) + ' photos)':<34}{'max':>5}{'p95':>6}{'mean':>6}"
          f"{'within ' + str(NEAR_THRESHOLD):>10}")
    summary = {}
    for name, dists in altered.items():
        a = np.array(dists)
        summary[name] = {"max": int(a.max()), "mean": round(float(a.mean()), 2),
                         "matched": round(float((a <= NEAR_THRESHOLD).mean()), 3)}
        print(f"{name:<34}{a.max():>5}{np.percentile(a, 95):>6.1f}{a.mean():>6.2f}"
              f"{100 * (a <= NEAR_THRESHOLD).mean():>9.0f}%")
    c = np.array(check)
    print(f"\n--check decodes at {small} px: largest per-hash distance to the {args.size} px hashes: max {c.max()}, "
          f"mean {c.mean():.2f}")

    rand = np.random.default_rng(1).integers(0, np.iinfo(np.int64).max, (20000, len(HASH_CROPS)), dtype=np.int64)
    t0 = time.perf_counter()
    near_pairs(rand.astype(np.uint64))
    search_s = time.perf_counter() - t0
    print(f"pair search, 20,000 random photos: {search_s:.2f} s")
    print(json.dumps({"photos": n, "pairs": pairs_total, "threshold": NEAR_THRESHOLD,
                      "pairs_within": within,
                      "within_threshold_per_pair": within.get(NEAR_THRESHOLD, 0) / max(pairs_total, 1),
                      "closest": closest, "altered": summary, "check_mode_max_distance": int(c.max()),
                      "search_20k_seconds": round(search_s, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
