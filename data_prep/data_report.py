"""The data report of `leaflens preprocess`: what in the photos would silently spoil a model, and what to do.

Checked on the labelled photos the dataset would hold (unlabelled ones have no class to spoil):

- duplicates, exact (same bytes) and near (perceptual hash within ``NEAR_THRESHOLD`` bits:
  :mod:`leaflens.data_prep.near_dup`), grouped: within a class and split (the photo weighs twice),
  within a class across splits (leakage: a validation or test photo the model has seen in training,
  counted per split pair), across classes (label conflicts: the same picture filed under two classes);
- photos per class and per split, and the imbalance (largest / smallest class);
- the shortcut check (:mod:`leaflens.data_prep.shortcut`): whether the metadata (size, format, EXIF, camera...) alone
  predict the class;
- photos a served model refuses before it looks (:func:`leaflens.data_prep.quality.served_refusal`: under
  32 px on a side, one flat colour, no fine detail anywhere): kept, since the user may know better, but
  named, because a lens-cap frame or a blurred thumbnail under a disease teaches the model nothing it will
  ever be asked.

``--dedupe`` removes the duplicates: of each group within one class it keeps one copy, the one in the
earliest split (train < val < test; then the first file), so training keeps its photo and val/test lose
the copies the model would have seen. A label conflict has no right copy to keep: leaving one would
silently pick a class for the user, so every copy of it goes, with a warning naming the files to check.
What it removed is recorded here (and, as every photo left out, in rejected.jsonl).

The report is written as ``data_report.json`` (:class:`DataReport`) beside the arrays, printed by
:func:`format_data_report`, and shown in the distill run's report.md.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from leaflens.data_prep.near_dup import COLOUR_GRID, COLOUR_THRESHOLD, NEAR_THRESHOLD, NearGroup
from leaflens.data_prep.quality import MIN_SIDE
from leaflens.data_prep.shortcut import FEATURES, PhotoMeta, ShortcutResult, check_shortcuts
from leaflens.data_prep.split import SPLIT_ORDER
from leaflens.records import Record, RecordError

__all__ = ["DATA_REPORT_NAME", "IMBALANCE_WARN", "CheckedPhotos", "DataReport", "NotJudgedPhoto",
           "format_data_report", "read_data_report", "run_checks"]

DATA_REPORT_NAME = "data_report.json"
_NOT_JUDGED = {"too_small": f"under {MIN_SIDE} px on a side", "uniform": "one flat colour",
               "low_texture": "no fine detail"}
IMBALANCE_WARN = 5.0  # largest / smallest class above this: a warning
_LISTED = 5  # files named per finding on the console (data_report.json has them all)


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True)
class NotJudgedPhoto(Record):
    """A kept labelled photo that a served model would refuse before looking at it."""

    file: str
    class_name: str
    split: str
    reason: str  # "too_small", "uniform" or "low_texture" (leaflens.data_prep.quality)


@dataclass(frozen=True)
class DuplicatePhoto(Record):
    """One copy in a duplicate group."""

    file: str
    class_name: str
    split: str


@dataclass(frozen=True)
class DuplicateGroup(Record):
    """Photos linked as copies. ``kind``: "exact" when every copy has the same bytes; ``scope``: where the
    copies are (one class and split, one class across splits, or different classes); ``distance``: the
    largest hash distance (bits) of a linked pair."""

    kind: Literal["exact", "near"]
    scope: Literal["within_split", "across_splits", "across_classes"]
    distance: int
    photos: tuple[DuplicatePhoto, ...]


@dataclass(frozen=True)
class LookAlikePair(Record):
    """Two photos alike in grey shapes (``bits`` apart) but not in colour (``colour`` grey levels apart):
    counted as different photos, listed for a look (a copy edited in colour would be one)."""

    photos: tuple[DuplicatePhoto, DuplicatePhoto]
    bits: int
    colour: float


@dataclass(frozen=True)
class DuplicateFindings(Record):
    """Duplicate groups among the dataset's labelled photos (before ``--dedupe`` removed any)."""

    method: str
    threshold: int
    within_split: int  # groups inside one class and one split
    across_splits: int  # groups of one class spanning splits
    label_conflicts: int  # groups spanning classes
    extra_copies: int  # photos beyond the first of each within-split group
    leakage: dict[str, int]  # "train-val" etc.: photos of the later split with a copy in the earlier one
    exact_dropped_across_splits: int  # byte-identical copies already left out of later given splits
    groups: tuple[DuplicateGroup, ...]
    colour_threshold: float | None = None  # None: grey shapes alone (reports written before the colour check)
    look_alike_pairs: int = 0  # pairs within the bits whose colours differ: not copies
    look_alikes: tuple[LookAlikePair, ...] = ()  # the first of them


