"""Example photos for the web app, taken from the dataset the model was trained on.

The dataset folder holds the decoded training pixels (``<split>_images.npy``, S x S RGB). One image
per class (from the test split when there is one, so the examples are photos the model did not
learn from) is written as a PNG, enlarged by an integer factor with nearest-neighbour so it is
visible in the page: decoding it again for the model (centre crop + area resize) gives back exactly
the dataset's pixels. The files go to a cache folder keyed by the manifest's hash, written into a
temporary folder and renamed into place, and are reused on the next start.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from leaflens.data_prep.manifest import DatasetError, load_dataset, manifest_sha256
from leaflens.files import new_temp_dir, swap_into_place

__all__ = ["DISPLAY_SIZE", "default_cache_dir", "write_examples"]

DISPLAY_SIZE = 256  # examples are enlarged to at least this many pixels per side
log = logging.getLogger("leaflens.serve")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/leaflens/examples`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "leaflens" / "examples"


def _pick_split(ds) -> str | None:
    for split in ("test", "val", "train"):
        if split in ds and len(ds[split]) and ds[split].labels is not None:
            return split
    return None


def write_examples(dataset_root: str | os.PathLike, cache_dir: str | os.PathLike, classes: Sequence[str],
                   per_class: int = 1, max_total: int = 8) -> list[Path]:
    """Write (or reuse) up to ``max_total`` example PNGs, ``per_class`` per class, and return their paths.

    Returns [] (and logs why) when the dataset cannot be read, has no labelled split, or its classes
    are not the model's ``classes`` (examples of another model's classes would mislead).
    """
    root = Path(dataset_root)
    try:
        ds = load_dataset(root, verify=False)
    except DatasetError as exc:
        log.warning("no examples: %s", exc)
        return []
    if list(ds.classes) != list(classes):
        log.warning("no examples: dataset %s has classes %s, the model has %s", root, ds.classes, list(classes))
        return []
    split = _pick_split(ds)
    if split is None:
        log.warning("no examples: dataset %s has no labelled images", root)
        return []
    digest = manifest_sha256(root)[:16]
    target = Path(cache_dir) / f"{digest}-{per_class}-{max_total}"
    if target.is_dir():
        found = sorted(target.glob("*.png"))
        if found:
            return found
    labels = np.asarray(ds[split].labels)
    chosen: list[tuple[str, int]] = []
    for rank in range(per_class):
        for c, name in enumerate(ds.classes):
            rows = np.flatnonzero(labels == c)
            if rank < len(rows) and len(chosen) < max_total:
                chosen.append((f"{name}_{rank + 1}" if per_class > 1 else name, int(rows[rank])))
    factor = max(1, math.ceil(DISPLAY_SIZE / ds.image_size))
    tmp = new_temp_dir(target)
    try:
        for stem, row in chosen:
            img = Image.fromarray(np.asarray(ds[split].images[row]), "RGB")
            img = img.resize((img.width * factor, img.height * factor), Image.Resampling.NEAREST)
            img.save(tmp / f"{stem}.png", optimize=True)
        swap_into_place(tmp, target, replace=False)  # another process wrote it first: keep theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(target.glob("*.png"))
