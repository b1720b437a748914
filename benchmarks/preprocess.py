"""Decode speed and ingest memory: the project's decode path beside the plain Pillow path.

(a) synthetic 4000x3000 phone-photo JPEGs -> 64x64, (b) 256x256 JPEGs -> 64x64: images per second,
one process, plain ``Image.open().convert("RGB").resize((64, 64))`` against ``decode_image(.., 64)``
(EXIF, draft mode, antialiased crop), interleaved round by round so machine noise hits both alike.
(c) the resize filter: BOX against LANCZOS after draft decoding, speed and error against a
full-resolution LANCZOS reference. (d) peak RSS of `leaflens preprocess` on 2,000 and 20,000
small JPEGs (main process and decode workers, measured in a child process). (e) with ``--checks-src``:
what the data checks (duplicates, shortcut check: leaflens.data_prep.data_report) cost of a
`leaflens preprocess` of that folder, measured in the same run (checks_seconds: the main process's
wall time on them plus the workers' time on hashes and metadata divided by the number of workers;
checks_share = checks_seconds / the preprocess's seconds), and the time of `preprocess --check`.

    python benchmarks/preprocess.py [--photos 6] [--rounds 3] [--rss-images 20000] [--quick]
    python benchmarks/preprocess.py --checks-only --checks-src /work/shared/data/ibeans

The last line of output is a JSON object with photo_speedup, photo_img_s, plain_photo_img_s,
small_img_s, peak_rss_mb (and a few more); checks_seconds, checks_share, check_mode_seconds with
``--checks-src``.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import existing_dir, positive_int  # noqa: E402  (benchmarks/ is not a package)

from leaflens.data_prep import decode as dec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def photo_jpeg(seed: int, w: int = 4000, h: int = 3000, exif_rotate: bool = False) -> bytes:
    """A photo-like 4000x3000 JPEG: smooth shading, a leaf-ish blob, fine texture and sensor noise."""
    rng = np.random.default_rng(seed)
    small = rng.random((12, 16, 3)).astype(np.float32)
    base = Image.fromarray((small * 255).astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    base = np.asarray(base, np.float32)
    yy, xx = np.ogrid[0:h, 0:w]
    blob = (((yy - h / 2) / (h * 0.35)) ** 2 + ((xx - w / 2) / (w * 0.3)) ** 2) < 1
    img = base * 0.6 + 0.4 * np.where(blob[..., None], np.array([60, 150, 50], np.float32), 120)
    img += rng.normal(0, 4, (h, w, 1)).astype(np.float32)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    if exif_rotate:
        exif = Image.Exif()
        exif[0x0112] = 6
        im.save(buf, "JPEG", quality=90, exif=exif.tobytes())
    else:
        im.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def small_jpeg(seed: int, size: int = 256) -> bytes:
    from leaflens.data_prep.synth import render

    buf = io.BytesIO()
    arr = render(["healthy", "rust", "aphids"][seed % 3], size, np.random.default_rng(seed))
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def plain(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((64, 64)))


def project(data: bytes) -> np.ndarray:
    return dec.decode_image(data, 64)


def rate(fn, items: list[bytes], repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        for d in items:
            fn(d)
    return repeat * len(items) / (time.perf_counter() - t0)


def interleaved(fns: dict, items: list[bytes], repeat: int, rounds: int) -> dict[str, float]:
    best = {k: 0.0 for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            best[k] = max(best[k], rate(fn, items, repeat))
    return best


def filter_study(photos: list[bytes], smalls: list[bytes]) -> list[tuple[str, str, float, float]]:
    """(input, filter, img/s, mean abs error vs a full-resolution LANCZOS reference)."""
    rows = []
    for label, items in (("4000x3000", photos[:3]), ("256x256", smalls[:40])):
        refs = []
        for d in items:
            im = ImageOps.exif_transpose(Image.open(io.BytesIO(d))).convert("RGB")
            w, h = im.size
            s = min(w, h)
            box = ((w - s) / 2, (h - s) / 2, (w + s) / 2, (h + s) / 2)
            refs.append(np.asarray(im.resize((64, 64), Image.Resampling.LANCZOS, box=box), np.float32))
        for name, flt in (("BOX", Image.Resampling.BOX), ("LANCZOS", Image.Resampling.LANCZOS)):
            saved = dec.RESAMPLE
            dec.RESAMPLE = flt
            try:
                outs = [dec.decode_image(d, 64).astype(np.float32) for d in items]
                speed = rate(project, items, 2 if label == "4000x3000" else 5)
            finally:
                dec.RESAMPLE = saved
            err = float(np.mean([np.abs(o - r).mean() for o, r in zip(outs, refs)]))
            rows.append((label, name, speed, err))
    return rows


RSS_CHILD = r"""
import json, os, sys, threading
from leaflens.data_prep.ingest import IngestOptions, ingest