@dataclass(frozen=True)
class ClassBalance(Record):
    """Photos per class (and per split) in the dataset; ``ratio`` = largest / smallest class."""

    per_class: dict[str, int]
    per_split: dict[str, dict[str, int]]
    largest: str
    smallest: str
    ratio: float | None  # None when a class has no photo left
    warn_above: float


@dataclass(frozen=True)
class ShortcutCheck(Record):
    """How well the metadata alone predicts the class (see leaflens.data_prep.shortcut)."""

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"skipped", "one_class"})
    features: tuple[str, ...]
    balanced_accuracy: float | None = None
    chance: float | None = None
    warn_at: float | None = None
    null_sd: float | None = None  # the noise allowance behind warn_at
    per_feature: dict[str, float] | None = None  # each feature alone (computed when the warning is due)
    flagged: tuple[str, ...] = ()
    folds: int | None = None
    evidence: dict[str, str] | None = None
    formats: dict[str, dict[str, int]] | None = None  # class -> decoded format -> photos
    skipped: str | None = None
    one_class: str | None = None  # the metadata tells this class from the rest (scored as two labels)


@dataclass(frozen=True)
class Removal(Record):
    """A photo ``--dedupe`` left out: a copy of ``kept``, or (label conflict, ``kept`` None) one of a
    picture filed under several classes."""

    file: str
    class_name: str
    split: str
    reason: Literal["duplicate", "label_conflict"]
    kept: str | None


@dataclass(frozen=True, kw_only=True)
class DataReport(Record):
    """data_report.json."""

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"refused"})
    SCHEMA_VERSION: ClassVar[int | None] = 1
    schema_version: int = 1
    source: str
    layout: str
    mode: Literal["preprocess", "check"]
    decode_size: int  # pixels the hashes were computed from (the stored size; smaller with --check)
    photos: int  # labelled photos checked
    classes: tuple[str, ...]
    balance: ClassBalance
    duplicates: DuplicateFindings
    shortcut: ShortcutCheck
    dedupe: bool
    removed: tuple[Removal, ...]
    warnings: tuple[str, ...]
    seconds: float  # what the checks cost (see leaflens.data_prep.ingest: checks_seconds)
    # unlabelled photos that are copies of validation or test photos ("unlabelled = held-out (split)")
    unlabeled_copies: tuple[str, ...] = ()
    # labelled photos a served model would refuse (too small, uniform, no detail); () in reports made before
    not_judged: tuple[NotJudgedPhoto, ...] = ()
    # why preprocess refused this data (a report written with --report for a refused run); absent when it did not
    refused: str | None = None


# ---------------------------------------------------------------------------- the checks
@dataclass
class CheckedPhotos:
    """The labelled photos of a dataset, row-aligned: recorded path, label, split, SHA-256, metadata."""

    files: list[str]
    labels: np.ndarray
    splits: list[str]
    digests: list[bytes]
    metas: list[PhotoMeta]
    refusals: list[str | None] = field(default_factory=list)  # per photo, or empty: not checked

    def __len__(self) -> int:
        return len(self.files)


def _split_rank(split: str) -> int:
    return SPLIT_ORDER.index(split) if split in SPLIT_ORDER else len(SPLIT_ORDER)


