"""Folder of photos -> dataset folder of memory-mapped arrays (what `leaflens preprocess` runs).

Steps: scan the source (:mod:`leaflens.data_prep.scan`), decode every photo in a process pool with the
preprocessing contract's decode step (:mod:`leaflens.data_prep.contract`) and stream the pixels into a
staging file, assign splits (stratified, seeded, duplicate-aware: :mod:`leaflens.data_prep.split`), stream
the staging rows into ``<split>_images.npy`` / ``<split>_labels.npy`` / ``<split>_files.txt``, compute
mean/std on train from exact per-channel histograms, write ``rejected.jsonl`` and ``manifest.json``, and
rename the finished temporary folder into place. A broken file is rejected with its reason and never
stops the run; an interrupted run leaves the previous output untouched; an unchanged input re-run does
no work.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from leaflens.cpus import usable_cpus
from leaflens.data_prep.arrays import NpyRowWriter, sha256_file
from leaflens.data_prep.contract import decode_stored
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
from leaflens.data_prep.scan import SPLITS, UNLABELED, ScanResult, SourceFile, scan_source
from leaflens.data_prep.split import MIN_PER_CLASS, assign_auto, resolve_given
from leaflens.files import clean_stale_temps, new_temp_dir, swap_into_place, write_json_atomic

_STAGING = "staging.bin"
CLASS_INFO_NAME = "classes.toml"  # optional per-class display names/advice next to the photos
_CHUNK_ROWS = 256


class IngestError(RuntimeError):
    """The ingest cannot produce a dataset (bad source, nothing kept, unsafe output folder)."""


@dataclass
class IngestReport:
    """What a run did, for the CLI summary and for tests."""

    out: Path
    up_to_date: bool
    classes: list[str]
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # split -> class -> kept
    rejected: dict[str, int] = field(default_factory=dict)  # class (or "unlabeled") -> rejected
    rejected_reasons: dict[str, int] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def kept_total(self) -> int:
        return sum(sum(v.values()) for v in self.counts.values())

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


# ---------------------------------------------------------------------------- decoding workers
def _decode_task(task: tuple[int, str, int, str, int]) -> tuple[int, bytes | None, np.ndarray | None,
                                                                str | None, str | None]:
    """Worker: (index, path, size, resize, max_pixels) -> (index, sha256, pixels, reason, detail)."""
    index, path, size, resize, max_pixels = task
    try:
        data = read_source(path)
        digest = hashlib.sha256(data).digest()
        try:
            pixels = decode_stored(data, size, resize, max_pixels)  # the contract's step 1, as the Predictor's
        except ImageDecodeError as exc:
            return index, digest, None, exc.reason, exc.detail
        return index, digest, pixels, None, None
    except ImageDecodeError as exc:
        return index, None, None, exc.reason, exc.detail
    except Exception as exc:  # one odd file must never stop the run
        return index, None, None, "error", f"{type(exc).__name__}: {exc}"


def _decode_all(files: list[SourceFile], opts: IngestOptions, staging: Path, workers: int,
                progress: bool) -> tuple[list[int], list[bytes], list[dict]]:
    """Decode every file, streaming kept pixels into ``staging``; returns kept idx, sha256 digests, rejects."""
    from tqdm import tqdm

    total = len(files)
    kept: list[int] = []
    hashes: list[bytes] = []
    rejects: list[dict] = []
    bar = tqdm(total=total, desc="decode", unit="img", disable=not progress, file=sys.stderr)
    pool = None
    try:
        if workers > 1 and total > 1:
            pool = multiprocessing.get_context().Pool(workers)
        window = max(64, workers * 128)  # bounded in-flight results: memory stays flat
        chunksize = max(1, min(32, total // (workers * 8) or 1))
        with open(staging, "wb") as out:
            for start in range(0, total, window):
                block = [(i, files[i].path, opts.size, opts.resize, opts.max_pixels)
                         for i in range(start, min(total, start + window))]
                results = pool.imap(_decode_task, block, chunksize) if pool else map(_decode_task, block)
                for index, digest, pixels, reason, detail in results:
                    if pixels is None or digest is None:  # pixels only ever come with the file's digest
                        f = files[index]
                        rejects.append({"path": f.rel, "label": f.label, "split": f.split,
                                        "reason": reason, "detail": detail})
                    else:
                        out.write(pixels.tobytes())
                        kept.append(index)
                        hashes.append(digest)
                    bar.update(1)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return kept, hashes, rejects


# ---------------------------------------------------------------------------- splitting
def _assign(scan: ScanResult, kept: list[int], hashes: list[bytes], opts: IngestOptions,
            rejects: list[dict]) -> list[str | None]:
    """Split name per kept row (None: dropped as a cross-split duplicate, added to ``rejects``)."""
    files = scan.files
    out: list[str | None] = [None] * len(kept)
    lab_rows = [r for r, i in enumerate(kept) if files[i].label >= 0]
    for r, i in enumerate(kept):
        if files[i].label < 0:
            out[r] = UNLABELED
    lab_hashes = [hashes[r] for r in lab_rows]
    if scan.layout == "split_folders":
        given = [_given_split(files[kept[r]]) for r in lab_rows]
        drop = set(resolve_given(given, lab_hashes))
        for k, r in enumerate(lab_rows):
            if k in drop:
                f = files[kept[r]]
                rejects.append({"path": f.rel, "label": f.label, "split": f.split,
                                "reason": "duplicate_across_splits",
                                "detail": "same bytes as a file in an earlier split"})
            else:
                out[r] = given[k]
    else:
        labels = [files[kept[r]].label for r in lab_rows]
        for r, s in zip(lab_rows, assign_auto(labels, lab_hashes, opts.ratios, opts.seed)):
            out[r] = s
    return out


def _check_class_sizes(scan: ScanResult, kept: list[int], assigned: list[str | None], strict: bool,
                       log: Callable[[str], None]) -> None:
    """Warn about (or with ``strict`` refuse) classes too small to have a photo in every split."""
    counts = dict.fromkeys(scan.classes, 0)
    for i, split in zip(kept, assigned):
        if split is not None and split != UNLABELED:
            counts[scan.classes[scan.files[i].label]] += 1
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


def _fingerprint(scan: ScanResult, opts: IngestOptions, unlabeled: str | None) -> str:
    payload = json.dumps({"format_version": FORMAT_VERSION, "options": opts.to_dict(), "root": scan.root,
                          "unlabeled": unlabeled, "classes": scan.classes, "files": scan.stats_digest},
                         sort_keys=True)
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


# ---------------------------------------------------------------------------- output folder safety
def _check_out(src: Path, out: Path) -> None:
    if out == src or src in out.parents:
        raise IngestError(f"output folder {out} must not be inside the source folder {src}")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_NAME).exists())):
        raise IngestError(f"output {out} exists and is not a leaflens dataset folder; refusing to replace it")


def _up_to_date(out: Path, fingerprint: str) -> bool:
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        if manifest.get("input_fingerprint") != fingerprint:
            return False
        load_dataset(out, verify=False)
    except (OSError, ValueError, DatasetError):
        return False
    return True


# ---------------------------------------------------------------------------- main entry
def ingest(src: str | os.PathLike, out: str | os.PathLike, options: IngestOptions | None = None, *,
           unlabeled: str | os.PathLike | None = None, workers: int | None = None, progress: bool = False,
           force: bool = False, strict: bool = False, log: Callable[[str], None] = print) -> IngestReport:
    """Turn the photo folder ``src`` into the dataset folder ``out`` (see module docstring).

    Data a model cannot be trained and judged on is refused with what to do: fewer than 2 classes, or
    a validation or test split left empty. Classes with fewer than ``MIN_PER_CLASS`` usable photos
    are listed as a warning (they cannot appear in every split), or refused with ``strict``.
    """
    t0 = time.perf_counter()
    opts = options or IngestOptions()
    if opts.size < 8:
        raise IngestError(f"image size {opts.size} is too small (need >= 8)")
    src_p, out_p = Path(src).resolve(), Path(out).resolve()
    scan = scan_source(src_p, unlabeled)
    if len(scan.classes) < 2:
        found = ", ".join(repr(c) for c in scan.classes) or "none"
        raise IngestError(f"{src_p}: {len(scan.classes)} class folder found ({found}); a classifier needs at least "
                          f"2 classes: put each class's photos in a folder of its own, e.g. {src_p / 'healthy'} and "
                          f"{src_p / 'rust'}")
    _check_out(src_p, out_p)
    unl = str(Path(unlabeled).resolve()) if unlabeled is not None else None
    fingerprint = _fingerprint(scan, opts, unl)
    if not force and _up_to_date(out_p, fingerprint):
        log(f"{out_p}: up to date ({len(scan.files)} source files unchanged, same options); nothing to do")
        return IngestReport(out_p, True, scan.classes, seconds=time.perf_counter() - t0)

    out_p.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out_p)
    tmp = new_temp_dir(out_p)
    try:
        workers = max(1, workers or usable_cpus())
        kept, hashes, rejects = _decode_all(scan.files, opts, tmp / _STAGING, workers, progress)
        assigned = _assign(scan, kept, hashes, opts, rejects)
        _check_class_sizes(scan, kept, assigned, strict, log)
        info, hist = _write_splits(tmp, scan, kept, assigned, opts)
        (tmp / _STAGING).unlink()
        if info["train"].count == 0:
            raise IngestError(f"{src_p}: no training image could be decoded ({len(rejects)} rejected); "
                              f"see the reasons above")
        empty = [s for s in ("val", "test") if info[s].count == 0]
        counts = ", ".join(f"{s} {info[s].count}" for s in SPLITS)
        asked_none = [s for s in empty if scan.layout != "split_folders" and opts.ratios[SPLITS.index(s)] == 0]
        if asked_none:  # the user's own --split: allowed, but distill will not train on it
            log(f"warning: no {' and '.join(asked_none)} photos, as --split asked ({counts}); "
                "`leaflens distill` needs both to choose and report a model")
            empty = [s for s in empty if s not in asked_none]
        if empty:
            raise IngestError(f"{src_p}: the {' and '.join(empty)} split would be empty ({counts} photos): a model "
                              "is chosen on val and reported on test. Add photos (at least "
                              f"{MIN_PER_CLASS} per class) or, for train/val/test folders, put some in "
                              f"{' and '.join(empty)}/; with class folders, --split must give val and test a share")
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
            source_root=scan.root, source_layout=scan.layout, unlabeled_source=unl, class_info=class_info,
            options=opts,
            rejected=RejectedInfo(total=len(rejects), per_class=report.rejected, reasons=report.rejected_reasons,
                                  list=REJECTED_NAME),
            ignored=scan.ignored, duplicates=_duplicate_stats(scan, kept, hashes), checksums=checksums,
            input_fingerprint=fingerprint)
        write_json_atomic(tmp / MANIFEST_NAME, manifest.with_self_digest().to_dict())
        swap_into_place(tmp, out_p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.seconds = time.perf_counter() - t0
    log(format_summary(report))
    return report


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
    return IngestReport(out, False, scan.classes, counts, rejected, reasons, dict(scan.ignored))


def format_summary(report: IngestReport) -> str:
    """A per-class table of kept (per split) and rejected images."""
    splits = [s for s in (*SPLITS, UNLABELED) if s in report.counts]
    keys = list(report.classes) + ([UNLABELED] if UNLABELED in report.counts else [])
    width = max([len(k) for k in keys] + [5])
    lines = [f"{'class':<{width}} " + " ".join(f"{s:>9}" for s in splits) + f" {'rejected':>9}"]
    for k in keys:
        cells = []
        for s in splits:
            cells.append(f"{report.counts[s].get(k, 0):>9}")
        lines.append(f"{k:<{width}} " + " ".join(cells) + f" {report.rejected.get(k, 0):>9}")
    lines.append(f"kept {report.kept_total}, rejected {report.rejected_total}"
                 + (f" ({', '.join(f'{r}: {n}' for r, n in sorted(report.rejected_reasons.items()))})"
                    if report.rejected_reasons else "")
                 + (f", ignored {', '.join(f'{k}: {n}' for k, n in sorted(report.ignored.items()))}"
                    if report.ignored else "")
                 + f"; {report.seconds:.1f} s -> {report.out}")
    return "\n".join(lines)
