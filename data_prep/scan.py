"""Find the photos of a dataset folder and work out its layout.

Two layouts are accepted: ``ROOT/<class>/*`` (split later, stratified) and
``ROOT/{train,val,test}/<class>/*`` (split as given). In both, ``ROOT/unlabeled/`` (or a separate
folder passed as ``unlabeled``) holds photos without labels. Class folders may contain subfolders.
Hidden files and folders and files whose extension is not an image's are ignored and counted.
Everything is returned in a sorted, deterministic order.

Extra labelled folders (``also``: `leaflens preprocess --also DIR`, e.g. the web app's corrections folder)
hold ``DIR/<class>/*`` for classes the source already has; their photos join those classes (in the
split-folder layout they join ``train``, so val and test stay as given). A class folder the source
does not have is refused: adding a class changes the model, which a folder of corrections should not
do by accident. ``DIR/not_a_leaf/`` (photos a person said show no leaf) is skipped and counted as
ignored ``not_a_leaf``: the classifier has no class for them. Loose files in ``DIR`` (the corrections
log) are not photos and are left alone.
"""

from __future__ import annotations

import errno
import hashlib
import os
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# .jfif and .jpe: JPEGs as Windows browsers and old cameras name them
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jfif", ".jpe", ".png", ".bmp", ".webp", ".tif", ".tiff", ".heic",
                              ".heif"})
SPLITS = ("train", "val", "test")
UNLABELED = "unlabeled"
NOT_A_LEAF = "not_a_leaf"  # an extra folder's "no leaf at all" photos (leaflens.apps.corrections): skipped
# Folder names accepted for each split in the split layout (case-insensitive).
_SPLIT_ALIASES = {"train": "train", "training": "train", "val": "val", "valid": "val",
                  "validation": "val", "test": "test", "testing": "test"}


class ScanError(ValueError):
    """The source folder cannot be used (missing, empty, ambiguous layout)."""


@dataclass(frozen=True)
class SourceFile:
    """One candidate photo: absolute path, path as recorded, label (-1: unlabeled), given split, and whether it
    came from an extra labelled folder (``--also``) rather than the source."""

    path: str
    rel: str
    label: int
    split: str | None  # "train"/"val"/"test" in the split layout, "unlabeled", or None (auto split)
    extra: bool = False


@dataclass
class ScanResult:
    root: str
    layout: str  # "class_folders" or "split_folders"
    classes: list[str]
    files: list[SourceFile]
    ignored: dict[str, int] = field(default_factory=dict)
    stats_digest: str = ""  # SHA-256 over (path, size, mtime_ns, label, split) of every file, in order
    # the same with every path relative to ``root`` (``../corrections/x.jpg``): unchanged when the project moves
    stats_digest_relative: str = ""
    also: list[str] = field(default_factory=list)  # extra labelled folders merged in (resolved paths)
    also_files: int = 0  # photos found in them (excluding not_a_leaf/)
    # extension -> files counted in ignored["not_image"] (".gif": 2), so a format we skip can be named
    not_image_extensions: dict[str, int] = field(default_factory=dict)
    # class folders (ROOT/<class>/ layout) with no image file in them: not classes, said by preprocess
    empty_folders: list[str] = field(default_factory=list)
    # class -> (subfolder, photos under it) for a class folder whose photos sit in two or more subfolders and
    # none beside them (ROOT/beans/{healthy,rust}/): one class made of what may be several, said by preprocess
    nested: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    # the files' paths (relative), sizes, labels and splits without their time stamps: when it differs from a
    # dataset's, the photos changed and their contents need not be read to know it
    listing_digest: str = ""

    def ignored_names(self) -> dict[str, list[str]]:
        """reason -> the first few files the scan left out for it (IgnoredFiles.examples), relative to the source
        folder where they are under it."""
        examples = getattr(self.ignored, "examples", {})
        return {reason: [relative_to(p, self.root) if Path(p).is_relative_to(self.root) else p for p in paths]
                for reason, paths in examples.items() if paths}


class IgnoredFiles(dict):
    """reason -> how many files a scan left out for it (what the manifest records), with the first few paths
    of each reason in ``examples``, so that the console can name them and not only count them."""

    MAX_EXAMPLES = 3

    def __init__(self) -> None:
        super().__init__()
        self.examples: dict[str, list[str]] = {}