def _groups(photos: CheckedPhotos, linked: Sequence[NearGroup],
            classes: Sequence[str]) -> list[tuple[list[int], DuplicateGroup]]:
    out = []
    for group in linked:
        m = list(group.members)
        labels = {int(photos.labels[k]) for k in m}
        splits = {photos.splits[k] for k in m}
        scope: Literal["within_split", "across_splits", "across_classes"] = (
            "across_classes" if len(labels) > 1 else "across_splits" if len(splits) > 1 else "within_split")
        exact = len({photos.digests[k] for k in m}) == 1
        shown = tuple(DuplicatePhoto(photos.files[k], classes[int(photos.labels[k])], photos.splits[k])
                      for k in sorted(m, key=lambda k: (_split_rank(photos.splits[k]), k)))
        out.append((m, DuplicateGroup("exact" if exact else "near", scope, 0 if exact else group.distance, shown)))
    return out


def _leakage(groups: list[tuple[list[int], DuplicateGroup]]) -> dict[str, int]:
    """Per split pair (earlier-later): photos of the later split with a copy in the earlier one."""
    out: dict[str, int] = {}
    for _, g in groups:
        in_split: dict[str, int] = {}
        for p in g.photos:
            in_split[p.split] = in_split.get(p.split, 0) + 1
        order = sorted(in_split, key=_split_rank)
        for a_i, a in enumerate(order):
            for b in order[a_i + 1:]:
                out[f"{a}-{b}"] = out.get(f"{a}-{b}", 0) + in_split[b]
    return dict(sorted(out.items(), key=lambda kv: tuple(_split_rank(s) for s in kv[0].split("-"))))


def _dedupe(photos: CheckedPhotos, groups: list[tuple[list[int], DuplicateGroup]],
            classes: Sequence[str]) -> list[tuple[int, Removal]]:
    removed = []
    for m, g in groups:
        order = sorted(m, key=lambda k: (_split_rank(photos.splits[k]), k))
        keep = None if g.scope == "across_classes" else order[0]
        for k in order:
            if k == keep:
                continue
            removed.append((k, Removal(photos.files[k], classes[int(photos.labels[k])], photos.splits[k],
                                       "label_conflict" if keep is None else "duplicate",
                                       None if keep is None else photos.files[keep])))
    return sorted(removed, key=lambda kr: kr[0])


def _balance(photos: CheckedPhotos, keep: np.ndarray, classes: Sequence[str]) -> ClassBalance:
    per_class = {c: 0 for c in classes}
    per_split: dict[str, dict[str, int]] = {}
    for k in np.flatnonzero(keep):
        c = classes[int(photos.labels[k])]
        per_class[c] += 1
        split = per_split.setdefault(photos.splits[k], {n: 0 for n in classes})
        split[c] += 1
    largest = max(classes, key=lambda c: per_class[c])
    smallest = min(classes, key=lambda c: per_class[c])
    ratio = round(per_class[largest] / per_class[smallest], 2) if per_class[smallest] else None
    per_split = {s: per_split[s] for s in sorted(per_split, key=_split_rank)}
    return ClassBalance(per_class, per_split, largest, smallest, ratio, IMBALANCE_WARN)


def _shortcut(photos: CheckedPhotos, keep: np.ndarray, classes: Sequence[str], seed: int) -> ShortcutCheck:
    rows = np.flatnonzero(keep)
    metas = [photos.metas[k] for k in rows]
    labels = photos.labels[rows]
    formats: dict[str, dict[str, int]] = {}
    for m, y in zip(metas, labels):
        per = formats.setdefault(classes[int(y)], {})
        per[m.format] = per.get(m.format, 0) + 1
    result = check_shortcuts(metas, labels, classes, seed=seed)
    if isinstance(result, str):
        return ShortcutCheck(FEATURES, formats=formats, skipped=result)
    return _from_result(result, formats)


def _from_result(r: ShortcutResult, formats: dict[str, dict[str, int]]) -> ShortcutCheck:
    return ShortcutCheck(FEATURES, r.balanced_accuracy, r.chance, r.warn_at, r.null_sd,
                         r.per_feature or None, r.flagged, r.folds,
                         {k: v for k, v in r.evidence.items() if k in r.flagged} or None, formats,
                         one_class=r.one_class)


