"""The teacher stage: features (and logits) of a big model for every image of a dataset.

Teachers:
- ``EfficientNetTeacher`` (default): ImageNet-pretrained EfficientNet-Lite0 rebuilt in the engine,
  fine-tuned on the dataset unless frozen (pipeline/teachers/effnet.py);
- ``OnnxEncoder``: any ONNX image encoder run by onnxruntime;
- a CNN the engine trains on the dataset itself (``train_cnn_teacher``);
- a features file the user computed elsewhere (``read_features_source`` + ``ArrayEncoder``).

All of them end in the same artefact (pipeline/teachers/artefact.py): ``features_<split>.npy`` memmaps
and ``teacher.json`` tied to the dataset manifest's checksum, written into a temporary folder
that replaces the old one only when complete; a fine-tuned EfficientNet adds its network (``model.npz``)
and ``teacher.onnx`` to serve it (pipeline/teachers/served.py). :func:`run_teacher_stage` is the whole stage as
``leaflens teacher`` runs it: pick the teacher (:class:`TeacherChoice`), write its folder, summarise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from leaflens.data_prep.arrays import NpyRowWriter, sha256_file
from leaflens.data_prep.decode import decode_image_at
from leaflens.data_prep.manifest import load_dataset, manifest_sha256, require_labelled_splits
from leaflens.files import (
    check_replaceable,
    clean_stale_temps,
    find_moved,
    new_temp_dir,
    output_folder,
    output_lock,
    swap_into_place,
    write_json_atomic,
)
from leaflens.pipeline.config import StageConfig, dump_toml
from leaflens.pipeline.teachers.artefact import FORMAT, TEACHER_JSON, TeacherInfo, feature_paths, load_teacher


class TeacherStageError(ValueError):
    """The teacher stage cannot run as asked (the message says why and what to do)."""


class TeacherSettingError(TeacherStageError):
    """A setting the chosen teacher cannot run with (a usage error, not a refused input)."""


class Encoder(Protocol):
    """What the stage needs of a teacher (read-only, so an encoder that always has logits, with an ``int``
    ``num_classes``, is one too)."""

    @property
    def input_size(self) -> int: ...

    @property
    def feature_dim(self) -> int: ...

    @property
    def num_classes(self) -> int | None: ...

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """uint8 (N, S, S, 3) RGB -> (features (N, D) float32, logits (N, C) or None)."""

    def identity(self) -> dict[str, Any]:
        """What teacher.json records about this encoder (name, weights, preprocessing)."""


EFFNET_MIN_SIZE, EFFNET_MAX_SIZE = 32, 1024  # teacher.input_size of the EfficientNet teacher (`--input-size 16`
# for 160 trained a teacher at chance accuracy; 1024 px is 20 times the default's work per photo)
_moved_sources: dict[tuple[str, str, str], Path | None] = {}


def split_source_dir(ds: Any, split: str) -> Path | None:
    """Where the original photos of a split live (None when the manifest does not say). Unlabelled photos
    come from a folder passed on their own (``unlabeled_source``, files recorded relative to it) or from the
    source's own ``unlabeled/`` folder (files recorded relative to the source, like the labelled ones).

    The manifest records the folder by absolute path. When that is gone, the project was likely moved or
    renamed (copied to a GPU machine, say) with the photos beside the dataset: the folder is looked up above
    the dataset's folder by its last parts (``photos`` of ``/old/project/photos`` as ``/new/project/photos``)
    and taken only when the split's first and last photos there decode to exactly the stored pixels."""
    m = ds.manifest
    root = (m.unlabeled_source or m.source_root) if split == "unlabeled" else m.source_root
    if not root:
        return None
    recorded = Path(root)
    if (recorded.is_dir() or not recorded.is_absolute() or getattr(ds, "root", None) is None
            or split not in ds or not len(ds[split])):
        return recorded
    key = (str(Path(ds.root).resolve()), split, str(recorded))
    if key not in _moved_sources:
        _moved_sources[key] = find_moved(recorded, ds.root, lambda folder: _same_photos(ds, split, folder, recorded))
    return _moved_sources[key] or recorded


def split_photo_paths(ds: Any, split: str) -> tuple[Path | None, list[Path]]:
    """The folder of a split's original photos (:func:`split_source_dir`) and the path of every row's photo.
    Rows recorded by absolute path (a separate ``--unlabeled`` folder, ``--also`` folders) move with the
    folder: ``/old/project/corrections/x.jpg`` becomes ``/new/project/corrections/x.jpg``."""
    root = split_source_dir(ds, split)
    if root is None:
        return None, []
    m = ds.manifest
    recorded = Path((m.unlabeled_source or m.source_root) if split == "unlabeled" else m.source_root)
    return root, [_rebased(f, recorded, root) for f in ds[split].files]


def _rebased(file: str, recorded: Path, root: Path) -> Path:
    """``file`` (relative to the source folder, or absolute) when the folder recorded at ``recorded`` is
    ``root`` now: an absolute path under the part of ``recorded`` that changed is moved the same way."""
    path = Path(file)
    if not path.is_absolute():
        return root / path
    if root == recorded:
        return path
    same = 0  # trailing parts the two folders share: what is left before them is the part that moved
    while same < min(len(recorded.parts), len(root.parts)) - 1 and \
            recorded.parts[-1 - same] == root.parts[-1 - same]:
        same += 1
    old, new = Path(*recorded.parts[:len(recorded.parts) - same]), Path(*root.parts[:len(root.parts) - same])
    try:
        return new / path.relative_to(old)
    except ValueError:
        return path