def hwm(pid):  # VmHWM: peak RSS of that process image (ru_maxrss would carry over a forking parent's peak)
    with open(f"/proc/{pid}/status") as f:
        return [int(line.split()[1]) for line in f if line.startswith("VmHWM:")][0]

def descendants():  # the worker pool forks from a fork server: grandchildren, which RUSAGE_CHILDREN never sees
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [os.getpid()]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out

peak, stop = {}, threading.Event()

def watch():  # each worker's VmHWM, sampled until it ends (a sample late in its life holds its peak)
    while not stop.is_set():
        for pid in descendants():
            try:
                peak[pid] = max(peak.get(pid, 0), hwm(pid))
            except (OSError, IndexError):
                pass
        stop.wait(0.05)

watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
ingest(sys.argv[1], sys.argv[2], IngestOptions(size=64), log=lambda m: None)
stop.set()
watcher.join()
print(json.dumps({"self_mb": hwm("self") / 1024, "workers_mb": max(peak.values(), default=0) / 1024}))
"""


def rss_run(n_images: int, tmp: Path) -> dict:
    """Peak RSS of an ingest of ``n_images`` small JPEGs (96x96, 8 classes), in a fresh process."""
    src = tmp / f"src{n_images}"
    rng = np.random.default_rng(n_images)
    tiles = []
    for _ in range(64):  # distinct small JPEGs, reused with a per-file byte tweak (unique hashes)
        arr = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
        im = Image.fromarray(arr).resize((96, 96), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=85)
        tiles.append(buf.getvalue())
    for i in range(n_images):
        d = src / f"class_{i % 8}"
        if i < 8:
            d.mkdir(parents=True)
        data = tiles[i % len(tiles)]
        # A COM segment with the index keeps files distinct (no duplicate groups) and valid JPEGs.
        tag = f"img{i}".encode()
        data = data[:2] + b"\xff\xfe" + (len(tag) + 2).to_bytes(2, "big") + tag + data[2:]
        (d / f"{i:06d}.jpg").write_bytes(data)
    out = tmp / f"out{n_images}"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", RSS_CHILD, str(src), str(out), str(ROOT)],
                         capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - t0
    info = json.loads(res.stdout.strip().splitlines()[-1])
    info.update(images=n_images, seconds=seconds, img_s=n_images / seconds)
    return info


CHECKS_CHILD = r"""
import json, sys, time
from leaflens.data_prep.ingest import IngestOptions, ingest
r = ingest(sys.argv[1], sys.argv[2], IngestOptions(), force=True, log=lambda m: None)
t0 = time.perf_counter()
c = ingest(sys.argv[1], None, IngestOptions(), check=True, log=lambda m: None)
hwm = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
print(json.dumps({"seconds": r.seconds, "checks_seconds": r.checks_seconds, "checks_share": r.checks_share,
                  "check_mode_seconds": time.perf_counter() - t0, "photos": r.kept_total,
                  "warnings": len(r.data.warnings), "self_mb": hwm / 1024}))
