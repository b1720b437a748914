"""INT8 export: the old recipe against the new one, on the demo model and on iBeans.

    python benchmarks/int8.py [--demo artifacts/export] [--ibeans DIR] [--ibeans-data ../shared/data/ibeans]
                              [--grid] [--threads N] [--speed-seconds S]

Each model is an export folder written by `leaflens export` (student.onnx and parity.json, which names
the dataset the run was trained on; the dataset supplies the training images that calibrate INT8, and
the validation and test splits). ``--ibeans-data`` builds the iBeans export when ``--ibeans`` does not
hold one yet: preprocess (the given train/val/test split), a frozen EfficientNet-Lite0 teacher, the
default distillation recipe without the scratch comparison, and export, each step skipped when its
output exists.

Per model: FP32 accuracy on val and test; the old recipe (what `leaflens export` wrote before: min/max
ranges over 256 training images, per-channel weights, every layer quantised) and the new one (what
`leaflens export` keeps now: the first recipe of :func:`leaflens.pipeline.export.quantize.int8_ladder`
whose val accuracy is within 1 point of FP32's, else the last one tried): accuracy and top-1 agreement
with FP32 on val and test, whether the export rule (val accuracy within 1 point of FP32) writes it, CPU
throughput at batch 32 against FP32 (median of per-round ratios over interleaved rounds), and the time
quantisation took. ``--grid`` also measures candidate recipes on the VALIDATION split only: the
default recipes were chosen there, never on test.

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from leaflens.apps.model_card import ModelCard
from leaflens.data_prep.manifest import load_dataset
from leaflens.pipeline.export import parity
from leaflens.pipeline.export.quantize import (
    Int8Recipe,
    calibration_indices,
    int8_ladder,
    int8_shortfall,
    quantize_int8,
)

OLD_RECIPE = Int8Recipe(calibration="minmax", calib_images=256, per_channel=True, float_first_conv=False,
                        float_classifier=False, activations="uint8", reduce_range=False)
NEW_RECIPES = int8_ladder()
MAX_DROP = 0.01  # the export rule's default (ExportOptions.int8_max_drop)


STRUCTURES = {  # which layers stay in float: what decides INT8's speed (the ranges do not)
    "all int8": {"float_first_conv": False, "float_classifier": False},
    "classifier float": {"float_first_conv": False, "float_classifier": True},
    "first conv float": {"float_first_conv": True, "float_classifier": False},
    "both float": {"float_first_conv": True, "float_classifier": True},
}


def grid_recipes() -> dict[str, Int8Recipe]:
    """Every calibration method with every choice of float layers, then more images and per-tensor
    weights on the two structures that keep the first convolution in INT8."""
    methods = {"minmax": {"calibration": "minmax"},
               "percentile 99.999": {"calibration": "percentile", "percentile": 99.999},
               "percentile 99.99": {"calibration": "percentile", "percentile": 99.99},
               "entropy": {"calibration": "entropy"}}
    out = {f"{m}, {st}": replace(OLD_RECIPE, **mk, **sk)
           for st, sk in STRUCTURES.items() for m, mk in methods.items()}
    for st in ("all int8", "classifier float"):
        out[f"minmax 1024 images, {st}"] = replace(OLD_RECIPE, calib_images=1024, **STRUCTURES[st])
        out[f"minmax per-tensor weights, {st}"] = replace(OLD_RECIPE, per_channel=False,
                                                          **STRUCTURES[st])
        out[f"minmax 7-bit weights, {st}"] = replace(OLD_RECIPE, reduce_range=True, **STRUCTURES[st])
    return out


def structure(recipe: Int8Recipe) -> str:
    return next(k for k, v in STRUCTURES.items()
                if (recipe.float_first_conv, recipe.float_classifier) == tuple(v.values()))


class Model:
    """An exported FP32 model and the dataset it was trained on, with its val/test inputs ready."""

    def __init__(self, export_dir: Path, threads: int) -> None:
        self.fp32 = export_dir / "student.onnx"
        report = json.loads((export_dir / "parity.json").read_text(encoding="utf-8"))
        self.ds = load_dataset(report["dataset"]["root"])
        graph = onnx.load(str(self.fp32))
        card = ModelCard.from_metadata({p.key: p.value for p in graph.metadata_props}, str(self.fp32))
        self.size, self.crop = card.input_size, card.contract.centre_crop  # the photos as the model is served them
        self.mean, self.std = np.asarray(self.ds.mean, np.float32), np.asarray(self.ds.std, np.float32)
        self.threads = threads
        self.splits = {s: parity.at_size(self.ds[s].images, self.size, self.crop) for s in ("val", "test")}
        self.labels = {s: np.asarray(self.ds[s].labels) for s in ("val", "test")}
        sess = parity.cpu_session(self.fp32, threads)
        self.fp32_logits = {s: parity.onnx_logits(sess, x, self.mean, self.std) for s, x in self.splits.items()}
        self.fp32_acc = {s: parity.accuracy(v, self.labels[s]) for s, v in self.fp32_logits.items()}
        self.batch32 = self._batch32()

    def _batch32(self) -> np.ndarray:
        x = next(parity.batches(self.splits["test"][:32], self.mean, self.std, 32)).transpose(0, 3, 1, 2)
        return np.ascontiguousarray(np.resize(x, (32, *x.shape[1:])))

    def quantize(self, recipe: Int8Recipe, out: Path) -> tuple[Path, float]:
        train = self.ds["train"]
        idx = calibration_indices(len(train), recipe.calib_images)
        calib = parity.at_size(train.images, self.size, self.crop)[idx]
        q = quantize_int8(self.fp32, out, calib, self.mean, self.std, recipe)
        return q.path, q.seconds

    def measure(self, int8_path: Path, splits: tuple[str, ...]) -> dict[str, float]:
        sess = parity.cpu_session(int8_path, self.threads)
        out: dict[str, float] = {}
        for s in splits:
            logits = parity.onnx_logits(sess, self.splits[s], self.mean, self.std)
            out[f"{s}_acc"] = parity.accuracy(logits, self.labels[s])
            out[f"{s}_agreement"] = float(np.mean(logits.argmax(1) == self.fp32_logits[s].argmax(1)))
        return out

    def throughput(self, paths: dict[str, Path], seconds: float, rounds: int) -> dict[str, list[float]]:
        """Images/s at batch 32 of each model, measured in ``rounds`` interleaved rounds (a shared CPU's
        load changes within seconds; a ratio of two figures from the same round is what holds)."""
        sessions = {k: parity.cpu_session(p, self.threads) for k, p in paths.items()}
        name = {k: s.get_inputs()[0].name for k, s in sessions.items()}
        for k, sess in sessions.items():  # warm-up: the first runs allocate and pick kernels
            sess.run(None, {name[k]: self.batch32})
        out: dict[str, list[float]] = {k: [] for k in sessions}
        for _ in range(rounds):
            for k, sess in sessions.items():
                runs, t0 = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - t0) < seconds or runs < 3:
                    sess.run(None, {name[k]: self.batch32})
                    runs += 1
                out[k].append(runs * len(self.batch32) / elapsed)
        return out


def compare(name: str, model: Model, work: Path, seconds: float, rounds: int) -> dict[str, Any]:
    """Old and new recipe on val and test, with speed: the figures under ``<name>_...``."""
    fig: dict[str, Any] = {f"{name}_fp32_val_acc": model.fp32_acc["val"],
                           f"{name}_fp32_test_acc": model.fp32_acc["test"]}
    paths = {"fp32": model.fp32}
    for tag, recipes in (("before", (OLD_RECIPE,)), ("after", NEW_RECIPES)):
        secs = 0.0
        for recipe in recipes:  # as the export does: the first within the drop on val is kept
            paths[tag], took = model.quantize(recipe, work / f"{name}_{tag}.onnx")
            secs += took
            m = model.measure(paths[tag], ("val", "test"))
            if int8_shortfall(model.fp32_acc["val"], m["val_acc"], MAX_DROP) is None:
                break
        fig[f"{name}_int8_recipe_{tag}"] = recipe.describe()
        fig[f"{name}_int8_val_acc_{tag}"] = m["val_acc"]
        fig[f"{name}_int8_test_acc_{tag}"] = m["test_acc"]
        fig[f"{name}_int8_agreement_val_{tag}"] = m["val_agreement"]
        fig[f"{name}_int8_agreement_test_{tag}"] = m["test_agreement"]
        fig[f"{name}_int8_written_{tag}"] = int8_shortfall(model.fp32_acc["val"], m["val_acc"], MAX_DROP) is None
        fig[f"{name}_int8_quantize_s_{tag}"] = secs
    speed = model.throughput(paths, seconds, rounds)
    fig[f"{name}_fp32_img_s"] = statistics.median(speed["fp32"])
    for tag in ("before", "after"):
        fig[f"{name}_int8_speedup_{tag}"] = statistics.median(a / b for a, b in zip(speed[tag], speed["fp32"]))
    fig[f"{name}_int8_speedup"] = fig[f"{name}_int8_speedup_after"]
    return fig


def grid(name: str, model: Model, work: Path, seconds: float, rounds: int) -> list[dict[str, Any]]:
    """Every candidate recipe on the validation split only (what the default is chosen on), and the
    speed of each structure (which layers stay in float) against FP32."""
    rows, by_structure = [], {"fp32": model.fp32}
    for label, recipe in grid_recipes().items():
        path, secs = model.quantize(recipe, work / f"{name}_grid_{len(rows)}.onnx")
        m = model.measure(path, ("val",))
        by_structure.setdefault(structure(recipe), path)
        rows.append({"model": name, "recipe": label, "structure": structure(recipe), "val_acc": m["val_acc"],
                     "val_agreement": m["val_agreement"], "val_change": m["val_acc"] - model.fp32_acc["val"],
                     "quantize_s": secs})
    speed = model.throughput(by_structure, seconds, rounds)
    for row in rows:
        row["speedup"] = statistics.median(a / b for a, b in zip(speed[row["structure"]], speed["fp32"]))
        print(f"{name:<7} {row['recipe']:<42} val {row['val_acc']:.2%} ({100 * row['val_change']:+.1f} pts), "
              f"agreement {row['val_agreement']:.2%}, {row['speedup']:.2f}x FP32, quantised in "
              f"{row['quantize_s']:.1f} s", file=sys.stderr, flush=True)
    return rows


def build_ibeans(data: Path, work: Path) -> Path:
    """preprocess -> frozen teacher -> distill -> export under ``work`` (steps whose output exists are skipped)."""
    cli = [sys.executable, "-m", "leaflens"]
    steps = [
        (work / "dataset" / "manifest.json", ["preprocess", "--src", str(data), "--out", str(work / "dataset")]),
        (work / "teacher" / "teacher.json", ["teacher", "--dataset", str(work / "dataset"), "--out",
                                              str(work / "teacher"), "--frozen"]),
        (work / "student" / "best.npz", ["distill", "--dataset", str(work / "dataset"), "--teacher",
                                         str(work / "teacher"), "--out", str(work / "student"),
                                         "--set", "distill.compare_scratch=false"]),
        (work / "export" / "parity.json", ["export", "--run", str(work / "student"), "--dataset",
                                           str(work / "dataset"), "--out", str(work / "export")]),
    ]
    for done, args in steps:
        if not done.exists():
            print(f"$ leaflens {' '.join(args)}", file=sys.stderr, flush=True)
            subprocess.run([*cli, *args], check=True)
    return work / "export"


def table(figs: dict[str, Any], names: list[str]) -> str:
    lines = [f"{'model':<7} {'recipe':<7} {'val acc':>8} {'test acc':>9} {'agree val':>10} {'agree test':>11} "
             f"{'written':>8} {'speedup':>8} {'quant s':>8}"]
    for n in names:
        lines.append(f"{n:<7} {'fp32':<7} {figs[f'{n}_fp32_val_acc']:>8.2%} {figs[f'{n}_fp32_test_acc']:>9.2%} "
                     f"{'':>10} {'':>11} {'':>8} {'1.00x':>8} {'':>8}")
        for tag in ("before", "after"):
            lines.append(
                f"{n:<7} {tag:<7} {figs[f'{n}_int8_val_acc_{tag}']:>8.2%} {figs[f'{n}_int8_test_acc_{tag}']:>9.2%} "
                f"{figs[f'{n}_int8_agreement_val_{tag}']:>10.2%} {figs[f'{n}_int8_agreement_test_{tag}']:>11.2%} "
                f"{'yes' if figs[f'{n}_int8_written_{tag}'] else 'no':>8} "
                f"{figs[f'{n}_int8_speedup_{tag}']:>7.2f}x {figs[f'{n}_int8_quantize_s_{tag}']:>8.1f}")
    for n in names:
        for tag in ("before", "after"):
            lines.append(f"{n} {tag}: {figs[f'{n}_int8_recipe_{tag}']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", type=Path, default=Path("artifacts/export"),
                   help="export folder of the demo model (`make export`; default artifacts/export)")
    p.add_argument("--ibeans", type=Path, default=None, help="export folder of an iBeans student")
    p.add_argument("--ibeans-data", type=Path, default=None,
                   help="iBeans photos (train/val/test folders): build the --ibeans export when it is missing")
    p.add_argument("--ibeans-work", type=Path, default=Path("artifacts/ibeans-int8"),
                   help="where --ibeans-data builds the iBeans dataset, teacher, student and export")
    p.add_argument("--grid", action="store_true", help="also measure candidate recipes on the validation split")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime CPU threads (default 2)")
    p.add_argument("--speed-seconds", type=float, default=1.0,
                   help="timing per model, recipe and round (default 1)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds; the median ratio is "
                                                        "reported (default 7)")
    args = p.parse_args()

    exports: dict[str, Path] = {}
    if (args.demo / "parity.json").exists():
        exports["demo"] = args.demo
    else:
        print(f"no demo export at {args.demo} (run `make export`); skipping the demo model", file=sys.stderr)
    ibeans = args.ibeans
    if ibeans is None and args.ibeans_data is not None:
        if not args.ibeans_data.is_dir():
            sys.exit(f"--ibeans-data {args.ibeans_data}: no such folder")
        ibeans = build_ibeans(args.ibeans_data, args.ibeans_work)
    if ibeans is not None:
        if not (ibeans / "parity.json").exists():
            sys.exit(f"--ibeans {ibeans}: no parity.json there (not an export folder)")
        exports["ibeans"] = ibeans
    if not exports:
        sys.exit("nothing to measure: give --demo and/or --ibeans/--ibeans-data")

    figs: dict[str, Any] = {"threads": args.threads, "old_recipe": OLD_RECIPE.to_dict(),
                            "new_recipes": [r.to_dict() for r in NEW_RECIPES], "max_drop": MAX_DROP}
    grid_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="leaflens-int8-") as tmp:
        for name, export_dir in exports.items():
            model = Model(export_dir, args.threads)
            if args.grid:
                grid_rows += grid(name, model, Path(tmp), args.speed_seconds, args.rounds)
            figs.update(compare(name, model, Path(tmp), args.speed_seconds, args.rounds))
    if grid_rows:
        figs["grid_val"] = grid_rows
    print(table(figs, list(exports)))
    print(json.dumps(figs))


if __name__ == "__main__":
    main()