def _same_photos(ds: Any, split: str, folder: Path, recorded: Path) -> bool:
    """Whether ``folder`` holds the split's photos: its first and last decode to the stored pixels."""
    files = ds[split].files
    return all(_decodes_as_stored(ds, split, row, _rebased(files[row], recorded, folder))
               for row in sorted({0, len(files) - 1}))


def _decodes_as_stored(ds: Any, split: str, row: int, path: Path) -> bool:
    """Whether the photo file ``path`` decodes to the pixels preprocess stored for ``row`` of ``split``; False
    when it is missing or unreadable (a pipe is refused, never waited on)."""
    from leaflens.data_prep.contract import decode_stored  # noqa: PLC0415
    from leaflens.data_prep.decode import ImageDecodeError, read_source  # noqa: PLC0415

    try:
        pixels = decode_stored(read_source(path), ds.image_size, ds.manifest.resize,
                               max_pixels=ds.manifest.options.max_pixels)
    except (ImageDecodeError, OSError, ValueError):
        return False
    stored = ds[split].images[row]
    return pixels.shape == stored.shape and np.array_equal(pixels, stored)


_checked_originals: dict[tuple[str, str, str], list[int]] = {}


def changed_originals(ds: Any, split: str, paths: list[Path], workers: int = 2) -> list[int]:
    """Rows of ``split`` whose original photo no longer decodes to the pixels preprocess stored for it (edited,
    replaced or unreadable since), checked once per process: a stage that goes back to the originals (for a
    larger size or fresh crops) would otherwise learn from photos the dataset's labels were never given to.
    Each photo is decoded once more at the stored size: about 30 ms for a 12-megapixel JPEG (JPEG's draft
    mode), 160 ms for a PNG of that size, on one of the ``workers`` threads."""
    key = (str(Path(ds.root).resolve()), split, str(paths[0].parent if paths else ""))
    if key in _checked_originals:
        return _checked_originals[key]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        same = pool.map(lambda row: _decodes_as_stored(ds, split, row, paths[row]), range(len(paths)))
        changed = [row for row, ok in enumerate(same) if not ok]
    _checked_originals[key] = changed
    return changed


def missing_originals_message(split: str, missing: list[Path]) -> str:
    """Original photos of ``split`` that are gone since preprocess, and what to do: preprocess again first (a photo
    relabelled in the web app's corrections folder moves to another class's folder: the stored arrays would
    teach it under the label it had)."""
    return (f"{len(missing)} original photo{'s' if len(missing) != 1 else ''} of split '{split}' "
            f"{'are' if len(missing) != 1 else 'is'} missing, first {missing[0]} (moved, deleted or relabelled "
            "since preprocess): run `leaflens preprocess` again so the dataset holds the photos as they are now, or "
            "pass --from-arrays to use the stored arrays (with the labels they had then)")


def changed_originals_message(split: str, paths: list[Path], changed: list[int], from_arrays: bool = True) -> str:
    """What :func:`changed_originals` found, and what to do (``from_arrays``: the stage has --from-arrays)."""
    return (f"{len(changed)} of the {len(paths)} original photos of split '{split}' no longer decode to the pixels "
            f"preprocess stored for them (changed or replaced since, or decoded differently by another Pillow "
            f"version), first {paths[changed[0]]}: run `leaflens preprocess --force` so the dataset holds them as "
            "they decode now"
            + (", or pass --from-arrays to use the stored arrays" if from_arrays else ""))


def iter_split_images(ds: Any, split: str, size: int, shorter_side: int | None, batch: int,
                      from_arrays: bool = False, workers: int = 2) -> Iterator[np.ndarray]:
    """Batches of a split's images at the teacher's resolution.

    At the dataset's own size the stored arrays are used. Otherwise the original photos are
    decoded again through data_prep's decode path (same crop rule), so the teacher sees real
    detail rather than upsampled thumbnails; ``from_arrays`` upsamples the stored arrays instead
    (for datasets whose originals are gone).
    """
    images = ds[split].images
    n = len(images)
    resize = ds.manifest.resize
    if size == ds.image_size:
        for i in range(0, n, batch):
            yield np.asarray(images[i:i + batch])
        return
    if from_arrays:
        from PIL import Image  # noqa: PLC0415

        for i in range(0, n, batch):
            chunk = np.asarray(images[i:i + batch])
            yield np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.Resampling.BICUBIC))
                            for im in chunk])
        return
    src, paths = split_photo_paths(ds, split)
    if src is None or not src.is_dir():
        raise TeacherStageError(
            f"the original photos of split '{split}' are not at {src}: the teacher needs them at {size}x{size}. "
            f"Pass --from-arrays to upsample the stored {ds.image_size}x{ds.image_size} arrays instead.")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise TeacherStageError(missing_originals_message(split, missing))
    changed = changed_originals(ds, split, paths, workers)
    if changed:
        raise TeacherStageError(changed_originals_message(split, paths, changed))

    def load(p: Path) -> np.ndarray:
        return decode_image_at(p, size, resize, shorter_side=shorter_side)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i in range(0, n, batch):
            yield np.stack(list(pool.map(load, paths[i:i + batch])))


