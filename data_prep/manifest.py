"""The dataset manifest: what `leaflens preprocess` and `leaflens data` write, and its validation.

A dataset folder holds ``manifest.json`` and, per split, ``<split>_images.npy`` (uint8 N x H x W x 3),
``<split>_labels.npy`` (int64; absent for the "unlabeled" split) and ``<split>_files.txt``.
:func:`load_dataset` checks every file the manifest names (present, right shape/dtype/length, and
with ``verify=True`` the recorded SHA-256) and memory-maps the arrays, so nothing is loaded whole.

``manifest.json`` is read and written as a :class:`Manifest` record: unknown keys and wrong types are
refused by name, ``format_version`` is its version. Only what every manifest has always held is
required; the fields added over time are optional, so older datasets stay readable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, Literal

import numpy as np

from leaflens.data_prep.arrays import npy_expected_size, sha256_file
from leaflens.data_prep.decode import DEFAULT_MAX_PIXELS
from leaflens.data_prep.scan import IMAGE_EXTENSIONS
from leaflens.records import Record, RecordError

MANIFEST_NAME = "manifest.json"
FORMAT_NAME: Final = "leaflens-dataset"
FORMAT_VERSION = 1
REJECTED_NAME = "rejected.jsonl"
# The manifest's digest of its own content: an edited manifest (a renamed or reordered class, a changed
# mean/std) would silently mislabel or mis-normalise everything trained on it, so it is refused.
SELF_DIGEST_KEY = "manifest_sha256"


class DatasetError(ValueError):
    """A dataset folder that is missing, incomplete, or altered since it was written."""


def split_paths(split: str) -> dict[str, str]:
    """File names (relative to the dataset folder) of one split."""
    return {"images": f"{split}_images.npy", "labels": f"{split}_labels.npy", "files": f"{split}_files.txt"}


def manifest_sha256(root: str | os.PathLike) -> str:
    """SHA-256 (hex) of a dataset folder's ``manifest.json`` file: the dataset's identity.

    The teacher (``dataset_manifest_sha256``), the student run (``dataset.manifest_sha256``) and the
    export record it, and each later stage refuses a dataset whose manifest hashes differently. The
    manifest holds every array's checksum, so any change to the dataset changes this digest.
    """
    return sha256_file(Path(root) / MANIFEST_NAME).removeprefix("sha256:")


def is_dataset(digest: str | None) -> Callable[[Path], bool] | None:
    """Whether a folder is the dataset whose ``manifest.json`` hashes to ``digest`` (:func:`manifest_sha256`,
    with or without its "sha256:" prefix); None without a digest to compare."""
    if not isinstance(digest, str) or not digest:
        return None
    want = digest.removeprefix("sha256:")

    def same(folder: Path) -> bool:
        try:
            return manifest_sha256(folder) == want
        except OSError:
            return False
    return same


def manifest_self_digest(manifest: dict[str, Any]) -> str:
    """``sha256:<hex>`` of the manifest's content without its own digest field (canonical JSON).

    Not an identity (see :func:`manifest_sha256`) but an integrity check stored inside the manifest
    itself, which is why it must leave its own field out: :func:`read_manifest` refuses an edited file.
    """
    body = {k: v for k, v in manifest.items() if k != SELF_DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class IngestOptions(Record):
    """Everything that changes a dataset built from photos; recorded in its manifest and its fingerprint."""

    # ``dedupe`` is left out when off, so the manifests and fingerprints of datasets built before it existed
    # do not change (a rebuilt manifest would orphan every teacher tied to it).
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"dedupe"})
    size: int = 128  # twice the student's default 64 px input (see model.input_size)
    resize: Literal["crop", "pad"] = "crop"
    ratios: tuple[float, float, float] = (0.7, 0.15, 0.15)
    seed: int = 0
    max_pixels: int = DEFAULT_MAX_PIXELS
    dedupe: bool | None = None  # remove duplicates (leaflens.data_prep.data_report); None or False: keep them

    def __post_init__(self) -> None:
        if self.dedupe is False:  # one way to say "off", so that it is always left out of the files
            object.__setattr__(self, "dedupe", None)


@dataclass(frozen=True)
class SplitInfo(Record):
    """One split's entry: its row count, whether it has labels, and (labelled splits) rows per class."""

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"per_class"})
    count: int
    labels: Literal["present", "absent"] = "present"
    per_class: dict[str, int] | None = None