def _one_per_class_first(photos: Sequence[DuplicatePhoto]) -> list[DuplicatePhoto]:
    """A label conflict's photos with one of each class first, so that the few listed show the classes."""
    first: list[DuplicatePhoto] = []
    for p in photos:
        if all(p.class_name != q.class_name for q in first):
            first.append(p)
    return first + [p for p in photos if all(p is not q for q in first)]


def _names(photos: Sequence[DuplicatePhoto], limit: int = _LISTED) -> str:
    shown = [f"{p.file} ({p.split})" for p in photos[:limit]]
    return " = ".join(shown) + (f" (+{len(photos) - limit} more)" if len(photos) > limit else "")


_SHORTCUT_ADVICE = {
    "file format": "re-save every photo in one format (e.g. all as JPEG at one quality), so that compression "
                   "artefacts do not tell the classes apart",
    "format vs extension": "re-save every photo in one format under its proper extension",
    "image size": "the model sees the sharpness and framing that come with a photo's size: use photos of "
                  "similar resolution for every class",
    "aspect ratio": "the photos are framed differently per class: crop them alike",
    "EXIF": "take camera originals (or copies) alike for every class: removing the EXIF would hide the "
            "difference, not fix it",
    "camera": "photograph every class with the same phones or cameras (or mix them alike across the classes)",
    "EXIF orientation": "hold the phone alike for every class, or rotate the photos to upright and save them "
                        "without the orientation tag",
    "colour mode": "save every photo in colour (RGB)",
    "JPEG quality": "re-save every photo at one JPEG quality, so that compression artefacts do not tell the "
                    "classes apart",
}