def _source_of(encoder: Any) -> str:
    """The teacher's source, for a message: the ONNX model or features file it reads, else its kind."""
    ident = encoder.identity() if hasattr(encoder, "identity") else {}
    where = ident.get("path") if isinstance(ident, dict) else None
    return f"teacher {where}" if where else f"{type(encoder).__name__} teacher"


def _finite(values: Any, dtype: Any, what: str, split: str, encoder: Any) -> np.ndarray:
    """``values`` as stored (``dtype``), refused when a value is NaN or inf there (an encoder's NaN output, or a
    float64 1e300 that becomes inf as float32): training on them fails far from the cause."""
    stored = np.asarray(values)
    if stored.ndim != 2:
        raise TeacherStageError(f"the {_source_of(encoder)} gives {what} of shape {stored.shape} for '{split}', "
                                "expected one row per photo")
    with np.errstate(over="ignore", invalid="ignore"):
        stored = stored.astype(dtype, copy=False)
    if not np.isfinite(stored).all():
        bad = int((~np.isfinite(stored)).any(axis=1).sum())
        raise TeacherStageError(f"the {_source_of(encoder)} gives {what} that are NaN or inf as {np.dtype(dtype).name} "
                                f"for {bad} of the {len(stored)} '{split}' photos of the first batch found with them: "
                                "check the model's output (or the file's values) before using it as a teacher")
    return stored


