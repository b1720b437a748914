"""Would the students gain from a centre crop at evaluation? Each trained student of a distill run, on its
validation and test photos, with the centre of the stored photo kept before the resize to the model's input.
(This measurement led to ``distill.centre_crops``: distill now makes the same choice for every student it
trains and records it in the model's contract; this script still scores any run, older ones included.)

The students train on random-resized crops (``[augment] scale``: half to all of the photo's area), so an object
looks about 1.15x larger to them in training than in a whole-frame photo; the EfficientNet teacher is served
with ImageNet's centre crop (0.875 of the side) for the same reason ("FixRes", Touvron et al. 2019). For each
ratio r the centre ``round(r * stored)`` square of each stored photo is area-resized to the model's input, as
``predict_logits`` does for the whole photo. The ratio a run would choose is the best on validation (ties: the
larger ratio, the smaller change); ``test_gain`` is what that choice gives on test against the whole photo.
Nothing is chosen on test.

    python benchmarks/eval_crop.py --run RUN DS [--run RUN2 DS2 ...] [--ratios 1,0.9375,0.875,0.8125,0.75]

RUN: a `leaflens distill` output folder, DS: its dataset folder. Prints a table, then one JSON object as the last
line: per run and student ``val``/``test`` (accuracy by ratio), ``chosen_ratio``, ``test_gain``; and
``mean_test_gain`` over every student.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.data_prep.contract import centre_crop  # its checks refuse a ratio outside (0, 1]
from leaflens.pipeline.config import load_config

DEFAULT_RATIOS = (1.0, *load_config(None, []).distill.centre_crops)  # the whole photo and the crops distill tries


def chosen_ratio(val: dict[float, float]) -> float:
    """The ratio with the best validation accuracy; ties go to the larger ratio (the smaller change). (Distill's
    own choice, leaflens.pipeline.centre_crop.choose_crop, also asks the best crop to beat the whole photo by
    more than chance; this is the plain rule it was first measured with.)"""
    best = max(val.values())
    return max(r for r, acc in val.items() if acc == best)


def student_dirs(run: Path) -> list[Path]:
    """Every trained student of a run (distilled/, scratch/, <member>/distilled/ ...), not the kept copy."""
    return sorted(p.parent for p in run.rglob("best.npz") if p.parent != run)


def crop_accuracies(run: Path, ds: Any, ratios: Sequence[float]) -> dict[str, dict[str, Any]]:
    """Per student of ``run``: validation and test accuracy at each ratio on the loaded dataset ``ds``, the
    chosen ratio and its test gain."""
    from leaflens.pipeline.runs import load_model  # noqa: PLC0415
    from leaflens.pipeline.train_student import predict_logits  # noqa: PLC0415

    splits = {split: (np.asarray(ds[split].images), np.asarray(ds[split].labels)) for split in ("val", "test")}
    out: dict[str, dict[str, Any]] = {}
    for student in student_dirs(run):
        try:
            model, info = load_model(student)
        except (ValueError, OSError) as exc:  # CheckpointError, RecordError: an unreadable checkpoint
            sys.exit(f"eval_crop.py: {student}: {exc}")
        size = info.dataset.model_input_size
        row: dict[str, Any] = {}
        for split, (images, labels) in splits.items():
            row[split] = {r: float(np.mean(predict_logits(model, images, ds.mean, ds.std, size=size,
                                                          crop=None if r == 1.0 else r).argmax(1) == labels))
                          for r in ratios}
        row["chosen_ratio"] = chosen_ratio(row["val"])
        row["test_gain"] = row["test"][row["chosen_ratio"]] - row["test"][1.0]
        out[student.relative_to(run).as_posix()] = row
    return out


def load_run(run: str, ds_dir: str) -> Any:
    """The dataset of ``run`` after checking that the run has students and the dataset has labelled val and
    test splits; exits with one line naming the folder otherwise."""
    from leaflens.data_prep.manifest import DatasetError, load_dataset  # noqa: PLC0415

    if not Path(run).is_dir():
        sys.exit(f"eval_crop.py: run {run}: no such folder")
    if not student_dirs(Path(run)):
        sys.exit(f"eval_crop.py: run {run}: no trained student (no */best.npz; a `leaflens distill` output folder?)")
    try:
        ds = load_dataset(ds_dir)
    except DatasetError as exc:
        sys.exit(f"eval_crop.py: {exc}")
    for split in ("val", "test"):
        if split not in ds.splits or ds[split].labels is None:
            sys.exit(f"eval_crop.py: dataset {ds_dir} has no labelled '{split}' split")
    return ds


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", nargs=2, action="append", required=True, metavar=("RUN", "DATASET"),
                    help="a distill run folder and its dataset folder (repeat for more runs)")
    ap.add_argument("--ratios", default=",".join(map(str, DEFAULT_RATIOS)),
                    help="centre crop ratios to try, comma-separated; 1 (the whole photo) is always included")
    args = ap.parse_args(argv)
    try:
        ratios = sorted({1.0, *(float(r) for r in args.ratios.split(",") if r.strip())}, reverse=True)
        for r in ratios:
            centre_crop(np.zeros((1, 4, 4, 3), np.uint8), r)  # refuses a ratio outside (0, 1]
    except ValueError as exc:
        ap.error(f"--ratios: {exc}")
    datasets = {run: load_run(run, ds) for run, ds in args.run}  # all checked before the table starts
    results, gains = {}, []
    print(f"{'run / student':48s} {'split':5s} " + " ".join(f"{r:>7.4g}" for r in ratios) + "  chosen  test gain")
    for run, ds in datasets.items():
        per = crop_accuracies(Path(run), ds, ratios)
        results[run] = per
        for name, row in per.items():
            for split in ("val", "test"):
                tail = f"  {row['chosen_ratio']:>6.4g}  {100 * row['test_gain']:+.1f}" if split == "test" else ""
                print(f"{(run + ' / ' + name)[-48:]:48s} {split:5s} "
                      + " ".join(f"{100 * row[split][r]:7.1f}" for r in ratios) + tail)
            gains.append(row["test_gain"])
    mean_gain = float(np.mean(gains)) if gains else None
    print(f"mean test gain of the validation-chosen crop over {len(gains)} students: "
          + ("-" if mean_gain is None else f"{100 * mean_gain:+.2f} points"))
    print(json.dumps({"ratios": ratios, "runs": results, "mean_test_gain": mean_gain}))  # ratio keys as strings
    return 0


if __name__ == "__main__":
    sys.exit(main())