def _n(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _not_judged_warning(photos: Sequence[NotJudgedPhoto]) -> str:
    kinds = ", ".join(f"{_NOT_JUDGED[r]} {n}" for r, n in sorted(Counter(p.reason for p in photos).items()))
    listed = ", ".join(f"{p.file} ({p.class_name})" for p in photos[:_LISTED])
    more = f" (+{len(photos) - _LISTED} more in {DATA_REPORT_NAME})" if len(photos) > _LISTED else ""
    return (f"photos the app would not judge: {_n(len(photos), 'labelled photo')} ({kinds}): {listed}{more}; a "
            "served model refuses such photos before it looks, so under a class they teach it nothing it will be "
            "asked; remove them (lens-cap or blank frames, blurred shots, thumbnails) or replace them with the "
            "original photos")


def _warnings(d: DuplicateFindings, balance: ClassBalance, shortcut: ShortcutCheck, removed: Sequence[Removal],
              dedupe: bool, not_judged: Sequence[NotJudgedPhoto] = ()) -> list[str]:
    out: list[str] = []
    conflicts = [g for g in d.groups if g.scope == "across_classes"]
    if conflicts:
        listed = "; ".join(_names(_one_per_class_first(g.photos)) for g in conflicts[:_LISTED])
        more = f" (+{len(conflicts) - _LISTED} more in data_report.json)" if len(conflicts) > _LISTED else ""
        if dedupe:
            n = sum(1 for r in removed if r.reason == "label_conflict")
            out.append(f"label conflict: {_n(len(conflicts), 'photo')} filed under different classes; all {n} copies "
                       f"were left out (--dedupe cannot know which class is right): {listed}{more}; check them and "
                       "put each back under its right class only")
        else:
            out.append(f"label conflict: {_n(len(conflicts), 'photo')} filed under different classes: {listed}{more}; "
                       "keep each under its right class only (--dedupe leaves every copy out)")
    leaked = sum(d.leakage.values())
    if leaked and not dedupe:
        pairs = ", ".join(f"{k} {v}" for k, v in d.leakage.items())
        out.append(f"leakage: {_n(leaked, 'photo')} of a later split with a copy in an earlier one ({pairs}): "
                   "the model is judged on photos it has seen, so its accuracy is inflated; remove the copies "
                   "or run with --dedupe (keeps the copy in the earliest split)")
    if d.within_split and not dedupe:
        example = next(g for g in d.groups if g.scope == "within_split")
        out.append(f"duplicates: {_n(d.within_split, 'group')} of copies within a split "
                   f"({_n(d.extra_copies, 'extra photo')}, e.g. {_names(example.photos, 3)}): they count twice "
                   "in training or in the scores; remove the duplicates or run with --dedupe")
    # a class with no usable photo at all is refused with its reasons (ingest), not weighed as imbalance
    if (balance.ratio is None or balance.ratio > balance.warn_above) and balance.per_class.get(balance.smallest):
        big, small = balance.per_class[balance.largest], balance.per_class[balance.smallest]
        times = "all" if balance.ratio is None else f"{balance.ratio:g} times"
        out.append(f"class imbalance: '{balance.largest}' has {times} the photos of '{balance.smallest}' "
                   f"({big} against {small}; warning above {balance.warn_above:g}): the model will lean towards the "
                   f"large classes; gather more photos of '{balance.smallest}' (or expect a lower recall on it: "
                   "see the per-class table of the run report)")
    if shortcut.flagged:
        found = shortcut.evidence or {}
        evidence = "; ".join(found[f] for f in shortcut.flagged if f in found)
        advice = "; ".join(_SHORTCUT_ADVICE[f] for f in shortcut.flagged)
        told = "the class" if shortcut.one_class is None else f"'{shortcut.one_class}' from the other classes"
        verb = "predicts" if len(shortcut.flagged) == 1 else "predict"
        out.append(f"shortcut: {' and '.join(shortcut.flagged)} alone {verb} {told} (balanced accuracy "
                   f"{shortcut.balanced_accuracy:.2f} against {shortcut.chance:.2f} by chance): the model may learn "
                   f"the source of the photos instead of the disease. {evidence}. What to do: {advice}; or gather "
                   "the photos of every class from the same sources and cameras")
    if not_judged:
        out.append(_not_judged_warning(not_judged))
    return out


def run_checks(photos: CheckedPhotos, linked: Sequence[NearGroup], classes: Sequence[str], *,
               dedupe: bool, seed: int, source: str, layout: str, mode: Literal["preprocess", "check"],
               decode_size: int, exact_dropped: int = 0,
               look_alikes: Sequence[tuple[int, int, int, float]] = (),
               look_alike_pairs: int = 0) -> tuple[DataReport, list[int]]:
    """The data report of ``photos`` (``linked``: their groups of exact or near copies, from
    :func:`leaflens.data_prep.near_dup.find_copies`; ``look_alikes``: its look-alike pairs as rows of
    ``photos``, bits and colour distance, ``look_alike_pairs`` how many there are in all) and, with
    ``dedupe``, the rows to remove. ``seconds`` is left 0 for the caller to fill."""
    groups = _groups(photos, linked, classes)
    plain = [g for _, g in groups]

    def shown(k: int) -> DuplicatePhoto:
        return DuplicatePhoto(photos.files[k], classes[int(photos.labels[k])], photos.splits[k])

    findings = DuplicateFindings(
        method=f"pHash of the decoded {decode_size} px photo (and of its centre cropped 3 and 6 % per side); "
               f"near: within {NEAR_THRESHOLD} of 64 bits and, in colour ({COLOUR_GRID}x{COLOUR_GRID} grid), "
               f"within {COLOUR_THRESHOLD:g} grey levels",
        threshold=NEAR_THRESHOLD,
        within_split=sum(1 for g in plain if g.scope == "within_split"),
        across_splits=sum(1 for g in plain if g.scope == "across_splits"),
        label_conflicts=sum(1 for g in plain if g.scope == "across_classes"),
        extra_copies=sum(len(g.photos) - 1 for g in plain if g.scope == "within_split"),
        leakage=_leakage(groups), exact_dropped_across_splits=exact_dropped, groups=tuple(plain),
        colour_threshold=COLOUR_THRESHOLD, look_alike_pairs=look_alike_pairs,
        look_alikes=tuple(LookAlikePair((shown(a), shown(b)), bits, colour) for a, b, bits, colour in look_alikes))
    removals = _dedupe(photos, groups, classes) if dedupe else []
    keep = np.ones(len(photos), bool)
    keep[[k for k, _ in removals]] = False
    balance = _balance(photos, keep, classes)
    shortcut = _shortcut(photos, keep, classes, seed)
    removed = tuple(r for _, r in removals)
    not_judged = tuple(NotJudgedPhoto(photos.files[k], classes[int(photos.labels[k])], photos.splits[k], why)
                       for k, why in enumerate(photos.refusals) if why is not None and keep[k])
    report = DataReport(source=source, layout=layout, mode=mode, decode_size=decode_size, photos=len(photos),
                        classes=tuple(classes), balance=balance, duplicates=findings, shortcut=shortcut,
                        dedupe=dedupe, removed=removed,
                        warnings=tuple(_warnings(findings, balance, shortcut, removed, dedupe, not_judged)),
                        seconds=0.0, not_judged=not_judged)
    return report, [k for k, _ in removals]


def read_data_report(root: str | os.PathLike) -> dict[str, Any] | None:
    """The ``data_report.json`` of the dataset folder ``root`` as a dict (None when absent: datasets
    built before it existed). An unreadable one gives ``{"error": why}``, so a run report says so
    instead of failing after training."""
    path = Path(root) / DATA_REPORT_NAME
    if not path.is_file():
        return None
    try:
        return DataReport.from_dict(json.loads(path.read_text(encoding="utf-8")), str(path)).to_dict()
    except RecordError as exc:  # names the file and the key
        return {"error": str(exc)}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return {"error": f"{path}: {exc}"}


# ---------------------------------------------------------------------------- console
def format_data_report(report: DataReport) -> str:
    """The console summary: counts per finding, then every warning (``warning: ...``)."""
    b, d, s = report.balance, report.duplicates, report.shortcut
    per_class = ", ".join(f"{c} {n}" for c, n in b.per_class.items())
    ratio = "a class has no photo" if b.ratio is None else f"largest/smallest {b.ratio:g}"
    lines = [f"data checks on {report.photos} labelled photos ({report.seconds:.1f} s):",
             f"  photos per class: {per_class} ({ratio})"]
    leak = ", ".join(f"{k} {v}" for k, v in d.leakage.items()) or "none"
    alike = " and alike in colour" if d.colour_threshold is not None else ""
    lines.append(f"  duplicates (exact or within {d.threshold} bits{alike}): {_n(d.within_split, 'group')} within "
                 f"a split, {d.across_splits} across splits, {_n(d.label_conflicts, 'label conflict')}; leakage per "
                 f"split pair: {leak}"
                 + (f"; {d.exact_dropped_across_splits} exact copies in later splits already left out"
                    if d.exact_dropped_across_splits else ""))
    if d.look_alike_pairs:
        first = d.look_alikes[0] if d.look_alikes else None
        example = f", e.g. {first.photos[0].file} ~ {first.photos[1].file}" if first else ""
        lines.append(f"  look-alikes: {_n(d.look_alike_pairs, 'pair')} of photos alike in grey shapes but not in colour"
                     f"{example}: counted as different photos (a copy edited in colour would be one: "
                     f"{DATA_REPORT_NAME} lists them)")
    if s.skipped:
        lines.append(f"  shortcut check: skipped ({s.skipped})")
    else:
        which = "" if s.one_class is None else f" of '{s.one_class}' against the other classes"
        lines.append(f"  shortcut check ({', '.join(s.features)} alone): "
                     f"balanced accuracy{which} {s.balanced_accuracy:.2f}, chance {s.chance:.2f}, warning from "
                     f"{s.warn_at:.2f}")
    if report.dedupe:
        dup = sum(1 for r in report.removed if r.reason == "duplicate")
        lines.append(f"  --dedupe {'would remove' if report.mode == 'check' else 'removed'} {_n(dup, 'duplicate')} "
                     f"and {_n(len(report.removed) - dup, 'label-conflict copy', 'label-conflict copies')} "
                     + (f"of labelled photos, and {_n(len(report.unlabeled_copies), 'unlabelled photo')} copying "
                        "validation or test photos " if report.unlabeled_copies else "")
                     + f"(listed in {DATA_REPORT_NAME})")
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)
