"""Fuzzing the image path (decode, ingest, Predictor) and decompression bombs.

The default run feeds a few hundred seeded mutated files through all four targets (see
fuzz_images.py); the ``slow`` run feeds thousands. Zero crashes and zero hangs are required, and
every rejection must carry one of the documented reasons.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
import textwrap
import zlib

import numpy as np
import pytest
from fuzz_images import KNOWN_REASONS, TARGETS, fuzz, make_case, seed_corpus
from rel_helpers import REPO, class_folders

from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import REJECTED_NAME, load_dataset
from leaflens.data_prep.quality import REFUSAL_REASONS


def _check(rep: dict, cases: int) -> None:
    assert rep["cases"] == cases
    assert rep["hangs"] == 0, f"hangs on cases {rep['hang_cases']} (replay: --seed {rep['seed']} --start N --cases 1)"
    assert rep["crashes"] == 0, json.dumps(rep["crash_examples"], indent=1)[:4000]
    for t in TARGETS:
        r = rep["targets"][t]
        assert r["accepted"] + sum(r["rejected"].values()) == cases, t
        # the Predictor also refuses readable photos too small, uniform or flat to judge (before the model)
        allowed = KNOWN_REASONS | REFUSAL_REASONS if t == "predict" else KNOWN_REASONS
        assert set(r["rejected"]) <= allowed, r["rejected"]
    # the mutations do reach both sides: real photos get through, and several kinds of damage are named
    assert rep["targets"]["decode_bytes"]["accepted"] >= cases // 10
    assert {"corrupt", "not_an_image", "too_large", "truncated", "empty"} <= set(rep["targets"]["decode_bytes"]
                                                                                  ["rejected"])


def test_fuzz_a_few_hundred_mutated_files_no_crash_no_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the workers' folders go
    rep = fuzz(300, seed=0, case_limit_s=10.0).as_dict()
    _check(rep, 300)
    assert max(rep["max_ms"].values()) < 10_000
    assert list(tmp_path.iterdir()) == []  # the cases' files are gone with the worker


@pytest.mark.slow
def test_fuzz_thousands_of_mutated_files_no_crash_no_hang():
    rep = fuzz(3000, seed=1, case_limit_s=10.0).as_dict()
    _check(rep, 3000)


def test_watchdog_counts_a_hang_and_a_dead_worker(monkeypatch):
    """The fuzzer's own alarm works: a case that sleeps is a hang, a worker that dies is a crash; the
    folder each worker was given is removed although neither worker could clean up."""
    import fuzz_images

    real_spawn = fuzz_images._spawn
    folders = []

    def spawn(seed, start, stop, stderr, tmp):
        folders.append(tmp)
        code = ("import json,os,sys,time\n"
                f"s={start}\n"
                f"open(os.path.join({str(tmp)!r}, 'case'), 'w').close()\n"
                "print(json.dumps({'begin': s}), flush=True)\n"
                "time.sleep(30) if s == 0 else os._exit(9)\n")
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr)

    monkeypatch.setattr(fuzz_images, "_spawn", spawn)
    rep = fuzz_images.fuzz(2, seed=0, case_limit_s=1.0)
    monkeypatch.setattr(fuzz_images, "_spawn", real_spawn)
    assert rep.hangs == [0] and rep.dead == [1] and rep.crash_count == 1
    assert len(folders) == 2 and not any(f.exists() for f in folders)


def test_cases_are_replayable():
    corpus = seed_corpus()
    a, b = make_case(corpus, 3, 17), make_case(corpus, 3, 17)
    assert a.data == b.data and a.mutations == b.mutations and a.ext == b.ext
    assert make_case(corpus, 3, 18).data != a.data or make_case(corpus, 4, 17).data != a.data


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the damaged EXIF/TIFF it reads
def test_ingest_of_a_folder_full_of_damaged_files(tmp_path):
    """A real `preprocess` over photos mixed with 120 fuzz cases: it finishes, every file is kept or
    rejected with a known reason, and the dataset it writes is valid."""
    src = class_folders(tmp_path / "photos", per_class=10)
    corpus = seed_corpus()
    image_exts = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".heic", ".heif"}
    damaged = 0
    for i in range(120):
        case = make_case(corpus, 5, i)
        cls = ("blight", "healthy", "rust")[i % 3]
        (src / cls / f"fuzz_{i:03d}{case.ext}").write_bytes(case.data)
        damaged += case.ext.lower() in image_exts
    total = 30 + damaged
    report = ingest(src, tmp_path / "ds", IngestOptions(size=16), workers=1, log=lambda *_: None)
    assert report.kept_total + report.rejected_total == total
    assert report.rejected_total > 0 and set(report.rejected_reasons) <= KNOWN_REASONS, report.rejected_reasons
    assert report.ignored.get("not_image", 0) == 120 - damaged
    ds = load_dataset(tmp_path / "ds", verify=True)
    rows = [json.loads(line) for line in (ds.root / REJECTED_NAME).read_text().splitlines()]
    assert len(rows) == report.rejected_total and all(r["reason"] in KNOWN_REASONS and r["detail"] for r in rows)
    assert sum(len(ds[s]) for s in ds.splits) == report.kept_total
    assert all(r["path"].split("/")[-1].startswith("fuzz_") for r in rows)  # the 30 real photos all kept


# ---------------------------------------------------------------------------- decompression bombs
def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_zero_bomb(w: int, h: int) -> bytes:
    """A real PNG of w x h black RGB pixels: a few MB of file, w*h*3 bytes once decoded."""
    co = zlib.compressobj(1)
    rows = b"\0" * ((w * 3 + 1) * 100)
    idat = b"".join(co.compress(rows) for _ in range(h // 100)) + co.compress(b"\0" * ((w * 3 + 1) * (h % 100)))
    idat += co.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", idat) + _chunk(b"IEND", b""))


def _header_bombs() -> dict[str, bytes]:
    """Small valid files whose headers were edited to declare a huge canvas (format-aware): 11500 x 11500
    (132 MP: above leaflens's limit, below Pillow's own) and the format's maximum."""
    from fuzz_images import _set_dims

    class Fixed:  # an rng stand-in whose every choice is the given dimension
        def __init__(self, v):
            self.v = v

        def choice(self, _):
            return self.v

        def random(self):
            return 0.0

        def integers(self, a, b=None):
            return self.v

    bombs = {}
    for name, _, data in seed_corpus():
        if name in ("jpeg", "png", "webp_lossless", "webp_lossy", "gif", "bmp", "tiff"):
            for v in (11_500, 16_383 if name.startswith("webp") else 65_500):
                bombs[f"{name}_{v}x{v}"] = _set_dims(data, Fixed(v))
    return bombs