def write_teacher(out: str | os.PathLike[str], ds: Any, encoder: Encoder, batch: int = 32,
                  shorter_side: int | None = None, from_arrays: bool = False, dtype: Any = np.float32,
                  stage: dict[str, Any] | None = None, seconds: float | None = None, progress: bool = True,
                  views: int = 1,
                  view_scale: tuple[float, float] | None = None, view_seed: int = 0,
                  config: StageConfig | None = None,
                  finish: Callable[[Path], dict[str, Any]] | None = None) -> Path:
    """Run ``encoder`` over every split of ``ds`` and write the teacher folder atomically.

    With ``views`` > 1 the teacher also encodes that many augmented views of every training and
    unlabelled photo (pipeline/teachers/views.py) for students that learn on the same views, their
    crops drawn with ``view_scale`` and ``view_seed`` (the recipe's ``teacher.view_scale`` and ``seed``).
    ``config``, the resolved recipe the teacher was made with, is saved beside it as ``config.toml``;
    ``stage`` (what the teacher's maker recorded) and ``seconds`` go into teacher.json. ``finish``, called
    with the folder being built once the features are in it, writes further files there (the served
    teacher) and returns entries added to ``stage``.
    """
    out = Path(out)
    check_replaceable(out, TEACHER_JSON, "leaflens teacher folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out)  # folders of killed runs
    if encoder.feature_dim < 1:
        raise TeacherStageError(f"the {_source_of(encoder)} gives 0 features a photo: a teacher needs at least one")
    if encoder.num_classes and encoder.num_classes != ds.num_classes:
        raise TeacherStageError(f"the {_source_of(encoder)} gives logits for {encoder.num_classes} classes, the "
                                f"dataset has {ds.num_classes} ({', '.join(ds.classes)}): leave the logits out, or "
                                "make them for this dataset's classes")
    tmp = new_temp_dir(out, kind="partial")
    try:
        total = sum(len(ds[s]) for s in ds.splits)
        bar = tqdm(total=total, desc="teacher features", unit="img", disable=None if progress else True)
        for split in ds.splits:
            n = len(ds[split])
            fname, lname = feature_paths(split)
            if hasattr(encoder, "start"):
                encoder.start(split)
            # a writer closes with its row count checked, or is aborted when anything fails
            with (NpyRowWriter(tmp / fname, n, (encoder.feature_dim,), dtype) as fw,
                  NpyRowWriter(tmp / lname, n, (encoder.num_classes,), np.float32) if encoder.num_classes
                  else nullcontext() as lw):
                for chunk in iter_split_images(ds, split, encoder.input_size, shorter_side, batch, from_arrays):
                    f, lg = encoder.encode(chunk)
                    fw.write(_finite(f, dtype, "features", split, encoder))
                    if lw is not None:
                        if lg is None:
                            raise TeacherStageError(f"the {type(encoder).__name__} teacher has {encoder.num_classes} "
                                                    "classes but returned no logits")
                        lw.write(_finite(lg, np.float32, "logits", split, encoder))
                    bar.update(len(chunk))
        bar.close()
        view_info = None
        if views > 1:
            from leaflens.pipeline.teachers.views import view_augment, write_view_bank  # noqa: PLC0415

            if view_scale is None:
                raise TeacherStageError(f"a bank of {views} views needs view_scale (the recipe's teacher.view_scale)")

            view_encoder = encoder.view_encoder if isinstance(encoder, ArrayEncoder) else encoder
            view_info = write_view_bank(tmp, ds, view_encoder, views, view_augment(view_scale), view_seed, batch,
                                        from_arrays, dtype, progress)
        if finish is not None:
            stage = {**(stage or {}), **finish(tmp)}
        info = TeacherInfo(
            format=FORMAT, teacher=encoder.identity(), feature_dim=int(encoder.feature_dim),
            num_classes=None if not encoder.num_classes else int(encoder.num_classes),
            classes=tuple(ds.classes) if encoder.num_classes else None, input_size=int(encoder.input_size),
            shorter_side=shorter_side, from_arrays=from_arrays, dtype=np.dtype(dtype).name,
            dataset_manifest_sha256=manifest_sha256(ds.root), dataset_root=str(ds.root),
            rows={s: len(ds[s]) for s in ds.splits}, views=view_info, stage=stage or {}, seconds=seconds)
        write_json_atomic(tmp / TEACHER_JSON, info.to_dict())
        if config is not None:
            (tmp / "config.toml").write_text(dump_toml(config), encoding="utf-8")
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def knn_accuracy(train_f: np.ndarray, train_y: np.ndarray, test_f: np.ndarray, test_y: np.ndarray) -> float:
    """1-nearest-neighbour accuracy under cosine similarity: how well features separate the classes."""
    a = train_f / np.maximum(np.linalg.norm(train_f, axis=1, keepdims=True), 1e-12)
    b = test_f / np.maximum(np.linalg.norm(test_f, axis=1, keepdims=True), 1e-12)
    nearest = (b @ a.T).argmax(axis=1)
    return float((train_y[nearest] == test_y).mean())


class ArrayEncoder:
    """Precomputed features (and logits) per split, served as an encoder so they take the same path.

    It cannot look at new images; a teacher that can (for augmented views) is set as ``view_encoder``.
    """

    sees_images = False
    notes: list[str] = []  # what the stage should tell the user about the source (set by make_encoder)
    view_encoder: Any = None
    network: Any = None  # the whole fine-tuned network, when the teacher has one to serve

    def __init__(self, features: dict[str, np.ndarray], logits: dict[str, np.ndarray] | None, source: Path,
                 input_size: int, identity: dict[str, Any] | None = None):
        dims = {f.shape[1] for f in features.values()}
        if len(dims) != 1:
            raise TeacherStageError(f"{source}: feature arrays of different widths {sorted(dims)}")
        self.features, self.logits, self.source = features, logits, source
        self._identity = identity or {"kind": "features-file", "path": str(Path(source).resolve())}
        self.feature_dim = dims.pop()
        self.num_classes = None if not logits else next(iter(logits.values())).shape[1]
        self.input_size = input_size
        self._split: str | None = None
        self._row = 0

    def start(self, split: str) -> None:
        self._split, self._row = split, 0

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        assert self._split is not None
        a, b = self._row, self._row + len(images)
        self._row = b
        with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, which write_teacher refuses
            lg = None if not self.logits else np.asarray(self.logits[self._split][a:b], np.float32)
            return np.asarray(self.features[self._split][a:b], np.float32), lg

    def identity(self) -> dict[str, Any]:
        return self._identity


def _why(exc: BaseException) -> str:
    text = str(exc)
    if "pickle" in text.lower() or "object" in text.lower():
        return "it is not a file of numeric .npy arrays, or it holds Python objects"
    return text or type(exc).__name__


def _load_array(path: Path) -> np.ndarray:
    """A ``.npy`` file memory-mapped, never unpickled; TeacherStageError naming it when it cannot be."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise TeacherStageError(f"{path} cannot be read as a .npy array of numbers ({_why(exc)}): save it with "
                                "numpy.save (no Python objects)") from None


def _teacher_dataset(folder: Path) -> str | None:
    """The manifest checksum a teacher folder's teacher.json records (None: not a teacher folder)."""
    try:
        data = json.loads((folder / TEACHER_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("dataset_manifest_sha256") if isinstance(data, dict) else None
    return str(value) if value else None


def _features_digest(path: Path, ds: Any) -> str:
    """SHA-256 (hex, as ``sha256sum`` prints it and the ONNX teacher records it) of what ``--features`` read: the
    .npz file, or the folder's features and logits files of the dataset's splits in order (teacher.json pins the
    content, not only the path)."""
    if not path.is_dir():
        return sha256_file(path).removeprefix("sha256:")
    h = hashlib.sha256()
    for split in ds.splits:
        for name in feature_paths(split):
            if (path / name).is_file():
                h.update(f"{name}\0{sha256_file(path / name)}\n".encode())
    return h.hexdigest()


def read_features_source(path: Path, ds: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """A folder of ``features_<split>.npy`` (+ ``logits_<split>.npy``) or one ``.npz`` with those keys."""
    feats: dict[str, np.ndarray] = {}
    logits: dict[str, np.ndarray] = {}
    names: dict[str, list[str]] = {}  # optional row names (files_<split>): the row order is then checked
    if path.is_dir():
        made_for = _teacher_dataset(path)
        if made_for is not None and made_for != manifest_sha256(ds.root):
            raise TeacherStageError(f"--features {path} is a teacher folder made for another dataset (manifest "
                                    f"checksum {made_for[:12]}... against {ds.root}'s): its rows are another "
                                    "dataset's photos; make the teacher for this dataset")
        for split in ds.splits:
            fname, lname = feature_paths(split)
            if not (path / fname).is_file():
                raise TeacherStageError(f"{path} has no {fname} for split '{split}'")
            feats[split] = _load_array(path / fname)
            if (path / lname).is_file():
                logits[split] = _load_array(path / lname)
            if (path / f"files_{split}.txt").is_file():
                names[split] = (path / f"files_{split}.txt").read_text(encoding="utf-8").splitlines()
    elif path.suffix == ".npz" and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                for split in ds.splits:
                    key = f"features_{split}"
                    if key not in z.files:
                        raise TeacherStageError(f"{path} has no array '{key}' (has: {', '.join(z.files)})")
                    feats[split] = z[key]
                    if f"logits_{split}" in z.files:
                        logits[split] = z[f"logits_{split}"]
                    if f"files_{split}" in z.files:
                        names[split] = [_name_text(v) for v in np.asarray(z[f"files_{split}"]).reshape(-1)]
        except (OSError, ValueError, TypeError, zipfile.BadZipFile, AttributeError) as exc:
            if isinstance(exc, TeacherStageError):
                raise
            raise TeacherStageError(f"--features {path} cannot be read as an .npz of numeric arrays ({_why(exc)}): "
                                    "save it with numpy.savez (no Python objects)") from None
    else:
        raise TeacherStageError(f"--features {path}: expected a folder of features_<split>.npy or an .npz file")
    for kind, arrays in (("features", feats), ("logits", logits)):
        for split, f in arrays.items():
            n = len(ds[split])
            if f.dtype.kind not in "fiu":
                raise TeacherStageError(f"{path}: {kind} for '{split}' are {f.dtype} values; a teacher's are real "
                                        "numbers (float32)")
            if f.ndim != 2 or f.shape[0] != n:
                raise TeacherStageError(f"{path}: {kind} for '{split}' have shape {f.shape}, the dataset has {n} rows "
                                        f"({kind} must be a 2-D array aligned with the manifest's row order)")
            if not np.isfinite(np.asarray(f)).all():
                raise TeacherStageError(f"{path}: {kind} for '{split}' contain NaN or inf")
    if logits and set(logits) != set(feats):
        raise TeacherStageError(f"{path}: logits are given for some splits only ({sorted(logits)})")
    for split, given in names.items():
        _check_row_names(path, split, given, list(ds[split].files))
    with np.errstate(over="ignore"):  # values beyond float32 are refused as inf when written, with their own words
        train = np.asarray(feats["train"]).astype(np.float32) if "train" in feats else None
    if (train is not None and len(train) > 1 and np.isfinite(train).all()
            and float(np.ptp(train, axis=0).max()) == 0.0):
        raise TeacherStageError(f"{path}: every 'train' photo has the same features, so they cannot teach a student "
                                "anything (its feature loss would have no gradient): check how they were made")
    return feats, (logits or None)


def _name_text(value: Any) -> str:
    """A photo name from a features file: text, or bytes as h5py and ``np.array([b"..."])`` store it (UTF-8)."""
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


def _check_row_names(path: Path, split: str, given: list[str], files: list[str]) -> None:
    """``files_<split>`` in a features source must list the dataset's photos in the dataset's row order."""
    if given == files:
        return
    if len(given) != len(files):
        raise TeacherStageError(f"{path}: files_{split} names {len(given)} photos, the dataset's '{split}' split has "
                                f"{len(files)} ({split}_files.txt)")
    known = set(files)
    unknown = [name for name in given if name not in known]
    if unknown:
        photos = f"{len(unknown)} photo{'s' if len(unknown) != 1 else ''}"
        raise TeacherStageError(f"{path}: files_{split} names {photos} the dataset's '{split}' split does not have, "
                                f"first {unknown[0]!r}: name each photo as {split}_files.txt does, relative to the "
                                f"photos' folder (e.g. {files[0]!r})")
    twice = sorted(name for name, n in Counter(given).items() if n > 1)  # a count per name: files may be long
    if twice:
        raise TeacherStageError(f"{path}: files_{split} names {twice[0]!r} more than once, so some of the split's "
                                "photos have no row: write one row per photo, in the order of the dataset's "
                                f"{split}_files.txt")
    row = next(i for i, (a, b) in enumerate(zip(given, files)) if a != b)
    raise TeacherStageError(f"{path}: the rows for '{split}' are not in the dataset's order: row {row} is "
                            f"{given[row]!r} there, {files[row]!r} in {split}_files.txt; write each split's rows "
                            f"in the order of the dataset's {split}_files.txt")


def features_source_notes(path: Path, feats: dict[str, np.ndarray], logits: dict[str, np.ndarray] | None,
                          ds: Any) -> list[str]:
    """A note when a features source's rows look out of order: its logits (else its features' nearest
    training photo) put no more val photos in their class than chance. Rows are matched to photos by position
    alone (unless the source names them), so a file written in another order is otherwise taken silently."""
    if "val" not in ds or ds["val"].labels is None or "train" not in ds or ds.num_classes < 2:
        return []
    y_val = np.asarray(ds["val"].labels)
    if logits is not None:
        acc, how = float((np.asarray(logits["val"]).argmax(1) == y_val).mean()), "logits put"
    else:
        rng = np.random.default_rng(0)  # a sample keeps the check cheap for large sets; it only looks for chance
        tr = rng.permutation(len(ds["train"]))[:2000]
        va = rng.permutation(len(y_val))[:500]
        acc = knn_accuracy(np.asarray(feats["train"], np.float32)[np.sort(tr)],
                           np.asarray(ds["train"].labels)[np.sort(tr)],
                           np.asarray(feats["val"], np.float32)[np.sort(va)], y_val[np.sort(va)])
        how = "features (nearest training photo) put"
    chance = 1.0 / ds.num_classes
    if acc > chance:
        return []
    return [f"{path.name}'s {how} {100 * acc:.0f} % of the val photos in their class, no better than chance "
            f"({100 * chance:.0f} %): if the teacher is better than that, its rows are not in the dataset's order. "
            "Each split's rows must follow the dataset's <split>_files.txt; add files_<split> (those names, in "
            "order) to the source and the order is checked"]


# ---- the whole stage ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TeacherChoice:
    """Which teacher computes the features: precomputed ``features`` (a folder of ``features_<split>.npy``
    or an ``.npz``), an ``onnx`` image encoder with its input options (``None``: from the model), a wide
    CNN trained on the dataset itself (``train_cnn``), or by default the ImageNet EfficientNet-Lite0
    (``weights``: its ``.pth`` file; ``None``: the installed package's), fine-tuned as the recipe says."""

    features: Path | None = None
    onnx: Path | None = None
    onnx_input_size: int | None = None
    onnx_layout: str | None = None
    onnx_mean: Sequence[float] | None = None
    onnx_std: Sequence[float] | None = None
    onnx_output: str | None = None
    train_cnn: bool = False
    weights: Path | None = None


# [teacher] settings that do not shape the EfficientNet fine-tune: changed, an interrupted fine-tune still
# continues. The learning rates are among them: a fine-tune stopped on numerical faults is meant to go on at a
# lower one (``train.lr`` likewise for the --train-cnn teacher).
NOT_IN_FINE_TUNE = ("lr", "head_lr", "encode_batch_size", "views", "view_scale", "cnn_widths", "cnn_epochs")
RESUME_RECORD = "resume.json"


def finetune_work_dir(out: Path, train_cnn: bool = False) -> Path:
    """Where a teacher the stage trains keeps its checkpoints until the teacher folder is written: beside
    ``out`` (``.<name>.finetune-work``, or ``.<name>.cnn-work`` for --train-cnn), so that an interrupted or
    stopped training goes on with --resume."""
    return out.with_name(f".{out.name}.{'cnn' if train_cnn else 'finetune'}-work")


def trains(cfg: StageConfig, choice: TeacherChoice) -> bool:
    """Whether the chosen teacher is trained by the stage (the EfficientNet fine-tune, --train-cnn): the
    teachers that resume."""
    return choice.features is None and choice.onnx is None and (choice.train_cnn or not cfg.teacher.frozen)


def _dotted(section: str, record: Any, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    return {f"{section}.{k}": (list(v) if isinstance(v, tuple) else v) for k, v in record.to_dict().items()
            if k not in leave_out}


def resume_record(ds: Any, cfg: StageConfig, choice: TeacherChoice, from_arrays: bool) -> dict[str, Any]:
    """What an interrupted training must share with the run that continues it: the dataset (its manifest's
    SHA-256), the weights it started from and the recipe that shapes it (not the learning rates)."""
    if choice.train_cnn:
        recipe = {"teacher.cnn_widths": list(cfg.teacher.cnn_widths), "teacher.cnn_epochs": cfg.teacher.cnn_epochs,
                  **_dotted("model", cfg.model, ("widths", "input_size")), **_dotted("train", cfg.train, ("lr",)),
                  **_dotted("augment", cfg.augment)}
    else:
        recipe = _dotted("teacher", cfg.teacher, NOT_IN_FINE_TUNE)
    return {"teacher": "train-cnn" if choice.train_cnn else "efficientnet-lite0",
            "dataset_manifest_sha256": manifest_sha256(ds.root),
            "weights": str(choice.weights) if choice.weights is not None else "installed",
            "from_arrays": from_arrays, "recipe": recipe}


RATES_RECORD = "rates.json"  # the learning rates a --resume may change, and what each resume changed


def learning_rates(cfg: StageConfig, choice: TeacherChoice) -> dict[str, float]:
    """The settings a resumed teacher training may change (resume_record leaves them out)."""
    if choice.train_cnn:
        return {"train.lr": cfg.train.lr}
    return {"teacher.lr": cfg.teacher.lr, "teacher.head_lr": cfg.teacher.head_lr}


def record_rate_changes(work: Path, rates: dict[str, float], continuing: bool) -> list[dict[str, Any]]:
    """Keep ``rates`` in ``work``: a new training starts the record, a continued one adds what its rates
    changed (said on stderr). Returns every resume's changes so far: teacher.json lists them, since the epochs
    before a resume ran with the earlier rates."""
    path = work / RATES_RECORD
    try:
        saved = json.loads(path.read_text(encoding="utf-8")) if continuing else None
    except (OSError, ValueError):  # an interruption before it was first written: nothing to compare with
        saved = None
    resumes = list((saved or {}).get("resumes") or [])
    before = (saved or {}).get("rates") or {}
    changed = {k: [before[k], v] for k, v in rates.items() if k in before and before[k] != v}
    if changed:
        print("note: --resume: learning rates changed since the training began (teacher.json lists them): "
              + ", ".join(f"{k} {old:g} -> {new:g}" for k, (old, new) in changed.items()), file=sys.stderr,
              flush=True)
        resumes.append({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changed": changed})
    write_json_atomic(path, {"rates": rates, "resumes": resumes})
    return resumes


def prepare_work_dir(work: Path, out: Path, record: dict[str, Any], resume: bool) -> bool:
    """Make ``work`` ready for the fine-tune: emptied for a new one, or checked against ``record`` to go on
    with an interrupted one (``resume``). True when it continues one. Refuses (TeacherStageError) a --resume
    of another dataset's or recipe's fine-tune, and one with nothing to continue beside a finished ``out``."""
    saved_path = work / RESUME_RECORD
    if resume and work.is_dir():
        try:
            saved = json.loads(saved_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise TeacherStageError(f"--resume: {work} holds no readable {RESUME_RECORD} (not an interrupted "
                                    "fine-tune this version can continue); run without --resume to start over"
                                    ) from None
        if saved != record:
            words = {"dataset_manifest_sha256": "dataset (preprocess was run again since)",
                     "weights": "starting weights (--weights)", "from_arrays": "--from-arrays setting",
                     "teacher": "teacher (--train-cnn or the fine-tune)"}
            what = sorted({words.get(k, k) for k in record if saved.get(k) != record[k] and k != "recipe"}
                          | {k for k, v in record["recipe"].items() if (saved.get("recipe") or {}).get(k) != v})
            raise TeacherStageError(f"--resume: the interrupted fine-tune in {work} was made with another "
                                    f"{', '.join(what) or 'setting'}; continue it with the same dataset and recipe, "
                                    "or run without --resume to start over (its checkpoints are then removed)")
        return True
    if resume and (out / TEACHER_JSON).exists():
        raise TeacherStageError(f"--resume: {out} is a finished teacher and there is no interrupted fine-tune "
                                f"({work.name}) to continue; nothing was changed. Without --resume a new teacher "
                                f"replaces {out} (or give another --out)")
    if not resume and any(work.rglob("last.npz")):  # hours of training may be in there: say it goes
        print(f"note: the interrupted teacher training in {work} is discarded: this run starts over (--resume would "
              "have continued it)", file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    write_json_atomic(saved_path, record)
    return False


def make_encoder(ds: Any, cfg: StageConfig, choice: TeacherChoice, out: Path, from_arrays: bool,
                 progress: bool, work_dir: Path | None = None) -> tuple[Encoder, dict[str, Any]]:
    """The chosen teacher as an encoder, and what making it recorded (its training, for teacher.json)."""
    if choice.features is not None:
        feats, logits = read_features_source(choice.features, ds)
        identity = {"kind": "features-file", "path": str(Path(choice.features).resolve()),
                    "sha256": _features_digest(Path(choice.features), ds)}
        encoder = ArrayEncoder(feats, logits, choice.features, ds.image_size, identity)
        encoder.notes = features_source_notes(Path(choice.features), feats, logits, ds)
        return encoder, {}
    if choice.onnx is not None:
        from leaflens.pipeline.teachers.onnx_encoder import OnnxEncoder  # noqa: PLC0415

        return OnnxEncoder(choice.onnx, choice.onnx_input_size, choice.onnx_layout,
                           None if choice.onnx_mean is None else list(choice.onnx_mean),
                           None if choice.onnx_std is None else list(choice.onnx_std), choice.onnx_output), {}
    if choice.train_cnn:
        from leaflens.pipeline.teachers.cnn import train_cnn_teacher  # noqa: PLC0415

        return train_cnn_teacher(ds, cfg, work_dir or finetune_work_dir(out, train_cnn=True), progress,
                                 resumable=work_dir is not None)
    from leaflens.pipeline.teachers.effnet import build_effnet_teacher  # noqa: PLC0415

    if not EFFNET_MIN_SIZE <= cfg.teacher.input_size <= EFFNET_MAX_SIZE:
        raise TeacherSettingError(
            f"teacher.input_size {cfg.teacher.input_size}: EfficientNet-Lite0 takes {EFFNET_MIN_SIZE} to "
            f"{EFFNET_MAX_SIZE} px (it halves its input 5 times: below {EFFNET_MIN_SIZE} its last blocks see less "
            "than a pixel); the default is 160, ImageNet's own 224")
    return build_effnet_teacher(ds, cfg.teacher, choice.weights, from_arrays, progress,
                                max_bad_steps=cfg.train.max_bad_steps, work_dir=work_dir)


def served_teacher_writer(network: Any, ds: Any, identity: dict[str, Any], from_arrays: bool = False,
                          batch: int = 32, log: Callable[[str], None] = lambda s: None
                          ) -> Callable[[Path], dict[str, Any]]:
    """:func:`write_teacher`'s ``finish`` for a teacher with a network of ours: writes the served teacher
    (model.npz and teacher.onnx, pipeline/teachers/served.py) that distill may keep, start a student from or
    run in its training loop, and records it as teacher.json's ``stage.served``."""
    def finish(folder: Path) -> dict[str, Any]:
        from leaflens.pipeline.teachers.served import write_served_teacher  # noqa: PLC0415

        return {"served": write_served_teacher(folder, network, ds, identity, from_arrays, batch, log).to_dict()}

    return finish


def run_teacher_stage(dataset_dir: str | os.PathLike[str], out: str | os.PathLike[str], cfg: StageConfig,
                      choice: TeacherChoice = TeacherChoice(), *, from_arrays: bool = False, fp16: bool = False,
                      progress: bool = True, resume: bool = False) -> dict[str, Any]:
    """``leaflens teacher``: make the chosen teacher, write its folder for every split of the dataset
    (float16 features with ``fp16``), read it back as distill will, and return a summary: the teacher's
    identity, its feature width, the seconds taken and, with a labelled test split, the 1-nearest-neighbour
    test accuracy of its features (``knn_test_acc``) and, with logits, its own test accuracy (``test_acc``).

    A teacher the stage trains keeps its checkpoints in :func:`finetune_work_dir` until the folder is written:
    interrupted or stopped, it goes on from them with ``resume`` (same dataset and recipe; the learning rates
    may change). Without ``resume`` a new fine-tune starts and an old one's checkpoints are removed.

    Raises DatasetError, TeacherStageError/TeacherError, FileNotFoundError or ValueError for inputs it
    cannot use, and TrainingStopped when a teacher's training hits repeated numerical faults.
    """
    folder = output_folder(out)
    with output_lock(folder, "teacher"):  # a second run on this --out is refused, not run over this one's work
        return _run_teacher_stage(dataset_dir, folder, cfg, choice, from_arrays=from_arrays, fp16=fp16,
                                  progress=progress, resume=resume)


def _run_teacher_stage(dataset_dir: str | os.PathLike[str], out: Path, cfg: StageConfig, choice: TeacherChoice, *,
                       from_arrays: bool, fp16: bool, progress: bool, resume: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    check_replaceable(out, TEACHER_JSON, "leaflens teacher folder")  # before minutes of fine-tuning
    if out.parent.is_dir():
        clean_stale_temps(out)  # a teacher set aside by a swap killed half-way is put back, not lost
    if choice.features is not None and cfg.teacher.views > 1:
        raise TeacherSettingError("--views needs a teacher that can look at images; precomputed features "
                                  "(--features) cannot be recomputed on augmented views: leave out --views")
    ds = load_dataset(dataset_dir)
    require_labelled_splits(ds, "a teacher's epoch and out-of-domain threshold are chosen on val, and distill "
                                "reports on test")
    work = None
    continuing = False
    resumes: list[dict[str, Any]] = []
    if trains(cfg, choice):
        work = finetune_work_dir(out, choice.train_cnn)
        continuing = prepare_work_dir(work, out, resume_record(ds, cfg, choice, from_arrays), resume)
        if continuing and progress:
            print(f"teacher: continuing the interrupted training in {work}", file=sys.stderr, flush=True)
        resumes = record_rate_changes(work, learning_rates(cfg, choice), continuing)
    elif resume:
        raise TeacherSettingError("--resume continues an interrupted teacher training (the EfficientNet fine-tune "
                                  "or --train-cnn); this teacher (features, ONNX encoder or --frozen) is not "
                                  "trained: run without it")
    if progress and not resume and (out / TEACHER_JSON).exists():
        print(f"note: the teacher in {out} is replaced when this one is written", file=sys.stderr, flush=True)
    try:
        encoder, made = make_encoder(ds, cfg, choice, out, from_arrays, progress, work)
    except BaseException:
        if work is not None and not continuing and not any(work.rglob("last.npz")):
            shutil.rmtree(work, ignore_errors=True)  # refused (or stopped) before an epoch: nothing to resume
        raise
    if progress:
        for note in getattr(encoder, "notes", ()):  # what was assumed about an ONNX encoder's input and output
            print(f"note: {note}", file=sys.stderr, flush=True)
    recipe = cfg.teacher
    if work is not None and resumes:
        made = {**made, "resumed_with_changes": resumes}
    network = getattr(encoder, "network", None)
    finish = None
    if network is not None:
        def log(msg: str) -> None:
            if progress:
                print(msg, file=sys.stderr, flush=True)

        finish = served_teacher_writer(network, ds, encoder.identity(), from_arrays, recipe.encode_batch_size, log)
    write_teacher(out, ds, encoder, batch=recipe.encode_batch_size, shorter_side=getattr(encoder, "shorter_side", None),
                  from_arrays=from_arrays, dtype=np.float16 if fp16 else np.float32, stage=made,
                  seconds=round(time.perf_counter() - t0, 1), progress=progress, views=recipe.views,
                  view_scale=recipe.view_scale, view_seed=recipe.seed, config=cfg, finish=finish)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)  # the teacher is written: nothing left to resume
    tt = load_teacher(out, ds)
    summary: dict[str, Any] = {"teacher": tt.info.teacher, "feature_dim": tt.feature_dim,
                               "seconds": round(time.perf_counter() - t0)}
    st = tt.info.stage.get("self_train")
    if isinstance(st, dict):
        summary["self_train"] = {k: st.get(k) for k in ("ran", "reason", "kept", "unlabeled_photos", "kept_round",
                                                         "value") if k in st}
    elif cfg.teacher.self_train and "unlabeled" in ds.splits and len(ds["unlabeled"]):
        summary["self_train"] = {"ran": False, "reason": "only the fine-tuned EfficientNet teacher self-trains; this "
                                                          "teacher does not"}
    served_info = tt.info.stage.get("served")
    if served_info is not None:
        summary["served"] = {k: served_info.get(k) for k in ("written", "onnx", "reason", "val_accuracy",
                                                              "test_accuracy", "params")}
    if "test" in ds and ds["test"].labels is not None:
        test_y = np.asarray(ds["test"].labels)
        summary["knn_test_acc"] = round(knn_accuracy(np.asarray(tt.features["train"], np.float32),
                                                     np.asarray(ds["train"].labels),
                                                     np.asarray(tt.features["test"], np.float32), test_y), 4)
        if tt.has_logits:
            summary["test_acc"] = round(float((np.asarray(tt.logits["test"]).argmax(1) == test_y).mean()), 4)
    return summary