@dataclass(frozen=True)
class RejectedInfo(Record):
    """The photos the ingest could not use: how many, per class, per reason, and the file listing them."""

    total: int
    per_class: dict[str, int]
    reasons: dict[str, int]
    list: str


@dataclass(frozen=True)
class DuplicatesInfo(Record):
    """Byte-identical photos: groups, files in them, and groups whose copies carry different labels."""

    groups: int
    files: int
    label_conflicts: int


@dataclass(frozen=True, kw_only=True)
class Manifest(Record):
    """manifest.json. ``manifest_sha256`` is the digest of the rest (see :func:`manifest_self_digest`)."""

    SCHEMA_VERSION: ClassVar[int | None] = FORMAT_VERSION
    VERSION_KEY: ClassVar[str] = "format_version"
    # absent from the manifests of datasets built without --also (and before it was recorded): they read back
    # key for key, so their self digest still matches
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"also_sources", "input_content_fingerprint",
                                                           "input_listing_fingerprint"})
    format: Literal["leaflens-dataset"] = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    classes: tuple[str, ...]
    image_size: int
    layout: Literal["NHWC"] = "NHWC"
    dtype: Literal["uint8"] = "uint8"
    mean: tuple[float, float, float]  # per RGB channel, pixel / 255, computed on train
    std: tuple[float, float, float]
    mean_std_scale: str | None = None
    splits: dict[str, SplitInfo]
    source_root: str | None = None
    source_layout: str | None = None  # "class_folders" or "split_folders" (leaflens.data_prep.scan)
    unlabeled_source: str | None = None
    # the extra labelled folders merged in (`preprocess --also`: the web app's corrections), when there were any
    also_sources: tuple[str, ...] | None = None
    class_info: str | None = None  # the classes.toml copied beside the arrays
    options: IngestOptions | None = None
    rejected: RejectedInfo | None = None
    ignored: dict[str, int] = field(default_factory=dict)
    duplicates: DuplicatesInfo | None = None
    checksums: dict[str, str]  # file name -> "sha256:<hex>"
    input_fingerprint: str | None = None
    # the same over the photos' contents instead of their time stamps, and over their names and sizes alone
    # (leaflens.data_prep.ingest._up_to_date)
    input_content_fingerprint: str | None = None
    input_listing_fingerprint: str | None = None
    manifest_sha256: str | None = None

    @property
    def resize(self) -> Literal["crop", "pad"]:
        """How photos were fitted to the square (``options.resize``; the ingest default when not recorded)."""
        return (self.options or IngestOptions()).resize

    def with_self_digest(self) -> Manifest:
        """This manifest with ``manifest_sha256`` set to the digest of the rest, as it is written."""
        return dataclasses.replace(self, manifest_sha256=manifest_self_digest(self.to_dict()))


@dataclass
class SplitArrays:
    """One split: memory-mapped images (N,H,W,3 uint8), labels (N int64) or None, and source paths."""

    name: str
    images: np.ndarray
    labels: np.ndarray | None
    files_path: Path
    _files: list[str] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def files(self) -> list[str]:
        """Source path of every row (read on first use)."""
        if self._files is None:
            self._files = self.files_path.read_text(encoding="utf-8").splitlines()
        return self._files