def _count(ignored: dict[str, int], reason: str, n: int = 1, path: str | os.PathLike | None = None) -> None:
    ignored[reason] = ignored.get(reason, 0) + n
    examples = getattr(ignored, "examples", None)
    if examples is not None and path is not None and len(examples.setdefault(reason, [])) < IgnoredFiles.MAX_EXAMPLES:
        examples[reason].append(os.fspath(path))


def _visible_dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def walk_folder(folder: str | os.PathLike, ignored: dict[str, int] | None = None
                ) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(folder, followlinks=True)`` without its two traps: a folder it cannot read is a
    :class:`ScanError` naming it (``os.walk`` leaves it out without a word, and with it a whole class), and a
    linked folder already walked or above the current one (a link loop: ``ln -s .. up``) is not entered
    (counted in ``ignored["link_loop"]``), where ``os.walk`` would go round until the path is too long."""
    top = os.fspath(folder)

    def unreadable(err: OSError) -> None:
        inside = os.path.realpath(str(err.filename)) != os.path.realpath(top)
        raise ScanError(f"cannot read the folder {err.filename}: {err.strerror or err}; fix its permissions"
                        + (f" (or move it out of {top})" if inside else ""))

    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True, onerror=unreadable):
        real = os.path.realpath(dirpath)
        seen.add(real)
        keep = []
        for d in dirnames:
            target = os.path.realpath(os.path.join(dirpath, d))
            if target in seen or real == target or real.startswith(target.rstrip(os.sep) + os.sep):
                if ignored is not None:
                    _count(ignored, "link_loop", path=os.path.join(dirpath, d))
                continue
            keep.append(d)
        dirnames[:] = keep
        yield dirpath, dirnames, filenames


def _usable_name(full: str, ignored: dict[str, int]) -> bool:
    """Whether an image file found by a walk can be recorded: not a link to nothing, and a name that is text
    (a file name in another encoding than UTF-8 cannot be written to the dataset's file lists)."""
    if not os.path.exists(full):
        try:
            os.stat(full)
            reason = "broken_link"
        except OSError as exc:  # links that point at each other (ELOOP) are a loop, not a link to nothing
            reason = "link_loop" if exc.errno == errno.ELOOP else "broken_link"
        _count(ignored, reason, path=full)
        return False
    try:
        full.encode("utf-8")
    except UnicodeEncodeError:
        _count(ignored, "name_not_utf8", path=full.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
        return False
    return True


def _walk_images(folder: Path, root: Path, ignored: dict[str, int],
                 extensions: dict[str, int] | None = None) -> list[tuple[str, str]]:
    """(absolute path, recorded path) of every image under ``folder``, sorted; counts what is skipped (the
    extensions of the files that are not images in ``extensions``)."""
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in walk_folder(folder, ignored):
        hidden_dirs = [d for d in dirnames if d.startswith(".")]
        if hidden_dirs:
            _count(ignored, "hidden", len(hidden_dirs))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                _count(ignored, "hidden")
                continue
            ext = os.path.splitext(name)[1].lower()
            if ext not in IMAGE_EXTENSIONS:
                _count(ignored, "not_image")
                if extensions is not None:
                    extensions[ext or "no extension"] = extensions.get(ext or "no extension", 0) + 1
                continue
            full = os.path.join(dirpath, name)
            if not _usable_name(full, ignored):
                continue
            try:
                rel = Path(full).relative_to(root).as_posix()
            except ValueError:
                rel = os.path.abspath(full)
            found.append((os.path.abspath(full), rel))
    return found


# files beside the class folders that leaflens itself reads or writes there: not "ignored" (corrections.jsonl is the
# web app's log in its corrections folder, leaflens.apps.corrections.LOG_NAME, read by evaluate and --also)
_OWN_FILES = frozenset({"classes.toml", "classes.json", "synth.json", "corrections.jsonl"})


def _count_loose_files(path: Path, ignored: dict[str, int]) -> None:
    for p in path.iterdir():
        if p.is_file() and p.name not in _OWN_FILES and not p.name.startswith("."):
            _count(ignored, "outside_class_folders", path=p)


def _scan_also(folder: str | os.PathLike, root: Path, classes: list[str], split: str | None,
               ignored: dict[str, int], extensions: dict[str, int]) -> list[tuple[str, str | None, str, str]]:
    """(class, split, abs, rel) of the photos of one extra labelled folder (see the module docstring)."""
    d = Path(folder).resolve()
    if not d.is_dir():
        raise ScanError(f"--also folder {d} does not exist or is not a folder")
    if d == root or root in d.parents or d in root.parents:
        raise ScanError(f"--also folder {d} overlaps the source folder {root}; its photos would be counted twice "
                        "(and read as a class of their own without --also): move it out of the source folder, "
                        "e.g. beside it, and pass it with --also there")
    found: list[tuple[str, str | None, str, str]] = []
    unknown = []
    for cdir in _visible_dirs(d):
        name = cdir.name
        if name == NOT_A_LEAF:
            _count(ignored, NOT_A_LEAF, len(_walk_images(cdir, root, {})))
            continue
        if name.lower() in _SPLIT_ALIASES or name.lower() == UNLABELED:
            raise ScanError(f"--also folder {d}: found {name!r}; an extra folder holds class folders only "
                            f"({d}/<class>/*.jpg), merged into the source's splits")
        matched = matching_class(name, classes)
        if matched is None:
            unknown.append(name)
            continue
        found.extend((matched, split, full, rel) for full, rel in _walk_images(cdir, root, ignored, extensions))
    if unknown:
        raise ScanError(f"--also folder {d}: class folder(s) {', '.join(repr(u) for u in unknown)} are not classes "
                        f"of the source {root} ({', '.join(classes)}). Rename them to one of those, or add the "
                        "class to the source with enough photos of its own")
    for p in d.iterdir():  # loose photos have no class; other loose files (corrections.jsonl) are not photos
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS:
            _count(ignored, "outside_class_folders", path=p)
    return found


def scan_source(root: str | os.PathLike, unlabeled: str | os.PathLike | None = None,
                also: Sequence[str | os.PathLike] = ()) -> ScanResult:
    """List the photos under ``root``, of the extra labelled folders ``also`` (added to the source's
    classes, see the module docstring) and of the optional separate ``unlabeled`` folder."""
    root_p = Path(root).resolve()
    if not root_p.is_dir():
        raise ScanError(f"source folder {root_p} does not exist or is not a folder")
    ignored = IgnoredFiles()
    extensions: dict[str, int] = {}
    top = _visible_dirs(root_p)
    _count_loose_files(root_p, ignored)
    split_dirs = {d: _SPLIT_ALIASES[d.name.lower()] for d in top if d.name.lower() in _SPLIT_ALIASES}
    unlabeled_dirs = [d for d in top if d.name.lower() == UNLABELED]
    others = [d for d in top if d not in split_dirs and d.name.lower() != UNLABELED]

    per_class: list[tuple[str, str | None, str, str]] = []  # (class, split, abs, rel)
    empty: list[str] = []
    nested: dict[str, list[tuple[str, int]]] = {}

    def note_nesting(cdir: Path, found: list[tuple[str, str]]) -> None:
        subs: dict[str, int] = {}
        for full, _ in found:
            parts = Path(full).relative_to(cdir).parts
            if len(parts) == 1:
                return  # photos beside the subfolders: the folder is a class with sub-collections
            subs[parts[0]] = subs.get(parts[0], 0) + 1
        if len(subs) >= 2:  # a class of the split layout is seen once per split: its counts add up
            merged = dict(nested.get(cdir.name, []))
            for name, n in subs.items():
                merged[name] = merged.get(name, 0) + n
            nested[cdir.name] = sorted(merged.items())

    def check_class_name(cdir: Path) -> None:
        """A class folder named in another encoding than UTF-8 (a zip made on a Chinese-locale Windows: GBK)
        would lose every photo to the name check and the class with them, warned of as an empty folder."""
        try:
            cdir.name.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(cdir.name).decode("utf-8", "replace")
            raise ScanError(f"{cdir.parent}: the class folder {shown!r} has a name that is not UTF-8 text, so none "
                            "of its photos can be recorded and the class would be lost; rename it (convmv -f gbk -t "
                            "utf-8 converts a folder named on a Chinese-locale Windows)") from None

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
                check_class_name(cdir)
                found = _walk_images(cdir, root_p, ignored, extensions)
                note_nesting(cdir, found)
                per_class.extend((cdir.name, split, full, rel) for full, rel in found)
    else:
        layout = "class_folders"
        for cdir in others:
            check_class_name(cdir)
            found = _walk_images(cdir, root_p, ignored, extensions)
            if not found:
                empty.append(cdir.name)
            note_nesting(cdir, found)
            per_class.extend((cdir.name, None, full, rel) for full, rel in found)

    classes = sorted({c for c, _, _, _ in per_class})
    if not classes:
        raise ScanError(f"{root_p}: no class folders with images found (expected ROOT/<class>/*.jpg)")
    for i, a in enumerate(classes):
        for b in classes[i + 1:]:
            if same_name(a, b):
                raise ScanError(f"{root_p}: the class folders {a!r} and {b!r} have the same name written in two "
                                f"Unicode forms ({_code_points(a)} and {_code_points(b)}; macOS writes accented "
                                "letters decomposed): they would be two classes that look the same. Move the photos "
                                "of one into the other")
    index = {c: i for i, c in enumerate(classes)}
    files = [SourceFile(full, rel, index[c], split) for c, split, full, rel in per_class]
    also_roots: list[str] = []
    also_files = 0
    for folder in also:
        d = Path(folder).resolve()
        if any(d == Path(a) or Path(a) in d.parents or d in Path(a).parents for a in also_roots):
            raise ScanError(f"--also folder {d} is given twice, or inside another --also folder")
        labelled = _scan_also(folder, root_p, classes, "train" if layout == "split_folders" else None, ignored,
                               extensions)
        also_roots.append(str(d))
        also_files += len(labelled)
        files.extend(SourceFile(full, rel, index[c], split, extra=True) for c, split, full, rel in labelled)

    extra = list(unlabeled_dirs)
    if unlabeled is not None:
        u = Path(unlabeled).resolve()
        if not u.is_dir():
            raise ScanError(f"unlabeled folder {u} does not exist or is not a folder")
        if u not in extra and (u == root_p or root_p in u.parents or u in root_p.parents):
            raise ScanError(f"--unlabeled folder {u} overlaps the source folder {root_p}: its labelled photos would "
                            "be counted again as unlabelled ones (the source's own unlabeled/ folder is read anyway)")
        if u not in extra:
            extra.append(u)
    for udir in extra:
        for full, rel in _walk_images(udir, root_p, ignored, extensions):
            files.append(SourceFile(full, rel, -1, UNLABELED))

    digest, relative, listing = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    for f in files:  # hashed as we go: no per-file list kept in memory
        st = os.stat(f.path)
        stats = f"\0{st.st_size}\0{st.st_mtime_ns}\0{f.label}\0{f.split}\n"
        digest.update(f"{f.rel}{stats}".encode())
        relative.update(f"{relative_to(f.rel, root_p)}{stats}".encode())
        listing.update(f"{relative_to(f.rel, root_p)}\0{st.st_size}\0{f.label}\0{f.split}\n".encode())
    return ScanResult(str(root_p), layout, classes, files, ignored, digest.hexdigest(), relative.hexdigest(),
                      also_roots, also_files, extensions, empty, nested, listing.hexdigest())


def same_name(a: str, b: str) -> bool:
    """Whether two folder names are the same text: equal once both are in Unicode's composed form (NFC), as a
    name typed on Linux or Windows and the same name copied from macOS (which decomposes accents) are."""
    return unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b)


def matching_class(name: str, classes: Sequence[str]) -> str | None:
    """The class a folder called ``name`` is: the one of that exact name, else the one of the same name in
    another Unicode form (:func:`same_name`); None when there is none."""
    if name in classes:
        return name
    return next((c for c in classes if same_name(c, name)), None)


def _code_points(name: str) -> str:
    return " ".join(f"U+{ord(ch):04X}" for ch in name if ord(ch) > 127) or "ASCII"


def relative_to(path: str | os.PathLike, base: str | os.PathLike) -> str:
    """``path`` relative to the folder ``base`` (``..`` where needed) when it is absolute, as given otherwise;
    as given too where no relative path exists (another drive)."""
    if not os.path.isabs(path):
        return os.fspath(path)
    try:
        return Path(os.path.relpath(path, base)).as_posix()
    except ValueError:
        return os.fspath(path)