"""


def checks_run(src: Path, tmp: Path) -> dict:
    """A fresh `leaflens preprocess` of ``src`` (stored size 128, all cores) and a `--check`, in a child process;
    exits with the child's last error line when the preprocess fails (not a traceback quoting the child)."""
    res = subprocess.run([sys.executable, "-c", CHECKS_CHILD, str(src), str(tmp / "checks_ds")],
                         capture_output=True, text=True)
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        kind, _, message = why.partition(": ")
        if message and kind.endswith("Error"):  # "leaflens.data_prep.scan.ScanError: ...": the message alone
            why = message
        sys.exit(f"preprocess.py: the preprocess of --checks-src {src} failed: {why}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--photos", type=positive_int, default=6, help="distinct 4000x3000 photos")
    p.add_argument("--smalls", type=positive_int, default=60, help="distinct 256x256 JPEGs")
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (best counts)")
    p.add_argument("--rss-images", type=positive_int, default=20000, help="images for the peak-RSS ingest")
    p.add_argument("--quick", action="store_true", help="fewer images everywhere (a smoke run)")
    p.add_argument("--checks-src", type=existing_dir, default=None,
                   help="folder of photos to time the data checks on (e.g. /work/shared/data/ibeans)")
    p.add_argument("--checks-only", action="store_true", help="only (e): the data checks on --checks-src")
    args = p.parse_args()
    if args.checks_only and args.checks_src is None:
        p.error("--checks-only needs --checks-src")
    checks = None
    if args.checks_src is not None:
        with tempfile.TemporaryDirectory() as td:
            checks = checks_run(args.checks_src, Path(td))
        print(f"data checks on {args.checks_src} ({checks['photos']} photos): {checks['checks_seconds']:.2f} s of a "
              f"{checks['seconds']:.2f} s preprocess ({100 * checks['checks_share']:.1f} %); preprocess --check "
              f"{checks['check_mode_seconds']:.2f} s; main-process peak RSS {checks['self_mb']:.0f} MB")
    if checks is not None and args.checks_only:
        print(json.dumps({"checks_seconds": round(checks["checks_seconds"], 3),
                          "checks_share": round(checks["checks_share"], 4),
                          "check_mode_seconds": round(checks["check_mode_seconds"], 2),
                          "preprocess_seconds": round(checks["seconds"], 2)}))
        return 0
    if args.quick:
        args.photos, args.smalls, args.rounds, args.rss_images = 2, 20, 1, 2000

    photos = [photo_jpeg(i, exif_rotate=(i % 3 == 2)) for i in range(args.photos)]
    smalls = [small_jpeg(i) for i in range(args.smalls)]
    big = interleaved({"plain": plain, "project": project}, photos, 1, args.rounds)
    small = interleaved({"plain": plain, "project": project}, smalls, 3, args.rounds)
    filters = filter_study(photos, smalls)
    with tempfile.TemporaryDirectory() as td:
        rss_small = rss_run(max(args.rss_images // 10, 200), Path(td))
        rss_big = rss_run(args.rss_images, Path(td))

    print(f"{'decode to 64x64, one process':<40}{'plain PIL img/s':>17}{'project img/s':>15}{'speedup':>9}")
    print(f"{'4000x3000 JPEG photos':<40}{big['plain']:>17.1f}{big['project']:>15.1f}"
          f"{big['project'] / big['plain']:>8.1f}x")
    print(f"{'256x256 JPEGs':<40}{small['plain']:>17.1f}{small['project']:>15.1f}"
          f"{small['project'] / small['plain']:>8.1f}x")
    print()
    print(f"{'resize filter (after draft decode)':<40}{'img/s':>10}{'MAE vs full-res LANCZOS':>26}")
    for label, name, speed, err in filters:
        print(f"{label + ' ' + name:<40}{speed:>10.1f}{err:>26.2f}")
    print()
    print(f"{'leaflens preprocess, small JPEGs':<40}{'images':>8}{'img/s':>8}{'main RSS MB':>13}"
          f"{'worker RSS MB':>15}")
    for r in (rss_small, rss_big):
        print(f"{'':<40}{r['images']:>8}{r['img_s']:>8.0f}{r['self_mb']:>13.1f}{r['workers_mb']:>15.1f}")
    print(f"(memory flat: main-process peak grows {rss_big['self_mb'] - rss_small['self_mb']:+.1f} MB from "
          f"{rss_small['images']} to {rss_big['images']} images)")
    result = {
        "photo_speedup": round(big["project"] / big["plain"], 2),
        "photo_img_s": round(big["project"], 2),
        "plain_photo_img_s": round(big["plain"], 2),
        "small_img_s": round(small["project"], 1),
        "plain_small_img_s": round(small["plain"], 1),
        "peak_rss_mb": round(max(rss_big["self_mb"], rss_big["workers_mb"]), 1),
        "peak_rss_main_mb": round(rss_big["self_mb"], 1),
        "peak_rss_main_small_run_mb": round(rss_small["self_mb"], 1),
        "rss_images": rss_big["images"],
        "ingest_img_s": round(rss_big["img_s"], 1),
    }
    if checks is not None:
        result.update(checks_seconds=round(checks["checks_seconds"], 3), checks_share=round(checks["checks_share"], 4),
                      check_mode_seconds=round(checks["check_mode_seconds"], 2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
