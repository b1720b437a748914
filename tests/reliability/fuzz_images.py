"""Seeded mutation fuzzer for the image path: decode_image, the ingest worker and Predictor.predict_image.

Every case is a file derived from a small valid photo (JPEG baseline/progressive/grey/CMYK/EXIF,
PNG RGB/RGBA/palette/16-bit/grey, WebP lossy/lossless/alpha, GIF, BMP, TIFF) by one to three
mutations: truncation, bit flips, overwritten or inserted byte runs, a repeated slice, the header
alone, declared dimensions set to huge or zero values (format-aware, PNG CRC recomputed so the
size itself is what is tested), an empty file, a text file (plain, HTML, JSON, or text behind an
image signature), and a wrong extension. Case ``i`` of seed ``s`` is a pure function of ``(s, i)``,
so any finding is replayed with ``--seed s --start i --cases 1``.

Each case goes through four targets, and every outcome must be either an accepted image of the
right shape or an :class:`~leaflens.data_prep.decode.ImageDecodeError` whose ``reason`` is one of the
documented codes:

- ``decode_bytes``: ``decode_image(data, 32, crop|pad)``;
- ``decode_path``: the same from a file with the case's extension (results must be identical);
- ``ingest``: ``leaflens.data_prep.ingest._decode_task``, the worker `leaflens preprocess` runs per file
  (its catch-all reason ``"error"`` counts as a crash, as do pixels differing from decode_image);
- ``predict``: ``Predictor.predict_image(path)`` on a tiny ONNX model (an escaping exception is a
  crash; an error must name the reason; an answer must hold finite probabilities).

The cases run in a worker subprocess that reports each one as a JSON line; the parent enforces a
per-case time limit (a case over it is a hang: the worker is killed and restarted after that case)
and counts a dead worker as a crash of the case it was running. The worker also reports its peak
RSS. Run it as a script for thousands of cases::

    nice -n 19 .venv/bin/python tests/reliability/fuzz_images.py --cases 5000 --seed 1

(the last line of output is a JSON object with the counts).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from rel_helpers import encode, photo, tiny_model  # noqa: E402

from leaflens.data_prep.quality import REFUSAL_REASONS  # noqa: E402

SIZE = 32  # decode size and model input
KNOWN_REASONS = frozenset({"empty", "truncated", "corrupt", "not_an_image", "too_large", "unsupported_mode",
                           "heic_unsupported", "unreadable"})
TARGETS = ("decode_bytes", "decode_path", "ingest", "predict")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".txt", ".heic", "")


# ---------------------------------------------------------------------------- seed corpus
def seed_corpus() -> list[tuple[str, str, bytes]]:
    """(name, natural extension, bytes) of small valid images in every format/mode the path accepts."""
    base = photo(7, (90, 140, 60), 40, 32)
    exif = Image.Exif()
    exif[0x0112] = 6
    arr16 = (np.asarray(base.convert("L"), np.uint16) * 257).astype(np.uint16)
    pal = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    rgba = base.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(base.size))
    corpus = [
        ("jpeg", ".jpg", encode(base, "JPEG", quality=90)),
        ("jpeg_progressive", ".jpg", encode(base, "JPEG", quality=80, progressive=True)),
        ("jpeg_grey", ".jpg", encode(base.convert("L"), "JPEG")),
        ("jpeg_cmyk", ".jpg", encode(base.convert("CMYK"), "JPEG")),
        ("jpeg_exif", ".jpg", encode(base, "JPEG", exif=exif.tobytes())),
        ("png", ".png", encode(base, "PNG")),
        ("png_rgba", ".png", encode(rgba, "PNG")),
        ("png_palette", ".png", encode(pal, "PNG", transparency=0)),
        ("png_16bit", ".png", encode(Image.fromarray(arr16), "PNG")),
        ("png_grey", ".png", encode(base.convert("L"), "PNG")),
        ("webp_lossy", ".webp", encode(base, "WEBP", quality=80)),
        ("webp_lossless", ".webp", encode(base, "WEBP", lossless=True)),
        ("webp_alpha", ".webp", encode(rgba, "WEBP")),
        ("gif", ".gif", encode(pal, "GIF")),
        ("bmp", ".bmp", encode(base, "BMP")),
        ("tiff", ".tif", encode(base, "TIFF")),
    ]
    return corpus


# ---------------------------------------------------------------------------- mutations
_DIM_VALUES = (0, 1, 30_000, 65_500, 65_535, 16_383, 100_000, 2**31 - 1, 2**32 - 1)


def _dim(rng: np.random.Generator, bits: int) -> int:
    v = int(rng.choice(_DIM_VALUES)) if rng.random() < 0.7 else int(rng.integers(1, 70_000))
    return min(v, (1 << bits) - 1)


def _set_dims(data: bytes, rng: np.random.Generator) -> bytes:
    """Rewrite the declared width/height in the header (format-aware); unchanged if none is found."""
    b = bytearray(data)
    if b[:2] == b"\xff\xd8":  # JPEG: SOFn segment = FF Cn len(2) precision(1) height(2) width(2)
        for i in range(2, len(b) - 9):
            if b[i] == 0xFF and 0xC0 <= b[i + 1] <= 0xCF and b[i + 1] not in (0xC4, 0xC8, 0xCC):
                struct.pack_into(">HH", b, i + 5, _dim(rng, 16), _dim(rng, 16))
                return bytes(b)
    elif b[:8] == b"\x89PNG\r\n\x1a\n":  # PNG IHDR at 8; keep the CRC valid so only the size is wrong
        struct.pack_into(">II", b, 16, _dim(rng, 31), _dim(rng, 31))
        struct.pack_into(">I", b, 29, zlib.crc32(bytes(b[12:29])))
        return bytes(b)
    elif b[:4] == b"RIFF" and b[8:12] == b"WEBP":
        kind = bytes(b[12:16])
        if kind == b"VP8X":  # canvas (width-1, height-1) as 24-bit little endian
            w, h = _dim(rng, 24), _dim(rng, 24)
            b[24:27] = max(w - 1, 0).to_bytes(3, "little")
            b[27:30] = max(h - 1, 0).to_bytes(3, "little")
        elif kind == b"VP8L":  # 0x2f, then 14-bit (width-1) and 14-bit (height-1)
            w, h = _dim(rng, 14), _dim(rng, 14)
            bits = int.from_bytes(b[21:25], "little")
            bits = (bits & ~0xFFFFFFF) | (max(w - 1, 0) & 0x3FFF) | ((max(h - 1, 0) & 0x3FFF) << 14)
            b[21:25] = bits.to_bytes(4, "little")
        elif kind == b"VP8 ":  # frame tag(3), start code(3), 14-bit width, 14-bit height
            struct.pack_into("<HH", b, 26, _dim(rng, 14), _dim(rng, 14))
        return bytes(b)
    elif b[:3] == b"GIF":  # logical screen and first image descriptor
        struct.pack_into("<HH", b, 6, _dim(rng, 16), _dim(rng, 16))
        at = b.find(b"\x2c", 13)
        if at > 0 and at + 9 <= len(b):
            struct.pack_into("<HH", b, at + 5, _dim(rng, 16), _dim(rng, 16))
        return bytes(b)
    elif b[:2] == b"BM":
        struct.pack_into("<ii", b, 18, _dim(rng, 31), _dim(rng, 31) * (1 if rng.random() < 0.7 else -1))
        return bytes(b)
    elif b[:4] in (b"II*\x00", b"MM\x00*"):  # TIFF: ImageWidth (256) / ImageLength (257) in IFD0
        end = "<" if b[:2] == b"II" else ">"
        ifd = struct.unpack_from(end + "I", b, 4)[0]
        if ifd + 2 <= len(b):
            n = struct.unpack_from(end + "H", b, ifd)[0]
            for k in range(n):
                at = ifd + 2 + 12 * k
                if at + 12 > len(b):
                    break
                tag, typ = struct.unpack_from(end + "HH", b, at)
                if tag in (256, 257):
                    if typ == 3:
                        struct.pack_into(end + "H", b, at + 8, _dim(rng, 16))
                    else:
                        struct.pack_into(end + "I", b, at + 8, _dim(rng, 32))
        return bytes(b)
    return data


_TEXTS = (
    b"hello, this is not a photo\n",
    b"<!DOCTYPE html><html><body><img src='leaf.jpg'></body></html>\n",
    b'{"label": "rust", "image": "base64..."}\n',
    "\u53f6\u5b50\u75c5\u5bb3\u7167\u7247 (\u4e0d\u662f\u56fe\u7247)\n".encode(),
    b"a,b,c\n1,2,3\n",
)
_SIGNATURES = (b"\xff\xd8\xff\xe0", b"\x89PNG\r\n\x1a\n", b"RIFF\x00\x00\x00\x00WEBPVP8 ", b"GIF89a", b"BM",
               b"II*\x00", b"\x00\x00\x00\x18ftypheic")


def _text(rng: np.random.Generator) -> bytes:
    body = _TEXTS[int(rng.integers(len(_TEXTS)))] * int(rng.integers(1, 40))
    if rng.random() < 0.4:  # text behind an image signature: passes a magic-number sniff
        body = _SIGNATURES[int(rng.integers(len(_SIGNATURES)))] + body
    return body


def mutate(data: bytes, kind: str, rng: np.random.Generator) -> bytes:
    """Apply one named mutation."""
    n = len(data)
    if kind == "truncate":
        return data[: int(rng.integers(0, max(n, 1)))]
    if kind == "header_only":
        return data[: int(rng.integers(8, 120))]
    if kind == "bitflip":
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 9))):
            if b:
                pos = int(rng.integers(len(b)))
                b[pos] ^= 1 << int(rng.integers(8))
        return bytes(b)
    if kind == "overwrite":
        b = bytearray(data)
        if b:
            pos, run = int(rng.integers(len(b))), int(rng.integers(1, 64))
            fill = rng.choice([0x00, 0xFF, -1])
            chunk = rng.integers(0, 256, run, dtype=np.uint8).tobytes() if fill < 0 else bytes([fill]) * run
            b[pos:pos + run] = chunk[: max(0, len(b) - pos)]
        return bytes(b)
    if kind == "insert":
        pos = int(rng.integers(0, n + 1))
        return data[:pos] + rng.integers(0, 256, int(rng.integers(1, 256)), dtype=np.uint8).tobytes() + data[pos:]
    if kind == "repeat":
        a = int(rng.integers(0, max(n, 1)))
        bb = min(n, a + int(rng.integers(1, 512)))
        return data[:bb] + data[a:bb] * int(rng.integers(1, 20)) + data[bb:]
    if kind == "dims":
        try:
            return _set_dims(data, rng)
        except (struct.error, IndexError, ValueError, OverflowError):  # header already cut short
            return data
    if kind == "empty":
        return b""
    if kind == "text":
        return _text(rng)
    if kind == "garbage":
        return rng.integers(0, 256, int(rng.integers(1, 4096)), dtype=np.uint8).tobytes()
    raise ValueError(f"unknown mutation {kind!r}")


MUTATIONS = ("truncate", "header_only", "bitflip", "overwrite", "insert", "repeat", "dims", "empty", "text",
             "garbage")
_WEIGHTS = np.array([3, 1, 4, 2, 1, 1, 3, 0.3, 0.7, 0.5])


@dataclass
class Case:
    index: int
    base: str
    mutations: tuple[str, ...]
    ext: str
    data: bytes


def make_case(corpus: list[tuple[str, str, bytes]], seed: int, index: int) -> Case:
    """Case ``index`` of ``seed``: a pure function of both (replayable)."""
    rng = np.random.default_rng([seed, index])
    name, ext, data = corpus[int(rng.integers(len(corpus)))]
    if rng.random() < 0.04:  # a few untouched files: the accepted path gets exercised too
        kinds: tuple[str, ...] = ()
    else:
        k = int(rng.choice([1, 1, 1, 2, 2, 3]))
        kinds = tuple(str(x) for x in rng.choice(MUTATIONS, size=k, p=_WEIGHTS / _WEIGHTS.sum()))
    for kind in kinds:
        data = mutate(data, kind, rng)
    if rng.random() < 0.25:  # wrong (or no) extension
        ext = str(rng.choice(EXTENSIONS))
    return Case(index, name, kinds, ext, data)


# ---------------------------------------------------------------------------- worker (child process)
def _outcome_decode(fn) -> tuple[str, np.ndarray | None, str | None]:
    """("ok"|reason|"crash", pixels, crash detail) of one decode call."""
    from leaflens.data_prep.decode import ImageDecodeError

    try:
        out = fn()
    except ImageDecodeError as exc:
        if exc.reason not in KNOWN_REASONS or not exc.detail:
            return "crash", None, f"unknown reason {exc.reason!r} / empty detail: {exc}"
        return exc.reason, None, None
    except Exception as exc:  # noqa: BLE001 - anything else is exactly what the fuzzer hunts
        return "crash", None, f"{type(exc).__name__}: {exc}"
    if not (isinstance(out, np.ndarray) and out.shape == (SIZE, SIZE, 3) and out.dtype == np.uint8):
        return "crash", None, f"bad output {type(out).__name__} {getattr(out, 'shape', None)}"
    return "ok", out, None


def run_case(case: Case, workdir: Path, predictor) -> dict:
    """All four targets on one case; a JSON-able record of outcomes, crash details and times."""
    from leaflens.data_prep.decode import decode_image
    from leaflens.data_prep.ingest import _decode_task

    resize = "pad" if case.index % 3 == 2 else "crop"
    path = workdir / f"case{case.ext}"
    path.write_bytes(case.data)
    rec: dict = {"i": case.index, "base": case.base, "mut": list(case.mutations), "ext": case.ext,
                 "bytes": len(case.data), "out": {}, "ms": {}, "crash": {}}

    def timed(target: str, fn):
        t0 = time.perf_counter()
        r = fn()
        rec["ms"][target] = round((time.perf_counter() - t0) * 1000.0, 3)
        return r

    outcome, px_b, why = timed("decode_bytes", lambda: _outcome_decode(
        lambda: decode_image(case.data, SIZE, resize=resize)))
    rec["out"]["decode_bytes"] = outcome
    if why:
        rec["crash"]["decode_bytes"] = why
    outcome_p, px_p, why = timed("decode_path", lambda: _outcome_decode(
        lambda: decode_image(path, SIZE, resize=resize)))
    rec["out"]["decode_path"] = outcome_p
    if why:
        rec["crash"]["decode_path"] = why
    elif outcome_p != outcome or (px_b is not None and not np.array_equal(px_b, px_p)):
        rec["out"]["decode_path"] = "crash"
        rec["crash"]["decode_path"] = f"differs from bytes decode: {outcome_p} vs {outcome}"

    def ingest():
        try:
            index, digest, pixels, reason, detail = _decode_task((0, str(path), SIZE, resize, 120_000_000))
        except Exception as exc:  # noqa: BLE001
            return "crash", f"{type(exc).__name__}: {exc}"
        if pixels is None:
            if reason not in KNOWN_REASONS:  # "error" is the worker's catch-all for unexpected exceptions
                return "crash", f"reason {reason!r}: {detail}"
            return reason, None
        if px_b is None or not np.array_equal(pixels, px_b) or digest is None:
            return "crash", "ingest pixels differ from decode_image"
        return "ok", None

    outcome_i, why = timed("ingest", ingest)
    rec["out"]["ingest"] = outcome_i
    if why:
        rec["crash"]["ingest"] = why

    def predict():
        try:
            p = predictor.predict_image(path)
        except Exception as exc:  # noqa: BLE001
            return "crash", f"{type(exc).__name__}: {exc}"
        if p.error is not None:
            reason = next((r for r in KNOWN_REASONS | REFUSAL_REASONS if f"({r})" in p.error), None)
            if (p.verdict == "refused") != (reason in REFUSAL_REASONS):
                return "crash", f"verdict {p.verdict!r} does not match the reason in {p.error}"
            if reason is None or str(path) not in p.error:
                return "crash", f"error without a known reason or the file name: {p.error}"
            return reason, None
        probs = [v for _, v in p.top]
        if not p.top or not all(np.isfinite(probs)) or not all(0.0 <= v <= 1.0 for v in probs):
            return "crash", f"bad answer {p.top}"
        return "ok", None

    outcome_m, why = timed("predict", predict)
    rec["out"]["predict"] = outcome_m
    if why:
        rec["crash"]["predict"] = why
    if not rec["crash"]:
        del rec["crash"]
    return rec


def worker_main(seed: int, start: int, stop: int, tmp: Path) -> None:
    """Child process: run cases start..stop-1, one JSON line each (plus a 'begin' line before it).

    ``tmp`` is the parent's folder: a worker killed on a hang cannot clean up after itself.
    """
    import resource

    from leaflens.apps.predictor import Predictor

    corpus = seed_corpus()
    predictor = Predictor(tiny_model(tmp / "tiny.onnx", size=SIZE), intra_op_threads=1)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = sys.stdout
    for i in range(start, stop):
        case = make_case(corpus, seed, i)
        out.write(json.dumps({"begin": i}) + "\n")
        out.flush()
        out.write(json.dumps(run_case(case, tmp, predictor)) + "\n")
        out.flush()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.write(json.dumps({"end": stop, "maxrss_start_mb": rss0 / 1024.0, "maxrss_end_mb": rss1 / 1024.0}) + "\n")
    out.flush()


# ---------------------------------------------------------------------------- parent (watchdog)
@dataclass
class FuzzReport:
    seed: int
    cases: int = 0
    hangs: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)  # worker died (segfault, abort, OOM kill) on this case
    outcomes: dict[str, Counter] = field(default_factory=lambda: {t: Counter() for t in TARGETS})
    crashes: list[dict] = field(default_factory=list)
    max_ms: dict[str, float] = field(default_factory=lambda: {t: 0.0 for t in TARGETS})
    slowest: dict = field(default_factory=dict)
    by_mutation: dict[str, Counter] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    seconds: float = 0.0

    @property
    def crash_count(self) -> int:
        return len(self.crashes) + len(self.dead)

    def add(self, rec: dict) -> None:
        self.cases += 1
        for t in TARGETS:
            self.outcomes[t][rec["out"][t]] += 1
            if rec["ms"][t] > self.max_ms[t]:
                self.max_ms[t] = rec["ms"][t]
                if rec["ms"][t] >= max(self.max_ms.values()):
                    self.slowest = {"i": rec["i"], "target": t, "ms": rec["ms"][t], "base": rec["base"],
                                    "mut": rec["mut"]}
        for kind in rec["mut"] or ["none"]:
            self.by_mutation.setdefault(kind, Counter())["ok" if rec["out"]["decode_bytes"] == "ok" else
                                                          "rejected"] += 1
        if "crash" in rec:
            self.crashes.append(rec)

    def as_dict(self) -> dict:
        def split(c: Counter) -> dict:
            return {"accepted": c.get("ok", 0), "crashes": c.get("crash", 0),
                    "rejected": {k: v for k, v in sorted(c.items()) if k not in ("ok", "crash")}}
        return {"seed": self.seed, "cases": self.cases, "crashes": self.crash_count, "hangs": len(self.hangs),
                "hang_cases": self.hangs, "dead_worker_cases": self.dead,
                "targets": {t: split(c) for t, c in self.outcomes.items()},
                "max_ms": self.max_ms, "slowest": self.slowest,
                "by_mutation": {k: dict(v) for k, v in sorted(self.by_mutation.items())},
                "worker_peak_rss_mb": round(self.peak_rss_mb, 1), "seconds": round(self.seconds, 1),
                "crash_examples": self.crashes[:5]}


def _spawn(seed: int, start: int, stop: int, stderr, tmp: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--seed", str(seed), "--start", str(start),
           "--stop", str(stop), "--tmp", str(tmp)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=REPO)


def _tail(fh) -> str:
    fh.seek(0)
    return fh.read().decode(errors="replace")[-2000:]


def fuzz(cases: int, seed: int = 0, start: int = 0, case_limit_s: float = 10.0,
         startup_limit_s: float = 120.0) -> FuzzReport:
    """Run cases ``start .. start+cases-1`` under the watchdog and return the counts."""
    report = FuzzReport(seed)
    t0 = time.perf_counter()
    nxt, stop = start, start + cases
    while nxt < stop:
        errlog = tempfile.TemporaryFile()
        tmp = tempfile.mkdtemp(prefix="leaflens-fuzz-")
        proc = _spawn(seed, nxt, stop, errlog, Path(tmp))
        fd = proc.stdout.fileno()
        buf = b""
        current: int | None = None
        deadline = time.monotonic() + startup_limit_s
        finished = False
        try:
            while True:
                wait = deadline - time.monotonic()
                ready = select.select([fd], [], [], max(wait, 0.0))[0] if wait > 0 else []
                if not ready:  # over the time limit: a hang of the current case (or of start-up)
                    if current is None:
                        raise RuntimeError(f"fuzz worker (from case {nxt}) did not start within "
                                           f"{startup_limit_s} s: {_tail(errlog)}")
                    report.hangs.append(current)
                    nxt = current + 1
                    break
                chunk = os.read(fd, 1 << 16)
                if not chunk:  # worker died
                    if current is not None:
                        report.dead.append(current)
                        nxt = current + 1
                    else:
                        raise RuntimeError(f"fuzz worker (from case {nxt}) exited outside a case: {_tail(errlog)}")
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "begin" in msg:
                        current = msg["begin"]
                        deadline = time.monotonic() + case_limit_s
                    elif "end" in msg:
                        report.peak_rss_mb = max(report.peak_rss_mb, msg["maxrss_end_mb"])
                        finished = True
                    else:
                        report.add(msg)
                        current = None
                if finished:
                    nxt = stop
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
            errlog.close()
            shutil.rmtree(tmp, ignore_errors=True)
    report.cases += len(report.hangs) + len(report.dead)
    report.seconds = time.perf_counter() - t0
    return report


def format_report(rep: dict) -> str:
    lines = [f"fuzz seed {rep['seed']}: {rep['cases']} cases in {rep['seconds']} s, {rep['crashes']} crashes, "
             f"{rep['hangs']} hangs, worker peak RSS {rep['worker_peak_rss_mb']} MB"]
    lines.append(f"{'target':<13} {'accepted':>8} {'crashes':>7} {'max ms':>8}  rejected by reason")
    for t, r in rep["targets"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in r["rejected"].items())
        lines.append(f"{t:<13} {r['accepted']:>8} {r['crashes']:>7} {rep['max_ms'][t]:>8.1f}  {reasons}")
    per = [f"{k} {v.get('ok', 0)}/{v.get('ok', 0) + v.get('rejected', 0)}" for k, v in rep["by_mutation"].items()]
    lines.append("decode_bytes accepted per mutation: " + ", ".join(per))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Seeded mutation fuzzer of the leaflens image path.")
    ap.add_argument("--cases", type=int, default=2000, help="number of cases (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    ap.add_argument("--start", type=int, default=0, help="first case index (replay one case with --cases 1)")
    ap.add_argument("--case-limit", type=float, default=10.0, help="seconds a case may take (default 10)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stop", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.seed, args.start, args.stop, args.tmp)
        return 0
    rep = fuzz(args.cases, args.seed, args.start, args.case_limit).as_dict()
    print(format_report(rep))
    for c in rep["crash_examples"]:
        print("crash:", json.dumps(c))
    print(json.dumps(rep))
    return 1 if rep["crashes"] or rep["hangs"] else 0


if __name__ == "__main__":
    sys.exit(main())