@dataclass
class Dataset:
    """A validated dataset folder."""

    root: Path
    manifest: Manifest
    classes: list[str]
    image_size: int
    mean: np.ndarray  # per channel, [0,1] scale, computed on train
    std: np.ndarray
    splits: dict[str, SplitArrays]

    def __getitem__(self, split: str) -> SplitArrays:
        if split not in self.splits:
            raise KeyError(f"{self.root}: no split {split!r}; has {sorted(self.splits)}")
        return self.splits[split]

    def __contains__(self, split: str) -> bool:
        return split in self.splits

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def _fail(root: Path, msg: str) -> DatasetError:
    return DatasetError(f"dataset {root}: {msg}")


_REBUILD = "; `leaflens preprocess --force` with its --src and --out builds it again from the photos"


def _no_manifest(root: Path, path: Path) -> str:
    """What to tell a person whose dataset folder has no manifest: it is missing, a folder of photos (the
    source, not yet preprocessed, with or without split folders), another stage's folder, or something else."""
    if not root.exists():
        return f"no such folder (`leaflens preprocess --src PHOTOS --out {root}` makes one)"
    if not root.is_dir():
        return "not a folder: a dataset is the folder `leaflens preprocess` writes"
    if (root / "teacher.json").is_file():
        return "this is a teacher folder (teacher.json), not a dataset: give the dataset it was made from"
    if (root / "report.json").is_file() or (root / "best.npz").is_file():
        return "this is a distill run folder, not a dataset: give the dataset it was trained on (report.json names it)"

    def photos_in(folder: Path) -> bool:
        try:
            return any(os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS for n in os.listdir(folder))
        except OSError:
            return False

    def subfolders(folder: Path) -> list[Path]:
        try:
            return [Path(e.path) for e in os.scandir(folder) if e.is_dir() and not e.name.startswith(".")]
        except OSError:
            return []

    if photos_in(root):
        return ("a folder of photos without class folders, not a dataset: put each class's photos in a folder of "
                "its own (PHOTOS/<class>/), then `leaflens preprocess --src PHOTOS --out DATASET`")
    classes = [d for d in subfolders(root) if photos_in(d)]
    classes += [c for d in subfolders(root) if d.name.lower() in ("train", "val", "test") for c in subfolders(d)
                if photos_in(c)]
    if classes:
        return (f"this is a folder of photos, not a dataset: `leaflens preprocess --src {root} --out DATASET` "
                "turns it into one, then give --dataset DATASET")
    return f"{path} is missing (`leaflens preprocess --src PHOTOS --out DATASET` writes a dataset, in a new folder)"


