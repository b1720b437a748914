"""Folder of photos -> dataset folder of memory-mapped arrays (what `leaflens preprocess` runs).

Steps: scan the source (:mod:`leaflens.data_prep.scan`), decode every photo in a process pool with the
preprocessing contract's decode step (:mod:`leaflens.data_prep.contract`) and stream the pixels into a
staging file (the workers also hash each photo's pixels and note its format, size and EXIF for the data
checks), group exact and near copies (:mod:`leaflens.data_prep.near_dup`), assign splits (stratified,
seeded, keeping each group of copies in one split: :mod:`leaflens.data_prep.split`), run the data checks
and log their report (:mod:`leaflens.data_prep.data_report`; ``--dedupe`` removes copies there), stream
the staging rows into ``<split>_images.npy`` / ``<split>_labels.npy`` / ``<split>_files.txt``, compute
mean/std on train from exact per-channel histograms, write ``rejected.jsonl``, ``data_report.json`` and
``manifest.json``, and rename the finished temporary folder into place. A broken file is rejected with its
reason and never stops the run; an interrupted run leaves the previous output untouched; an unchanged
input re-run does no work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from leaflens.columns import display_width, pad_right
from leaflens.cpus import usable_cpus, worker_pool
from leaflens.data_prep import decode
from leaflens.data_prep.arrays import NpyRowWriter, sha256_file
from leaflens.data_prep.contract import decode_stored
from leaflens.data_prep.data_report import DATA_REPORT_NAME, CheckedPhotos, DataReport, format_data_report, run_checks
from leaflens.data_prep.decode import ImageDecodeError, read_source
from leaflens.data_prep.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    REJECTED_NAME,
    DatasetError,
    DuplicatesInfo,
    IngestOptions,
    Manifest,
    RejectedInfo,
    SplitInfo,
    load_dataset,
    split_paths,
)
from leaflens.data_prep.near_dup import (
    COLOUR_GRID,
    HASH_COLUMNS,
    HASH_CROPS,
    NearGroup,
    colour_signatures,
    find_copies,
    photo_hashes,
)
from leaflens.data_prep.quality import served_refusal
from leaflens.data_prep.scan import NOT_A_LEAF, SPLITS, UNLABELED, ScanResult, SourceFile, relative_to, scan_source
from leaflens.data_prep.shortcut import PhotoMeta, photo_meta
from leaflens.data_prep.split import MIN_PER_CLASS, assign_auto, resolve_given
from leaflens.files import (
    NotOurFolderError,
    check_replaceable,
    clean_stale_temps,
    new_temp_dir,
    swap_into_place,
    write_json_atomic,
)

_STAGING = "staging.bin"
MAX_SIZE = 2048  # stored side in pixels: students train at 64-128 from photos stored at up to twice that
CLASS_INFO_NAME = "classes.toml"  # optional per-class display names/advice next to the photos
_CHUNK_ROWS = 256
CHECK_SIZE = 64  # --check decodes at most at this size (see check_size)


class IngestError(RuntimeError):
    """The ingest cannot produce a dataset (bad source, nothing kept, unsafe output folder)."""


@dataclass
class IngestReport:
    """What a run did, for the CLI summary and for tests."""

    out: Path  # the dataset folder (with --check, the source folder: nothing is written)
    up_to_date: bool
    classes: list[str]
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # split -> class -> kept
    rejected: dict[str, int] = field(default_factory=dict)  # class (or "unlabeled") -> rejected
    rejected_reasons: dict[str, int] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    not_image_extensions: dict[str, int] = field(default_factory=dict)  # of ignored["not_image"]
    # reason -> the first few files ignored for it (links to nothing, loops, names not in UTF-8, loose files)
    ignored_examples: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0
    data: DataReport | None = None  # the data checks' report
    checks_seconds: float = 0.0  # what the checks cost of ``seconds`` (see DataReport.seconds)

    @property
    def checks_share(self) -> float:
        """The checks' share of the run's time."""
        return self.checks_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def kept_total(self) -> int:
        return sum(sum(v.values()) for v in self.counts.values())

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


# ---------------------------------------------------------------------------- decoding workers
def _read_and_decode(path: str, size: int, resize: str, max_pixels: int, header: dict | None = None
                     ) -> tuple[bytes | None, np.ndarray | None, str | None, str | None]:
    """(sha256, pixels, reason, detail) of one file; a failure gives a reason, never raises. ``header``
    receives the decoder's reading of the file's header (see decode_image)."""
    try:
        data = read_source(path)
        digest = hashlib.sha256(data).digest()
        try:  # the contract's step 1, as the Predictor's
            pixels = decode_stored(data, size, resize, max_pixels, header=header)
        except ImageDecodeError as exc:
            return digest, None, exc.reason, exc.detail
        return digest, pixels, None, None
    except ImageDecodeError as exc:
        return None, None, exc.reason, exc.detail
    except Exception as exc:  # one odd file must never stop the run
        return None, None, "error", f"{type(exc).__name__}: {exc}"


def _decode_task(task: tuple[int, str, int, str, int]) -> tuple[int, bytes | None, np.ndarray | None,
                                                                str | None, str | None]:
    """Worker: (index, path, size, resize, max_pixels) -> (index, sha256, pixels, reason, detail)."""
    index, path, size, resize, max_pixels = task
    return (index, *_read_and_decode(path, size, resize, max_pixels))


def _checked_task(task: tuple[int, str, int, str, int, bool]) -> tuple[
        int, bytes | None, np.ndarray | None, str | None, str | None, tuple[np.ndarray, np.ndarray, str | None] | None,
        PhotoMeta | None, float]:
    """Worker of preprocess and --check: :func:`_decode_task` plus the data checks' share of the work on a
    kept photo: its perceptual hashes and colour signatures (from the decoded pixels) and metadata (from the
    header the decoder read).

    Returns (index, sha256, pixels or None when ``keep_pixels`` is false, reason, detail, (hashes, colours,
    why the app would refuse it or None), metadata, seconds spent on the checks: everything with --check, the
    hashes and metadata otherwise)."""
    index, path, size, resize, max_pixels, keep_pixels = task
    t0 = time.perf_counter()
    header: dict = {}
    digest, pixels, reason, detail = _read_and_decode(path, size, resize, max_pixels, header)
    t1 = time.perf_counter()
    hashes = meta = None
    if pixels is not None:
        meta = photo_meta(header, path)
        hashes = (photo_hashes(pixels), colour_signatures(pixels), served_refusal(pixels, meta.width, meta.height))
    seconds = time.perf_counter() - (t0 if not keep_pixels else t1)
    return index, digest, pixels if keep_pixels else None, reason, detail, hashes, meta, seconds


@dataclass
class _Decoded:
    """What the decode pass gives: kept source indices, their sha256, hashes, colour signatures and
    metadata, the rejects."""

    kept: list[int]
    digests: list[bytes]
    hashes: np.ndarray  # (len(kept), HASH_COLUMNS) uint64
    colours: np.ndarray  # (len(kept), len(HASH_CROPS), COLOUR_GRID**2 * 3) uint8
    metas: list[PhotoMeta]
    rejects: list[dict]
    worker_check_seconds: float
    refusals: list[str | None]  # per kept source: why a served model would refuse it (None: it judges it)


def _decode_all(files: list[SourceFile], opts: IngestOptions, staging: Path | None, workers: int,
                progress: bool, decode_size: int | None = None) -> _Decoded:
    """Decode every file, streaming kept pixels into ``staging`` (None: --check, nothing is kept but the
    hashes and metadata; ``decode_size`` then replaces the stored size)."""
    from tqdm import tqdm

    total = len(files)
    kept: list[int] = []
    digests: list[bytes] = []
    hashes: list[np.ndarray] = []
    colours: list[np.ndarray] = []
    metas: list[PhotoMeta] = []
    refusals: list[str | None] = []
    rejects: list[dict] = []
    check_seconds = 0.0
    size = decode_size or opts.size
    keep_pixels = staging is not None
    bar = tqdm(total=total, desc="decode" if keep_pixels else "check", unit="img", disable=not progress,
               file=sys.stderr)
    try:
        parallel = workers > 1 and total > 1
        window = max(64, workers * 128)  # bounded in-flight results: memory stays flat
        chunksize = max(1, min(32, total // (workers * 8) or 1))
        with (worker_pool(workers) if parallel else contextlib.nullcontext() as pool,
              open(staging, "wb") if staging is not None else contextlib.nullcontext() as out):
            for start in range(0, total, window):
                block = []
                for i in range(start, min(total, start + window)):
                    f = files[i]
                    if "\n" in f.rel or "\r" in f.rel:  # <split>_files.txt: one name per line, later rows would shift
                        rejects.append({"path": f.rel, "label": f.label, "split": f.split, "reason": "bad_name",
                                        "detail": "its name holds a line break, which the dataset's file lists (one "
                                                  "photo per line) cannot record; rename it"})
                        bar.update(1)
                        continue
                    block.append((i, f.path, size, opts.resize, opts.max_pixels, keep_pixels))
                results = pool.map(_checked_task, block, chunksize=chunksize) if pool else map(_checked_task, block)
                for index, digest, pixels, reason, detail, hash_row, meta, seconds in results:
                    check_seconds += seconds
                    if hash_row is None or meta is None or digest is None:  # kept photos come with all three
                        f = files[index]
                        rejects.append({"path": f.rel, "label": f.label, "split": f.split,
                                        "reason": reason, "detail": detail})
                    else:
                        if out is not None and pixels is not None:
                            out.write(pixels.tobytes())
                        kept.append(index)
                        digests.append(digest)
                        hashes.append(hash_row[0])
                        colours.append(hash_row[1])
                        refusals.append(hash_row[2])
                        metas.append(meta)
                    bar.update(1)
    finally:
        bar.close()
    hash_array = np.stack(hashes) if hashes else np.zeros((0, HASH_COLUMNS), np.uint64)
    colour_array = (np.stack(colours) if colours else
                    np.zeros((0, len(HASH_CROPS), COLOUR_GRID * COLOUR_GRID * 3), np.uint8))
    return _Decoded(kept, digests, hash_array, colour_array, metas, rejects, check_seconds, refusals)


# ---------------------------------------------------------------------------- splitting
def _assign(scan: ScanResult, kept: list[int], digests: list[bytes], units: list[Hashable], opts: IngestOptions,
            rejects: list[dict], source_units: list[Hashable] | None = None) -> list[str | None]:
    """Split name per kept row (None: dropped as a cross-split duplicate, added to ``rejects``).

    ``units``: per kept row, the key of the duplicate group it belongs to (exact or near copies); the
    automatic split places each group as one unit, so no copy lands in another split. ``source_units``: the
    same grouping made of the source's photos alone (default ``units``), which the source is split by. With
    given splits, byte-identical copies of the same class in a later split are dropped; copies under another
    class are kept for the data report to show as label conflicts (dropping one would silently pick the label).

    Photos of extra folders (``--also``: corrections) never move the source's photos: the source is split
    exactly as without them; an extra photo in a group with source photos joins their split, any other one
    gets a split from its own bytes (:func:`_extra_split`), so photos added later move no earlier one either.
    An extra photo whose bytes and class a source photo already has is the same labelled photo twice: the
    extra copy is left out (with given splits it would have pushed the source's val or test copy out).
    """
    files = scan.files
    out: list[str | None] = [None] * len(kept)
    lab_rows = [r for r, i in enumerate(kept) if files[i].label >= 0]
    for r, i in enumerate(kept):
        if files[i].label < 0:
            out[r] = UNLABELED
    source_rows = [r for r in lab_rows if not files[kept[r]].extra]
    extra_rows = [r for r in lab_rows if files[kept[r]].extra]
    if extra_rows:
        in_source = {(digests[r], files[kept[r]].label): files[kept[r]] for r in source_rows}
        keep_extra = []
        for r in extra_rows:
            f = files[kept[r]]
            twin = in_source.get((digests[r], f.label))
            if twin is None:
                keep_extra.append(r)
                continue
            rejects.append({"path": f.rel, "label": f.label, "split": f.split, "reason": "duplicate_of_source",
                            "detail": f"same bytes and class as {twin.rel}, kept where the source has it"})
        extra_rows = keep_extra
        # An unlabelled photo someone labelled (in the web app) is now the extra photo: its unlabelled copy is
        # left out, or the teacher and students would train on a photo that val or test then scores.
        labelled_by = {digests[r]: files[kept[r]] for r in extra_rows}
        for r, i in enumerate(kept):
            if files[i].label < 0 and digests[r] in labelled_by:
                out[r] = None
                rejects.append({"path": files[i].rel, "label": -1, "split": files[i].split,
                                "reason": "labelled_by_correction",
                                "detail": f"the --also photo {labelled_by[digests[r]].rel} (same bytes) gives it a "
                                          "label, so it is no longer an unlabelled photo"})
    if scan.layout == "split_folders":
        rows = source_rows + extra_rows
        given = [_given_split(files[kept[r]]) for r in rows]
        drop = set(resolve_given(given, [(digests[r], files[kept[r]].label) for r in rows]))
        for k, r in enumerate(rows):
            if k in drop:
                f = files[kept[r]]
                rejects.append({"path": f.rel, "label": f.label, "split": f.split,
                                "reason": "duplicate_across_splits",
                                "detail": "same bytes as a file in an earlier split"})
            else:
                out[r] = given[k]
        return out
    labels = [files[kept[r]].label for r in source_rows]
    own = source_units if source_units is not None else units
    unit_split: dict[Hashable, str] = {}
    for r, s in zip(source_rows, assign_auto(labels, [own[r] for r in source_rows], opts.ratios, opts.seed)):
        out[r] = s
        unit_split.setdefault(units[r], s)  # an extra photo in a group with source photos: their first's split
    first_digest: dict[Hashable, bytes] = {}  # the smallest digest of a group's extra photos: its split's key
    for r in extra_rows:
        first_digest[units[r]] = min(first_digest.get(units[r], digests[r]), digests[r])
    for r in extra_rows:
        out[r] = unit_split.get(units[r]) or _extra_split(first_digest[units[r]], opts.ratios, opts.seed)
    return out


def _extra_split(digest: bytes, ratios: tuple[float, float, float], seed: int) -> str:
    """The split of an extra photo (a correction) from its bytes' digest and the seed alone: in the shares
    ``ratios`` on average, and the same whatever else is added or removed."""
    u = int.from_bytes(hashlib.sha256(b"leaflens-extra-split\0" + str(seed).encode() + b"\0" + digest).digest()[:8],
                       "big") / 2.0**64
    return "train" if u < ratios[0] else "val" if u < ratios[0] + ratios[1] else "test"


def _check_class_sizes(scan: ScanResult, kept: list[int], assigned: list[str | None], strict: bool,
                       log: Callable[[str], None]) -> None:
    """Warn about (or with ``strict`` refuse) classes too small to have a photo in every split."""
    counts = dict.fromkeys(scan.classes, 0)
    for i, split in zip(kept, assigned):
        if split is not None and split != UNLABELED:
            counts[scan.classes[scan.files[i].label]] += 1
    none = sorted(c for c, n in counts.items() if n == 0)
    if none:  # the model would have an output for a class it never saw
        raise IngestError(f"{scan.root}: no usable photo in {', '.join(repr(c) for c in none)} (every file there was "
                          "rejected: see the list above); add photos the class folder can use, or "
                          "move the folder out of the source")
    small = {c: n for c, n in counts.items() if n < MIN_PER_CLASS}
    if not small:
        return
    listed = ", ".join(f"{c!r} ({n} photo{'' if n == 1 else 's'})" for c, n in sorted(small.items()))
    advice = (f"with fewer than {MIN_PER_CLASS} usable photos a class cannot have one in train, val and test, "
              "so the report cannot say how the model does on it; add photos or leave the class out")
    if strict:
        raise IngestError(f"{scan.root}: too few photos in {listed}: {advice} (refused because of --strict)")
    log(f"warning: too few photos in {listed}: {advice}")


def _given_split(f: SourceFile) -> str:
    """The split folder ``f`` was found in (every file has one in the split-folder layout)."""
    if f.split is None:
        raise IngestError(f"internal error: {f.rel} has no split folder in the split-folder layout")
    return f.split


def _duplicate_stats(scan: ScanResult, kept: list[int], hashes: list[bytes]) -> DuplicatesInfo:
    groups: dict[bytes, set[int]] = {}
    sizes: dict[bytes, int] = {}
    for i, h in zip(kept, hashes):
        groups.setdefault(h, set()).add(scan.files[i].label)
        sizes[h] = sizes.get(h, 0) + 1
    dup = [h for h, n in sizes.items() if n > 1]
    return DuplicatesInfo(groups=len(dup), files=sum(sizes[h] for h in dup),
                          label_conflicts=sum(1 for h in dup if len(groups[h] - {-1}) > 1))


# ---------------------------------------------------------------------------- writing
def _write_splits(tmp: Path, scan: ScanResult, kept: list[int], assigned: list[str | None],
                  opts: IngestOptions) -> tuple[dict[str, SplitInfo], np.ndarray]:
    """Stream staging rows into per-split files; returns split info and train channel histograms."""
    size = opts.size
    row_shape = (size, size, 3)
    row_bytes = size * size * 3
    split_names = list(SPLITS) + ([UNLABELED] if UNLABELED in assigned else [])
    rows_of = {s: [r for r, a in enumerate(assigned) if a == s] for s in split_names}
    writers: dict[str, tuple[NpyRowWriter, NpyRowWriter | None]] = {}
    hist = np.zeros((3, 256), np.int64)
    info: dict[str, SplitInfo] = {}
    try:
        for s in split_names:
            names = split_paths(s)
            n = len(rows_of[s])
            img_w = NpyRowWriter(tmp / names["images"], n, row_shape, np.uint8)
            lab_w = None if s == UNLABELED else NpyRowWriter(tmp / names["labels"], n, (), np.int64)
            writers[s] = (img_w, lab_w)
            with open(tmp / names["files"], "w", encoding="utf-8") as fh:
                for r in rows_of[s]:
                    fh.write(scan.files[kept[r]].rel + "\n")
            per_class = {c: 0 for c in scan.classes}
            for r in rows_of[s]:
                label = scan.files[kept[r]].label
                if label >= 0:
                    per_class[scan.classes[label]] += 1
            info[s] = (SplitInfo(count=n, labels="absent") if s == UNLABELED
                       else SplitInfo(count=n, labels="present", per_class=per_class))
        with open(tmp / _STAGING, "rb") as fh:
            for start in range(0, len(kept), _CHUNK_ROWS):
                n = min(_CHUNK_ROWS, len(kept) - start)
                chunk = np.fromfile(fh, np.uint8, n * row_bytes).reshape((n, *row_shape))
                for s in split_names:
                    sel = [k for k in range(n) if assigned[start + k] == s]
                    if not sel:
                        continue
                    rows = chunk[sel]
                    img_w, lab_w = writers[s]
                    img_w.write(rows)
                    if lab_w is not None:
                        lab_w.write(np.array([scan.files[kept[start + k]].label for k in sel], np.int64))
                    if s == "train":
                        flat = rows.reshape(-1, 3)
                        for c in range(3):
                            hist[c] += np.bincount(flat[:, c], minlength=256)
        for img_w, lab_w in writers.values():
            img_w.close()
            if lab_w is not None:
                lab_w.close()
    except BaseException:
        for img_w, lab_w in writers.values():
            img_w.abort()
            if lab_w is not None:
                lab_w.abort()
        raise
    return info, hist


def _mean_std(hist: np.ndarray) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Exact per-channel mean/std on the [0, 1] scale from 256-bin histograms."""
    values = np.arange(256, dtype=np.float64) / 255.0
    total = hist.sum(axis=1).astype(np.float64)
    mean = (hist * values).sum(axis=1) / total
    var = (hist * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / total
    m = [round(float(v), 6) for v in mean]
    s = [round(float(max(np.sqrt(v), 1e-6)), 6) for v in var]
    return (m[0], m[1], m[2]), (s[0], s[1], s[2])


def _fingerprint(scan: ScanResult, opts: IngestOptions, unlabeled: str | None, out: Path | None = None,
                 files: str | None = None) -> str:
    """What the dataset was made from: options, classes, every source file's path, size and time stamp. With
    ``out``, every folder and file is named relative to the dataset folder, so a project moved or renamed as a
    whole (photos and dataset together) is still up to date; without, the absolute form of the datasets built
    before (still accepted: see :func:`_up_to_date`). ``files`` replaces the files' part (with ``out``): the
    digest of their contents, :func:`_content_digest`."""
    def where(path: str) -> str:
        return relative_to(path, out) if out is not None else path

    fields = {"format_version": FORMAT_VERSION, "options": opts.to_dict(), "root": where(scan.root),
              "unlabeled": where(unlabeled) if unlabeled is not None else None, "classes": scan.classes,
              "files": files or (scan.stats_digest_relative if out is not None else scan.stats_digest)}
    if scan.also:  # only when given, so datasets built without --also keep their fingerprint
        fields["also"] = [where(a) for a in scan.also]
    if any(f.rel.lower().endswith((".tif", ".tiff")) for f in scan.files):  # only then: other datasets stay
        fields["tiff_decoder"] = decode.TIFF_REVISION
    if out is not None:
        fields["paths"] = "relative to the dataset folder"
    payload = json.dumps(fields, sort_keys=True)
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def _content_digest(scan: ScanResult, known: dict[int, bytes] | None = None) -> str:
    """SHA-256 over every source file's path (relative to the source, as in the scan's stats digest), the
    SHA-256 of its bytes, label and split, in scan order: what the photos are, whatever their time stamps.
    ``known``: file index -> the digest the decode pass already took of the same bytes (read once, not twice);
    a file that cannot be read counts by its reason."""
    known = known or {}
    root = Path(scan.root)
    total = hashlib.sha256()
    for i, f in enumerate(scan.files):
        digest = known.get(i)
        if digest is None:
            try:
                digest = hashlib.sha256(read_source(f.path)).digest()
            except ImageDecodeError as exc:
                digest = f"unreadable:{exc.reason}".encode()
        total.update(f"{relative_to(f.rel, root)}\0{digest.hex()}\0{f.label}\0{f.split}\n".encode())
    return "content-sha256:" + total.hexdigest()


# ---------------------------------------------------------------------------- output folder safety
def _check_free_space(out: Path, photos: int, size: int) -> None:
    """Refuse before decoding when the arrays cannot fit: each photo takes size x size x 3 bytes, held twice while
    the dataset is written (the decoded staging file, then the split arrays)."""
    need = 2 * photos * size * size * 3
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise IngestError(f"{out}: {photos} photos at {size} px need about {_amount(need)} while the dataset is "
                          f"written ({size} x {size} x 3 bytes each, twice), and {out.parent} has {_amount(free)} "
                          "free: choose a smaller --size or free some space")


def _amount(nbytes: int) -> str:
    """Bytes in the unit that shows them: GiB from 1 GiB, else MiB (with a decimal below 10 MiB)."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    mib = nbytes / (1 << 20)
    return f"{mib:.1f} MiB" if mib < 10 else f"{mib:.0f} MiB"


def _check_out(src: Path, out: Path, inputs: Sequence[tuple[str, str | os.PathLike]] = ()) -> None:
    """Refuse an output folder inside the source, or one holding any folder of photos read (``inputs``: (option,
    path)): replacing the output would delete them with it."""
    if out == src or src in out.parents:
        raise IngestError(f"output folder {out} must not be inside the source folder {src}")
    for option, path in (("--src", src), *inputs):
        p = Path(path).resolve()
        if p == out or out in p.parents:
            raise IngestError(f"{option} {path} is inside the output folder {out}, which is replaced whole when the "
                              "dataset is written: move the photos out of it, or give another --out")
    try:
        check_replaceable(out, MANIFEST_NAME, "leaflens dataset folder")
    except NotOurFolderError as exc:
        raise IngestError(str(exc)) from None


# In a dataset folder, beside the manifest (which it cannot change without changing the dataset's identity): the
# time stamps seen when the photos' contents were last found the same, so that they are not read again each run.
STATS_SEEN = ".input-stats.json"


def _up_to_date(out: Path, fingerprints: Sequence[str], src: Path | None = None, listing: str | None = None,
                contents: Callable[[], str] | None = None) -> str | None:
    """How ``out`` is the dataset these inputs make, whole, or None when it is not: same inputs, every file as
    its manifest's checksums say (a damaged dataset is built again), and the source's classes.toml (display
    names and advice, which travel with the dataset) the one it holds.

    Same inputs: ``"stats"``, the files' paths, sizes and time stamps are those recorded (``fingerprints``,
    the first the current form; or those :data:`STATS_SEEN` noted for this manifest); else ``"contents"``, their
    bytes are (``contents()``, the fingerprint over their contents, against the manifest's
    ``input_content_fingerprint``; asked for only when the files' names, sizes and options are the dataset's,
    ``listing`` against ``input_listing_fingerprint``): photos copied, unpacked again or touched keep their
    dataset, and the stages after it are not run again for nothing."""
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        how = "stats" if manifest.get("input_fingerprint") in fingerprints else None
        if how is None and (out / STATS_SEEN).is_file():
            seen = json.loads((out / STATS_SEEN).read_text(encoding="utf-8"))
            if seen.get("manifest_sha256") == manifest.get("manifest_sha256") and seen.get("input_fingerprint") \
                    == fingerprints[0]:
                how = "stats"
        same_listing = listing is None or manifest.get("input_listing_fingerprint") in (None, listing)
        if how is None and contents is not None and manifest.get("input_content_fingerprint") and same_listing:
            how = "contents" if manifest["input_content_fingerprint"] == contents() else None
        if how is None:
            return None
        load_dataset(out, verify=True)
        if src is not None:
            given = src / CLASS_INFO_NAME
            held = (manifest.get("checksums") or {}).get(CLASS_INFO_NAME)
            if given.is_file() != (held is not None) or (held is not None and sha256_file(given) != held):
                return None
    except (OSError, ValueError, DatasetError):
        return None
    return how


# ---------------------------------------------------------------------------- main entry
def check_options(opts: IngestOptions) -> None:
    """IngestError naming the option that cannot work (checked before anything is read)."""
    if opts.size < 8:
        raise IngestError(f"image size {opts.size} is too small (need >= 8)")
    if opts.size > MAX_SIZE:
        raise IngestError(f"image size {opts.size} is too large (at most {MAX_SIZE}: every photo is stored as "
                          f"size x size x 3 bytes; students train at 64-128 px, the teacher reads the original files)")
    if not 0 <= opts.seed < 2**32:
        raise IngestError(f"seed must be a whole number from 0 to {2**32 - 1}, got {opts.seed}")
    if opts.max_pixels < 1:
        raise IngestError(f"--max-pixels must be at least 1 (the largest photo decoded, in pixels), got "
                          f"{opts.max_pixels}")


def ingest(src: str | os.PathLike, out: str | os.PathLike | None, options: IngestOptions | None = None, *,
           unlabeled: str | os.PathLike | None = None, workers: int | None = None, progress: bool = False,
           force: bool = False, strict: bool = False, check: bool = False,
           report_path: str | os.PathLike | None = None, also: Sequence[str | os.PathLike] = (),
           log: Callable[[str], None] = print) -> IngestReport:
    """Turn the photo folder ``src`` into the dataset folder ``out`` (see module docstring).

    Data a model cannot be trained and judged on is refused with what to do: fewer than 2 classes, or
    a validation or test split left empty. Classes with fewer than ``MIN_PER_CLASS`` usable photos
    are listed as a warning (they cannot appear in every split), or refused with ``strict``.

    The data checks (:mod:`leaflens.data_prep.data_report`) run on every build; their report is logged
    and written as ``data_report.json`` with the dataset. ``options.dedupe`` removes the duplicates they
    find. ``check`` runs them alone, decoding each photo at :func:`check_size` and writing nothing but
    the report at ``report_path`` (when given); ``out`` may then be None. A refusal raises
    :class:`IngestError` in both modes, after the report is logged.

    ``also``: extra folders of labelled photos (``DIR/<class>/*``, e.g. the web app's corrections) merged
    into the source's classes (:func:`leaflens.data_prep.scan.scan_source`); their photos are recorded by
    absolute path in ``<split>_files.txt``, ``not_a_leaf/`` is skipped with a note.
    """
    t0 = time.perf_counter()
    opts = options or IngestOptions()
    check_options(opts)
    said: list[str] = []  # every warning logged, for data_report.json (report.md shows its warnings)
    log = _keeping_warnings(log, said)
    src_p = Path(src).resolve()
    scan = scan_source(src_p, unlabeled, also)
    if scan.empty_folders:
        names = ", ".join(repr(c) for c in scan.empty_folders)
        log(f"warning: {names} hold{'s' if len(scan.empty_folders) == 1 else ''} no photo (JPEG, PNG, WebP, BMP, "
            "TIFF, HEIC), so not a class: add its photos, or remove the folder")
    if scan.layout == "split_folders" and tuple(opts.ratios) != IngestOptions().ratios:
        asked = "/".join(f"{100 * r:g}" for r in opts.ratios)
        log(f"note: {src_p} is already split into train/val/test folders, which are kept as they are: --split {asked} "
            "applies only to photos added by --also")
    if scan.also:
        log(f"--also: {scan.also_files} labelled photo(s) found in {', '.join(scan.also)}, added to their classes "
            "(less any the lines below leave out)")
    if scan.ignored.get(NOT_A_LEAF):
        log(f"note: {scan.ignored[NOT_A_LEAF]} photo(s) in --also {NOT_A_LEAF}/ folders skipped: the classifier has "
            "no class for them (they stay where they are, for a future set of negatives)")
    for cls, subs in scan.nested.items():
        if len(scan.classes) < 2:
            break  # refused below, with where to point --src
        if all(not any(ch.isalpha() for ch in name) for name, _ in subs):
            continue  # rust/2024-06/, rust/field_2/...: dates and numbers are collections of a class, not classes
        listed = ", ".join(f"{name} {n}" for name, n in subs)
        where = ("move them up a level, into each split folder" if scan.layout == "split_folders" else
                 f"point --src at {_class_folder(src_p, scan, cls)} or move them up a level")
        log(f"warning: class {cls!r} is made of the photos of its subfolders ({listed}): a class is one folder of "
            f"the source, whatever it holds; if these subfolders are classes of their own, {where}")
    if len(scan.classes) < 2:
        found = ", ".join(repr(c) for c in scan.classes) or "none"
        inner = scan.nested.get(scan.classes[0]) if scan.classes else None
        move = ("move them up a level, into each split folder" if scan.layout == "split_folders" else
                f"point --src at {_class_folder(src_p, scan, scan.classes[0])}")
        example = ([src_p / split / "rust" for split in ("train", "val", "test")] if scan.layout == "split_folders"
                   else [src_p / "healthy", src_p / "rust"])
        hint = (f"its subfolders ({', '.join(n for n, _ in inner)}) look like the classes: {move}" if inner else
                "put each class's photos in a folder of its own, e.g. "
                + (f"{', '.join(map(str, example))} beside the {scan.classes[0]!r} folders"
                   if scan.layout == "split_folders" and scan.classes else " and ".join(map(str, example))))
        raise IngestError(f"{src_p}: {len(scan.classes)} class folder found ({found}); a classifier needs at least "
                          f"2 classes: {hint}")
    workers = max(1, workers or usable_cpus())
    if check:
        return _check_only(src_p, scan, opts, workers, progress, strict, report_path, log, t0, said)
    if out is None:
        raise IngestError("no output folder given (--out); only --check runs without one")
    out_p = Path(out).resolve()
    _check_out(src_p, out_p, [("--also", a) for a in also] + ([("--unlabeled", unlabeled)] if unlabeled else []))
    unl = str(Path(unlabeled).resolve()) if unlabeled is not None else None
    fingerprint = _fingerprint(scan, opts, unl, out_p)
    if out_p.parent.is_dir():
        clean_stale_temps(out_p)  # a killed run's half-written folder, whatever this run does next
    def contents(known: dict[int, bytes] | None = None) -> str:
        return _fingerprint(scan, opts, unl, out_p, files=_content_digest(scan, known))

    listing = _fingerprint(scan, opts, unl, out_p, files="listing:" + scan.listing_digest)
    how = None if force else _up_to_date(out_p, (fingerprint, _fingerprint(scan, opts, unl)), src_p, listing,
                                         contents)
    if how == "contents":  # noted beside the manifest, so that the next run does not read every photo again
        with contextlib.suppress(OSError, ValueError):
            held = json.loads((out_p / MANIFEST_NAME).read_text(encoding="utf-8"))["manifest_sha256"]
            write_json_atomic(out_p / STATS_SEEN, {"manifest_sha256": held, "input_fingerprint": fingerprint})
    if how is not None:
        same = ("unchanged" if how == "stats" else
                "with new time stamps (copied or touched) but the same contents, checked byte for byte")
        log(f"{out_p}: up to date ({len(scan.files)} source files {same}, same options); nothing to do")
        built: dict = {}
        with contextlib.suppress(OSError, ValueError):
            built = json.loads((out_p / DATA_REPORT_NAME).read_text(encoding="utf-8"))
        warned = (built.get("warnings") or []) if isinstance(built, dict) else []
        if warned:  # what its build warned of, said again
            log(f"note: its build warned {len(warned)} time{'s' if len(warned) > 1 else ''} (all in "
                f"{out_p / DATA_REPORT_NAME}), first: {warned[0]}")
        if report_path is not None and built:  # the report of the build it is
            write_json_atomic(report_path, built)
        return IngestReport(out_p, True, scan.classes, seconds=time.perf_counter() - t0)

    out_p.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out_p)
    _check_free_space(out_p, len(scan.files), opts.size)
    tmp = new_temp_dir(out_p)
    try:
        decoded = _decode_all(scan.files, opts, tmp / _STAGING, workers, progress)
        kept, digests, rejects = decoded.kept, decoded.digests, decoded.rejects
        assigned, data = _split_and_check(scan, decoded, opts, workers, "preprocess", opts.size, log)
        try:
            _check_class_sizes(scan, kept, assigned, strict, log)
            _refuse_unusable(src_p, scan, opts, _split_counts(scan, kept, assigned), len(rejects), log, data)
        except IngestError as exc:
            _log_rejects(rejects, log)  # the refusal points to them: nothing else will be written
            _write_report(report_path, data, said, exc)  # the data report asked for: what was found, why refused
            raise
        data = _with_warnings(data, said)
        info, hist = _write_splits(tmp, scan, kept, assigned, opts)
        (tmp / _STAGING).unlink()
        mean, std = _mean_std(hist)
        report = _report(out_p, scan, info, rejects)
        with open(tmp / REJECTED_NAME, "w", encoding="utf-8") as fh:
            for rec in rejects:
                rec = dict(rec, **{"class": scan.classes[rec["label"]] if rec["label"] >= 0 else None})
                del rec["label"]
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        class_info = None
        if (src_p / CLASS_INFO_NAME).is_file():  # display names/advice travel with the arrays
            shutil.copyfile(src_p / CLASS_INFO_NAME, tmp / CLASS_INFO_NAME)
            class_info = CLASS_INFO_NAME
        checksums = {}
        if class_info:
            checksums[CLASS_INFO_NAME] = sha256_file(tmp / CLASS_INFO_NAME)
        for s in info:
            for kind, name in split_paths(s).items():
                if kind == "labels" and info[s].labels == "absent":
                    continue
                checksums[name] = sha256_file(tmp / name)
        manifest = Manifest(
            classes=tuple(scan.classes), image_size=opts.size, mean=mean, std=std,
            mean_std_scale="pixel / 255, per RGB channel, computed on train", splits=info,
            source_root=scan.root, source_layout=scan.layout, unlabeled_source=unl,
            also_sources=tuple(scan.also) or None, class_info=class_info,
            options=opts,
            rejected=RejectedInfo(total=len(rejects), per_class=report.rejected, reasons=report.rejected_reasons,
                                  list=REJECTED_NAME),
            ignored=scan.ignored, duplicates=_duplicate_stats(scan, kept, digests), checksums=checksums,
            input_fingerprint=fingerprint, input_content_fingerprint=contents(dict(zip(kept, digests))),
            input_listing_fingerprint=listing)
        # The report travels with the arrays but outside the manifest's checksums: it describes the data,
        # nothing is trained on it, and datasets built before it existed keep their identity.
        write_json_atomic(tmp / DATA_REPORT_NAME, data.to_dict())
        write_json_atomic(tmp / MANIFEST_NAME, manifest.with_self_digest().to_dict())
        if report_path is not None:
            write_json_atomic(report_path, data.to_dict())
        swap_into_place(tmp, out_p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.data = data
    report.checks_seconds = data.seconds
    report.seconds = time.perf_counter() - t0
    log(format_summary(report))
    return report


def _log_rejects(rejects: Sequence[Mapping[str, object]], log: Callable[[str], None],
                 most: int = 20) -> None:
    """The files left out and why, before a refusal (no rejected.jsonl is written then)."""
    if not rejects:
        return
    log(f"rejected {len(rejects)} file(s):")
    for rec in rejects[:most]:
        log(f"  {rec['path']}: {rec['reason']}" + (f" ({rec['detail']})" if rec.get("detail") else ""))
    if len(rejects) > most:
        log(f"  ... and {len(rejects) - most} more")


def check_size(size: int) -> int:
    """The size --check decodes photos at: the stored size up to ``CHECK_SIZE`` (JPEG draft decoding
    makes it cheap; the hashes then match those of a full build to within a few bits)."""
    return min(size, CHECK_SIZE)


def _keeping_warnings(log: Callable[[str], None], said: list[str]) -> Callable[[str], None]:
    """``log``, keeping in ``said`` the text of every message that is a warning."""
    def logged(message: str) -> None:
        if message.startswith("warning: "):
            said.append(message[len("warning: "):])
        log(message)
    return logged


def _with_warnings(data: DataReport, said: Sequence[str]) -> DataReport:
    """``data`` with the warnings preprocess logged besides the checks' own (a class without a val photo, a
    nested class folder...), so that data_report.json, and the report.md that shows it, hold them all."""
    extra = tuple(w for w in said if w not in data.warnings)
    return dataclasses.replace(data, warnings=(*data.warnings, *extra)) if extra else data


def _write_report(path: str | os.PathLike | None, data: DataReport, said: Sequence[str],
                  refused: IngestError | None = None) -> None:
    """The data report asked for with --report (none without ``path``): every warning logged, and why the data
    was refused when it was."""
    if path is not None:
        full = _with_warnings(data, said)
        if refused is not None:
            full = dataclasses.replace(full, refused=str(refused))
        write_json_atomic(path, full.to_dict())


def _check_only(src_p: Path, scan: ScanResult, opts: IngestOptions, workers: int, progress: bool, strict: bool,
                report_path: str | os.PathLike | None, log: Callable[[str], None], t0: float,
                said: Sequence[str] = ()) -> IngestReport:
    """`leaflens preprocess --check`: decode small, run the checks and the refusals, write only ``report_path``."""
    decoded = _decode_all(scan.files, opts, None, workers, progress, decode_size=check_size(opts.size))
    assigned, data = _split_and_check(scan, decoded, opts, workers, "check", check_size(opts.size), log)
    counts = _split_counts(scan, decoded.kept, assigned)
    report = IngestReport(Path(src_p), False, scan.classes, counts, ignored=dict(scan.ignored),
                          not_image_extensions=dict(scan.not_image_extensions), data=data,
                          checks_seconds=data.seconds, ignored_examples=scan.ignored_names())
    for rec in decoded.rejects:
        key = scan.classes[rec["label"]] if rec["label"] >= 0 else UNLABELED
        report.rejected[key] = report.rejected.get(key, 0) + 1
        report.rejected_reasons[rec["reason"]] = report.rejected_reasons.get(rec["reason"], 0) + 1
    _log_rejects(decoded.rejects, log)  # the files a build would leave out, and why
    try:
        _check_class_sizes(scan, decoded.kept, assigned, strict, log)
        _refuse_unusable(src_p, scan, opts, counts, len(decoded.rejects), log, data)
    except IngestError as exc:
        _write_report(report_path, data, said, exc)
        raise
    _write_report(report_path, data, said)
    report.seconds = time.perf_counter() - t0
    log(format_summary(report, check=True))  # the split a build would make, and the files it would leave out
    return report


def _split_and_check(scan: ScanResult, decoded: _Decoded, opts: IngestOptions, workers: int,
                     mode: Literal["preprocess", "check"], decode_size: int,
                     log: Callable[[str], None]) -> tuple[list[str | None], DataReport]:
    """Link the duplicates, assign the splits, run the data checks (removing with ``opts.dedupe``) and
    log the report. Returns the split per kept row (None: left out) and the report, whose ``seconds``
    is the main process's time on the checks plus the workers' check time shared among them."""
    t_start = time.perf_counter()
    files, kept = scan.files, decoded.kept
    lab_rows = [r for r, i in enumerate(kept) if files[i].label >= 0]
    copies = find_copies(decoded.hashes[lab_rows], decoded.colours[lab_rows])
    linked = copies.groups
    units: list[Hashable] = [decoded.digests[r] for r in range(len(kept))]
    for g, group in enumerate(copies.shape_groups):  # look-alikes too: see near_dup.Copies
        for k in group.members:
            units[lab_rows[k]] = ("group", g)
    source_units = units
    if any(files[kept[r]].extra for r in lab_rows):
        # the source's own groups: a correction alike to two source photos must not join them into one unit
        # (that reshuffles their class), so the source is split exactly as without --also
        src_rows = [r for r in lab_rows if not files[kept[r]].extra]
        source_units = list(units)
        for r in src_rows:
            source_units[r] = decoded.digests[r]
        own = find_copies(decoded.hashes[src_rows], decoded.colours[src_rows])
        for g, group in enumerate(own.shape_groups):
            for k in group.members:
                source_units[src_rows[k]] = ("source group", g)
    t_split = time.perf_counter()
    rejects_before = len(decoded.rejects)
    assigned = _assign(scan, kept, decoded.digests, units, opts, decoded.rejects, source_units)
    twice = sum(r["reason"] == "duplicate_of_source" for r in decoded.rejects[rejects_before:])
    labelled_now = sum(r["reason"] == "labelled_by_correction" for r in decoded.rejects[rejects_before:])
    exact_dropped = len(decoded.rejects) - rejects_before - twice - labelled_now  # copies across given splits
    if twice:
        log(f"note: {twice} photo(s) of --also are already in the source under the same class (same bytes): left "
            "out, and the source's copy stays in its split")
    if labelled_now:
        log(f"note: {labelled_now} unlabelled photo(s) have a label now from --also (same bytes): the labelled "
            "copy is used, the unlabelled one left out (labelled_by_correction in rejected.jsonl)")
    t_checks = time.perf_counter()
    rows = [r for r in lab_rows if assigned[r] is not None]
    # The groups among the photos kept: an exact copy left out of a later split had its twin's hashes,
    # so leaving it out breaks no link between the others.
    position = {r: k for k, r in enumerate(rows)}
    kept_groups = []
    for group in linked:
        members = tuple(position[lab_rows[k]] for k in group.members if lab_rows[k] in position)
        if len(members) > 1:
            kept_groups.append(NearGroup(members, group.distance))
    photos = CheckedPhotos(files=[files[kept[r]].rel for r in rows],
                           labels=np.array([files[kept[r]].label for r in rows], np.int64),
                           splits=[str(assigned[r]) for r in rows], digests=[decoded.digests[r] for r in rows],
                           metas=[decoded.metas[r] for r in rows], refusals=[decoded.refusals[r] for r in rows])
    look_alikes = [(position[lab_rows[p.a]], position[lab_rows[p.b]], p.bits, p.colour) for p in copies.look_alikes
                   if lab_rows[p.a] in position and lab_rows[p.b] in position]
    data, removed = run_checks(photos, kept_groups, scan.classes, dedupe=bool(opts.dedupe),
                               seed=opts.seed, source=scan.root, layout=scan.layout, mode=mode,
                               decode_size=decode_size, exact_dropped=exact_dropped, look_alikes=look_alikes,
                               look_alike_pairs=copies.look_alike_pairs)
    data = _unlabeled_copies(scan, decoded, assigned, bool(opts.dedupe), data)
    for k in removed:
        r = rows[k]
        f = files[kept[r]]
        rem = next(x for x in data.removed if x.file == f.rel)
        detail = (f"removed by --dedupe: a copy of {rem.kept}" if rem.kept is not None else
                  "removed by --dedupe: the same photo is filed under another class")
        decoded.rejects.append({"path": f.rel, "label": f.label, "split": f.split, "reason": rem.reason,
                                "detail": detail})
        assigned[r] = None
    main_seconds = (t_split - t_start) + (time.perf_counter() - t_checks)
    worker_share = decoded.worker_check_seconds / (workers if len(files) > 1 else 1)
    data = dataclasses.replace(data, seconds=round(main_seconds + worker_share, 3))
    log(format_data_report(data))
    return assigned, data


def _unlabeled_copies(scan: ScanResult, decoded: _Decoded, assigned: list[str | None], dedupe: bool,
                      data: DataReport) -> DataReport:
    """Unlabelled photos that are copies of validation or test photos (exact or near, as the labelled
    check finds them): the teacher self-trains on the unlabelled photos, so its validation and test figures
    would credit it with photos it has seen. Warned about; with ``dedupe`` the copies are left out (their
    rows' split set to None, listed in rejected.jsonl)."""
    held = [r for r, split in enumerate(assigned) if split in ("val", "test")]
    unl = [r for r, split in enumerate(assigned) if split == UNLABELED]
    if not held or not unl:
        return data
    rows = held + unl
    copies = find_copies(decoded.hashes[rows], decoded.colours[rows])
    found: list[tuple[int, int]] = []  # (unlabelled row, held-out row it copies)
    for group in copies.groups:
        members = [rows[k] for k in group.members]
        ours = [r for r in members if assigned[r] in ("val", "test")]
        if ours:
            found.extend((r, ours[0]) for r in members if assigned[r] == UNLABELED)
    if not found:
        return data
    files, kept = scan.files, decoded.kept
    pairs = tuple(f"{files[kept[u]].rel} = {files[kept[h]].rel} ({assigned[h]})" for u, h in found)
    for u, h in found:
        if dedupe:
            assigned[u] = None
            decoded.rejects.append({"path": files[kept[u]].rel, "label": -1, "split": files[kept[u]].split,
                                    "reason": "duplicate",
                                    "detail": f"removed by --dedupe: a copy of {files[kept[h]].rel} ({assigned[h]})"})
    what = ("left out by --dedupe" if dedupe else
            "remove them from the unlabelled folder, or run with --dedupe")
    warning = (f"leakage: {len(found)} unlabelled photo{'s are copies' if len(found) > 1 else ' is a copy'} of "
               f"validation or test photos (e.g. {pairs[0]}): the teacher learns from the unlabelled photos, so "
               f"its validation and test figures would count photos it has seen; {what}")
    return dataclasses.replace(data, warnings=(*data.warnings, warning), unlabeled_copies=pairs)


def _split_counts(scan: ScanResult, kept: list[int], assigned: list[str | None]) -> dict[str, dict[str, int]]:
    """Split -> class -> photos (the unlabelled split counts under its own name)."""
    counts: dict[str, dict[str, int]] = {s: dict.fromkeys(scan.classes, 0) for s in SPLITS}
    for i, split in zip(kept, assigned):
        if split == UNLABELED:
            counts.setdefault(UNLABELED, {UNLABELED: 0})[UNLABELED] += 1
        elif split is not None:
            counts[split][scan.classes[scan.files[i].label]] += 1
    return counts


def _refuse_unusable(src_p: Path, scan: ScanResult, opts: IngestOptions, counts: dict[str, dict[str, int]],
                     n_rejected: int, log: Callable[[str], None], data: DataReport | None = None) -> None:
    """Refuse (IngestError) a dataset with no training photo or an empty val or test split; a split the
    user's --split asked to be empty is a warning."""
    totals = {s: sum(counts[s].values()) for s in SPLITS}
    if totals["train"] == 0:
        raise IngestError(f"{src_p}: no training image could be decoded ({n_rejected} rejected); "
                          f"see the reasons above")
    empty = [s for s in ("val", "test") if totals[s] == 0]
    listed = ", ".join(f"{s} {totals[s]}" for s in SPLITS)
    asked_none = [s for s in empty if scan.layout != "split_folders" and opts.ratios[SPLITS.index(s)] == 0]
    if asked_none:  # the user's own --split: allowed, but distill will not train on it
        log(f"warning: no {' and '.join(asked_none)} photos, as --split asked ({listed}); "
            "`leaflens distill` needs both to choose and report a model")
        empty = [s for s in empty if s not in asked_none]
    if empty:
        what = f"{src_p}: the {' and '.join(empty)} split would be empty ({listed} photos): a model is chosen on val " \
               "and reported on test. "
        if scan.layout == "split_folders":
            given = {s: sum(1 for f in scan.files if f.split == s) for s in empty}
            lost = [f"the {n} photo(s) of {s}/ were all left out (rejected, or copies of photos in another split: "
                    "see above)" for s, n in given.items() if n]
            raise IngestError(what + (f"{'; '.join(lost)}. " if lost else "") + "Put photos of every class in "
                              + " and ".join(str(src_p / s) for s in empty) + ", photos not found in the other splits")
        raise IngestError(what + f"Add photos: at least {MIN_PER_CLASS} per class, so that each split gets one of "
                                 "every class")
    _check_each_class_split(src_p, scan, counts, asked_none, log, data)


def _why_a_split_is_missing(data: DataReport | None) -> dict[str, str]:
    """Per class, why the automatic split left it without a val or test photo, from what the data checks found:
    a photo shared with another class (kept in one split with its copy), photos --dedupe left out after the
    split, or (the default) its own copies and look-alikes kept together."""
    why: dict[str, str] = {}
    if data is None:
        return why
    for r in data.removed:
        n = sum(1 for x in data.removed if x.class_name == r.class_name)
        why.setdefault(r.class_name, f"--dedupe left out {n} of its photos after the split "
                                     f"(listed in {DATA_REPORT_NAME}): add different photos of it")
    for g in data.duplicates.groups:
        if g.scope != "across_classes":
            continue
        for p in g.photos:
            others = sorted({q.class_name for q in g.photos if q.class_name != p.class_name})
            why.setdefault(p.class_name, f"one of its photos, {p.file}, is also filed under {', '.join(others)} (a "
                                         "label conflict), and the copies stay in one split so none leaks: keep the "
                                         "photo under its right class only, or add different photos of it")
    return why


def _check_each_class_split(src_p: Path, scan: ScanResult, counts: dict[str, dict[str, int]], asked_none: list[str],
                            log: Callable[[str], None], data: DataReport | None = None) -> None:
    """Refuse a class with photos but none to train on; warn about a class of ``MIN_PER_CLASS`` photos or
    more with none in val or test (classes smaller than that are warned about by their size)."""
    def per_split(c: str) -> str:
        return ", ".join(f"{s} {counts[s][c]}" for s in SPLITS)

    given = scan.layout == "split_folders"
    reasons = _why_a_split_is_missing(data)
    no_train = [c for c in scan.classes if counts["train"][c] == 0 and counts["val"][c] + counts["test"][c] > 0]
    if no_train:
        listed = "; ".join(f"{c!r} ({per_split(c)})" for c in no_train)
        where = (f"put some of its photos in {src_p / 'train' / _one_or_placeholder(no_train)}/" if given else
                 "its photos are one group of copies or look-alikes (data_report.json), so they stay together")
        raise IngestError(f"{src_p}: no training photo for {listed}: the model could never answer "
                          f"{'these classes' if len(no_train) > 1 else 'it'}; {where}, or leave the class out")
    for s in ("val", "test"):
        if s in asked_none:
            continue
        missing = [c for c in scan.classes
                   if counts[s][c] == 0 and sum(counts[x][c] for x in SPLITS) >= MIN_PER_CLASS]
        if not missing:
            continue
        use = "the model is chosen without it" if s == "val" else "the report cannot say how the model does on it"
        if given:
            listed = "; ".join(f"{c!r} ({per_split(c)})" for c in missing)
            log(f"warning: no {s} photo for {listed}: {use}; put some of its photos in "
                f"{src_p / s / _one_or_placeholder(missing)}/")
            continue
        for c in missing:
            why = reasons.get(c, "its photos are copies or look-alikes of each other, kept in one split so none "
                                 f"leaks ({DATA_REPORT_NAME} lists them): add different photos of it")
            log(f"warning: no {s} photo for {c!r} ({per_split(c)}): {use}; {why}")


def _class_folder(src_p: Path, scan: ScanResult, cls: str) -> Path:
    """The folder of class ``cls`` (the first split's, in a split-folder source)."""
    if scan.layout != "split_folders":
        return src_p / cls
    first = next((f for f in scan.files if f.label >= 0 and scan.classes[f.label] == cls), None)
    return src_p / (first.split or "train") / cls if first is not None else src_p / cls


def _one_or_placeholder(classes: list[str]) -> str:
    return classes[0] if len(classes) == 1 else "<class>"


def _report(out: Path, scan: ScanResult, info: dict[str, SplitInfo], rejects: list[dict]) -> IngestReport:
    counts = {s: dict(v.per_class) for s, v in info.items() if v.per_class is not None}
    if UNLABELED in info:
        counts[UNLABELED] = {UNLABELED: info[UNLABELED].count}
    rejected: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for rec in rejects:
        key = scan.classes[rec["label"]] if rec["label"] >= 0 else UNLABELED
        rejected[key] = rejected.get(key, 0) + 1
        reasons[rec["reason"]] = reasons.get(rec["reason"], 0) + 1
    return IngestReport(out, False, scan.classes, counts, rejected, reasons, dict(scan.ignored),
                        dict(scan.not_image_extensions), ignored_examples=scan.ignored_names())


def _ignored_cell(report: IngestReport, kind: str, n: int) -> str:
    """'not_image: 5 (.gif 3, .txt 2)': which extensions were taken for other files, so a photo format we
    do not read is seen rather than silently left out; 'broken_link: 2 (rust/a.jpg, rust/b.jpg)': the files
    themselves where a person has one to fix (a few of them)."""
    ext = report.not_image_extensions if kind == "not_image" else {}
    listed = ", ".join(f"{e} {k}" for e, k in sorted(ext.items(), key=lambda item: (-item[1], item[0])))
    named = report.ignored_examples.get(kind, [])
    if named:
        listed = ", ".join(named) + (", ..." if n > len(named) else "")
    return f"{kind}: {n}" + (f" ({listed})" if listed else "")


def format_summary(report: IngestReport, check: bool = False) -> str:
    """A per-class table of kept (per split) and rejected images (``check``: what a build would keep)."""
    splits = [s for s in (*SPLITS, UNLABELED) if s in report.counts]
    keys = list(report.classes) + ([UNLABELED] if UNLABELED in report.counts else [])
    width = max([display_width(k) for k in keys] + [5])
    lines = [f"{'class':<{width}} " + " ".join(f"{s:>9}" for s in splits) + f" {'rejected':>9}"]
    for k in keys:
        cells = []
        for s in splits:
            cells.append(f"{report.counts[s].get(k, 0):>9}")
        lines.append(f"{pad_right(k, width)} " + " ".join(cells) + f" {report.rejected.get(k, 0):>9}")
    lines.append(f"{'would keep' if check else 'kept'} {report.kept_total}, "
                 f"{'would reject' if check else 'rejected'} {report.rejected_total}"
                 + (f" ({', '.join(f'{r}: {n}' for r, n in sorted(report.rejected_reasons.items()))})"
                    if report.rejected_reasons else "")
                 + (f", ignored {', '.join(_ignored_cell(report, k, n) for k, n in sorted(report.ignored.items()))}"
                    if report.ignored else "")
                 + (f"; {report.seconds:.1f} s, nothing written (--check)" if check else
                    f"; {report.seconds:.1f} s -> {report.out}"))
    if report.rejected_total and not check:
        lines.append(f"the rejected files, each with its reason: {Path(report.out) / REJECTED_NAME}")
    return "\n".join(lines)
