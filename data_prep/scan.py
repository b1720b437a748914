"""Find the photos of a dataset folder and work out its layout.

Two layouts are accepted: ``ROOT/<class>/*`` (split later, stratified) and
``ROOT/{train,val,test}/<class>/*`` (split as given). In both, ``ROOT/unlabeled/`` (or a separate
folder passed as ``unlabeled``) holds photos without labels. Class folders may contain subfolders.
Hidden files and folders and files whose extension is not an image's are ignored and counted.
Everything is returned in a sorted, deterministic order.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".heic", ".heif"})
SPLITS = ("train", "val", "test")
UNLABELED = "unlabeled"
# Folder names accepted for each split in the split layout (case-insensitive).
_SPLIT_ALIASES = {"train": "train", "training": "train", "val": "val", "valid": "val",
                  "validation": "val", "test": "test", "testing": "test"}


class ScanError(ValueError):
    """The source folder cannot be used (missing, empty, ambiguous layout)."""


@dataclass(frozen=True)
class SourceFile:
    """One candidate photo: absolute path, path as recorded, label (-1: unlabeled), given split."""

    path: str
    rel: str
    label: int
    split: str | None  # "train"/"val"/"test" in the split layout, "unlabeled", or None (auto split)


@dataclass
class ScanResult:
    root: str
    layout: str  # "class_folders" or "split_folders"
    classes: list[str]
    files: list[SourceFile]
    ignored: dict[str, int] = field(default_factory=dict)
    stats_digest: str = ""  # SHA-256 over (path, size, mtime_ns, label, split) of every file, in order


def _visible_dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _walk_images(folder: Path, root: Path, ignored: dict[str, int]) -> list[tuple[str, str]]:
    """(absolute path, recorded path) of every image under ``folder``, sorted; counts what is skipped."""
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        hidden_dirs = [d for d in dirnames if d.startswith(".")]
        if hidden_dirs:
            ignored["hidden"] = ignored.get("hidden", 0) + len(hidden_dirs)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                ignored["hidden"] = ignored.get("hidden", 0) + 1
                continue
            if os.path.splitext(name)[1].lower() not in IMAGE_EXTENSIONS:
                ignored["not_image"] = ignored.get("not_image", 0) + 1
                continue
            full = os.path.join(dirpath, name)
            try:
                rel = Path(full).relative_to(root).as_posix()
            except ValueError:
                rel = os.path.abspath(full)
            found.append((os.path.abspath(full), rel))
    return found


def _count_loose_files(path: Path, ignored: dict[str, int]) -> None:
    loose = [p for p in path.iterdir() if p.is_file()]
    if loose:
        ignored["outside_class_folders"] = ignored.get("outside_class_folders", 0) + len(loose)


def scan_source(root: str | os.PathLike, unlabeled: str | os.PathLike | None = None) -> ScanResult:
    """List the photos under ``root`` (and the optional separate ``unlabeled`` folder)."""
    root_p = Path(root).resolve()
    if not root_p.is_dir():
        raise ScanError(f"source folder {root_p} does not exist or is not a folder")
    ignored: dict[str, int] = {}
    top = _visible_dirs(root_p)
    _count_loose_files(root_p, ignored)
    split_dirs = {d: _SPLIT_ALIASES[d.name.lower()] for d in top if d.name.lower() in _SPLIT_ALIASES}
    unlabeled_dirs = [d for d in top if d.name.lower() == UNLABELED]
    others = [d for d in top if d not in split_dirs and d.name.lower() != UNLABELED]

    per_class: list[tuple[str, str | None, str, str]] = []  # (class, split, abs, rel)
    if split_dirs:
        if others:
            raise ScanError(
                f"{root_p}: found split folders ({', '.join(sorted(d.name for d in split_dirs))}) next to "
                f"other folders ({', '.join(d.name for d in others)}); use either ROOT/<class>/ or "
                "ROOT/{train,val,test}/<class>/"
            )
        seen = sorted(split_dirs.values())
        if len(seen) != len(set(seen)):
            names = sorted(d.name for d in split_dirs)
            raise ScanError(f"{root_p}: two folders name the same split: {names}")
        layout = "split_folders"
        for d, split in sorted(split_dirs.items(), key=lambda kv: SPLITS.index(kv[1])):
            _count_loose_files(d, ignored)
            for cdir in _visible_dirs(d):
                for full, rel in _walk_images(cdir, root_p, ignored):
                    per_class.append((cdir.name, split, full, rel))
    else:
        layout = "class_folders"
        for cdir in others:
            for full, rel in _walk_images(cdir, root_p, ignored):
                per_class.append((cdir.name, None, full, rel))

    classes = sorted({c for c, _, _, _ in per_class})
    if not classes:
        raise ScanError(f"{root_p}: no class folders with images found (expected ROOT/<class>/*.jpg)")
    index = {c: i for i, c in enumerate(classes)}
    files = [SourceFile(full, rel, index[c], split) for c, split, full, rel in per_class]

    extra = list(unlabeled_dirs)
    if unlabeled is not None:
        u = Path(unlabeled).resolve()
        if not u.is_dir():
            raise ScanError(f"unlabeled folder {u} does not exist or is not a folder")
        if u not in extra:
            extra.append(u)
    for udir in extra:
        for full, rel in _walk_images(udir, root_p, ignored):
            files.append(SourceFile(full, rel, -1, UNLABELED))

    digest = hashlib.sha256()
    for f in files:  # hashed as we go: no per-file list kept in memory
        st = os.stat(f.path)
        digest.update(f"{f.rel}\0{st.st_size}\0{st.st_mtime_ns}\0{f.label}\0{f.split}\n".encode())
    return ScanResult(str(root_p), layout, classes, files, ignored, digest.hexdigest())