def read_manifest(root: str | os.PathLike) -> Manifest:
    """Parse and sanity-check ``manifest.json`` (no array checks)."""
    root = Path(root)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise _fail(root, _no_manifest(root, path))
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(root, f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise _fail(root, f"{path}: 'format' is not {FORMAT_NAME!r}")
    if "format_version" not in manifest:
        raise _fail(root, f"{path}: format_version is missing")
    recorded = manifest.get(SELF_DIGEST_KEY)  # absent in datasets written before it was introduced
    if recorded is not None and recorded != manifest_self_digest(manifest):
        raise _fail(root, f"{path} was edited after it was written (its content no longer matches its "
                          f"'{SELF_DIGEST_KEY}'); rebuild the dataset with `leaflens preprocess` or undo the edit")
    try:
        return Manifest.from_dict(manifest, str(path))
    except RecordError as exc:
        raise _fail(root, str(exc)) from None


def _check_array(root: Path, name: str, shape: tuple[int, ...], dtype: np.dtype,
                 checksums: dict[str, str], verify: bool) -> np.ndarray:
    path = root / name
    if not path.is_file():
        raise _fail(root, f"array file {path} is missing")
    if name not in checksums:
        raise _fail(root, f"manifest has no checksum for {name}")
    try:
        got_shape, got_dtype, expected_bytes = npy_expected_size(path)
    except (OSError, ValueError) as exc:
        raise _fail(root, f"array file {path} has an unreadable header: {exc}") from exc
    if got_shape != shape or got_dtype != dtype:
        raise _fail(root, f"array file {path} is {got_shape} {got_dtype}, manifest says {shape} {dtype}")
    actual = path.stat().st_size
    if actual != expected_bytes:
        raise _fail(root, f"array file {path} is truncated or padded: {actual} bytes, "
                          f"expected {expected_bytes}{_REBUILD}")
    if verify:
        digest = sha256_file(path)
        if digest != checksums[name]:
            raise _fail(root, f"array file {path} was altered: checksum {digest} "
                              f"!= manifest {checksums[name]}{_REBUILD}")
    if shape[0] == 0:
        return np.zeros(shape, dtype)
    return np.load(path, mmap_mode="r", allow_pickle=False)


def require_labelled_splits(ds: Dataset, why: str) -> None:
    """DatasetError unless ``ds`` has labelled train, val and test photos, naming the empty splits and ``why``
    the stage needs them (a --split 100/0/0 dataset is built with a warning; the stages refuse it plainly)."""
    for split in ("train", "val", "test"):
        if split not in ds or ds[split].labels is None:
            raise DatasetError(f"dataset {ds.root} has no labelled '{split}' split")
    counts = {split: len(ds[split]) for split in ("train", "val", "test")}
    empty = [split for split, n in counts.items() if n == 0]
    if empty:
        are = "s are" if len(empty) > 1 else " is"
        raise DatasetError(f"dataset {ds.root}: the {' and '.join(empty)} split{are} empty (train {counts['train']}, "
                           f"val {counts['val']}, test {counts['test']} photos): {why}; preprocess again with at "
                           "least 3 photos per class (or a --split that gives val and test a share)")


def load_dataset(root: str | os.PathLike, verify: bool = True) -> Dataset:
    """Open a dataset folder, refusing a missing, truncated or (with ``verify``) altered file.

    The arrays are memory-mapped read-only. ``verify=True`` re-hashes every array file (a few
    seconds per GB); ``verify=False`` still checks presence, shape, dtype and exact file length.
    """
    root = Path(root)
    m = read_manifest(root)
    classes = list(m.classes)
    size = m.image_size
    checksums = m.checksums
    splits: dict[str, SplitArrays] = {}
    for split, info in m.splits.items():
        n = info.count
        names = split_paths(split)
        images = _check_array(root, names["images"], (n, size, size, 3), np.dtype(np.uint8),
                              checksums, verify)
        labels = None
        if info.labels == "present":
            labels = _check_array(root, names["labels"], (n,), np.dtype(np.int64), checksums, verify)
            if n and (int(labels.min()) < 0 or int(labels.max()) >= len(classes)):
                raise _fail(root, f"{names['labels']} has labels outside 0..{len(classes) - 1}")
        files_path = root / names["files"]
        if not files_path.is_file():
            raise _fail(root, f"file list {files_path} is missing")
        if verify:
            if names["files"] in checksums and sha256_file(files_path) != checksums[names["files"]]:
                raise _fail(root, f"file list {files_path} was altered (checksum mismatch){_REBUILD}")
        splits[split] = SplitArrays(split, images, labels, files_path)
    info_name = m.class_info
    if info_name:
        info_path = root / info_name
        if not info_path.is_file():
            raise _fail(root, f"class info file {info_path} is missing")
        if verify and info_name in checksums and sha256_file(info_path) != checksums[info_name]:
            raise _fail(root, f"class info file {info_path} was altered (checksum mismatch){_REBUILD}")
    mean = np.asarray(m.mean, np.float32)
    std = np.asarray(m.std, np.float32)
    if not np.all(std > 0):
        raise _fail(root, f"{MANIFEST_NAME}: std must be > 0 for every channel, got {list(m.std)}")
    return Dataset(root, m, classes, size, mean, std, splits)