BOMB_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from leaflens.data_prep.decode import ImageDecodeError, decode_image
    def rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    ok = decode_image(Path(sys.argv[2]).read_bytes(), 64)  # warm: a normal photo, allocator primed
    before, out = rss(), {}
    for p in sorted(Path(sys.argv[3]).iterdir()):
        data = p.read_bytes()
        t0 = time.perf_counter()
        try:
            decode_image(data, 64)
            res = "accepted"
        except ImageDecodeError as exc:
            res = exc.reason
        out[p.name] = {"result": res, "ms": (time.perf_counter() - t0) * 1000, "bytes": len(data)}
    print(json.dumps({"before_mb": before, "after_mb": rss(), "files": out}))
""")


def test_decompression_bombs_refused_before_allocation(tmp_path):
    """Every bomb is refused as too_large within milliseconds and the process's peak RSS barely moves.

    The 11000x11000 PNG is a real bomb (1.6 MB that decodes to 363 MB): above leaflens's 120 MP
    limit but below Pillow's own hard limit (179 MP), so it is leaflens's check that stops it.
    """
    bombs = tmp_path / "bombs"
    bombs.mkdir()
    (bombs / "png_real_11000x11000.png").write_bytes(png_zero_bomb(11_000, 11_000))
    for name, data in _header_bombs().items():
        (bombs / name).write_bytes(data)
    normal = tmp_path / "normal.jpg"
    normal.write_bytes(seed_corpus()[0][2])
    res = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, str(REPO), str(normal), str(bombs)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    results = {k: v["result"] for k, v in rep["files"].items()}
    assert len(results) == 15
    assert all(r == "too_large" for r in results.values()), results
    assert max(v["ms"] for v in rep["files"].values()) < 500
    growth = rep["after_mb"] - rep["before_mb"]
    assert growth < 32, f"peak RSS grew by {growth:.0f} MB while refusing bombs: {rep}"


def test_png_bomb_is_a_real_bomb():
    """The bomb above is honest: under a limit it passes, it really decodes to that many pixels."""
    from leaflens.data_prep.decode import decode_image

    data = png_zero_bomb(1000, 700)
    out = decode_image(data, 16, max_pixels=1000 * 700)
    assert out.shape == (16, 16, 3) and not out.any()
    from leaflens.data_prep.decode import ImageDecodeError

    with pytest.raises(ImageDecodeError) as exc:
        decode_image(data, 16, max_pixels=1000 * 700 - 1)
    assert exc.value.reason == "too_large"
    assert np.prod((1000, 700)) * 3 > 100 * len(data)  # compression ratio of a bomb


def test_png_declaring_more_pixels_than_deflate_can_hold_is_refused_at_once():
    """Found by the fuzzer (seed 2, case 7932): a 2 KB 16-bit PNG declaring 15705 x 7079 pixels decoded
    to a mostly black image after seconds of work and about 1 GB of memory. Deflate cannot compress
    beyond 1032:1, so such a file is refused from its header; a solid-colour PNG at the best ratio
    deflate reaches still passes."""
    import io
    import time

    from PIL import Image

    from leaflens.data_prep.decode import ImageDecodeError, decode_image

    case = make_case(seed_corpus(), 2, 7932)
    t0 = time.perf_counter()
    with pytest.raises(ImageDecodeError) as exc:
        decode_image(case.data, 32)
    assert exc.value.reason == "truncated" and "1032:1" in exc.value.detail
    assert time.perf_counter() - t0 < 0.1
    for mode in ("RGB", "L", "1"):
        buf = io.BytesIO()
        Image.new(mode, (4000, 3000), 0).save(buf, "PNG", optimize=True)
        assert decode_image(buf.getvalue(), 16).shape == (16, 16, 3)
