"""`leaflens predict`: classify image files and folders with an exported ONNX model.

Files named on the command line are classified whatever their extension; folders are searched
recursively for image files (leaflens.data_prep.scan.IMAGE_EXTENSIONS, hidden entries skipped). Images go
through the model in batches with a progress bar; an unreadable image does not stop the run, it
gets a row with an error instead. Exit code: 0 all images classified, 1 some could not be read,
2 usage or model errors (nothing classified).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from leaflens.apps.model_card import ModelError
from leaflens.apps.predictor import Prediction, Predictor
from leaflens.data_prep.scan import IMAGE_EXTENSIONS
from leaflens.files import write_path_atomic

__all__ = ["add_parser", "collect_images", "run", "write_csv"]


class UsageError(ValueError):
    """A command-line problem (missing path, nothing to classify)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "predict",
        help="classify image files and folders with an exported model",
        description="Classify photos (files, or folders searched recursively) with an exported leaflens "
                    "ONNX model. Prints one line per image, or writes --csv with the top-k classes, the "
                    "uncertain flag and an error column for unreadable files. Exit code 0: all classified; "
                    "1: some files could not be read; 2: usage or model error.",
    )
    p.add_argument("images", nargs="+", metavar="IMAGES", help="image files and/or folders")
    p.add_argument("--model", required=True, help="exported model (.onnx with leaflens metadata)")
    p.add_argument("--csv", default=None, help="write the results to this CSV file (written atomically)")
    p.add_argument("--top-k", type=int, default=3, help="classes to report per image (default 3)")
    p.add_argument("--batch-size", type=int, default=32, help="images per model call (default 32)")
    p.add_argument("--threads", type=int, default=None,
                   help="onnxruntime intra-op threads (default: the CPUs this process may use)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def collect_images(args: Sequence[str | os.PathLike]) -> list[str]:
    """Expand files and folders into a de-duplicated list of image paths, in a stable order.

    Raises :class:`UsageError` naming a path that does not exist.
    """
    found: list[str] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                found.extend(
                    os.path.join(dirpath, name) for name in sorted(filenames)
                    if not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
                )
        elif path.exists():
            found.append(os.fspath(path))
        else:
            raise UsageError(f"{os.fspath(path)}: no such file or folder")
    seen: set[str] = set()
    unique = []
    for name in found:
        key = os.path.realpath(name)
        if key not in seen:
            seen.add(key)
            unique.append(name)
    return unique


def write_csv(path: str | os.PathLike, predictions: Iterable[Prediction], top_k: int) -> None:
    """Write one row per image: path, label, probability, uncertain, class_i/prob_i, error.

    Written to a temporary file beside ``path`` and renamed into place, so a reader never sees a
    half-written file.
    """
    target = Path(path)
    header = ["path", "label", "probability", "uncertain"]
    for i in range(1, top_k + 1):
        header += [f"class_{i}", f"prob_{i}"]
    header.append("error")

    def write(tmp: Path) -> None:
        with open(tmp, "x", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(header)
            for p in predictions:
                row: list[str | None]  # csv writes None as an empty cell
                if p.ok:
                    row = [p.source, p.label, f"{p.confidence:.6f}", str(p.uncertain).lower()]
                    ranked = [v for cls, prob in p.top for v in (cls, f"{prob:.6f}")]
                    row += ranked + [""] * (2 * top_k - len(ranked)) + [""]
                else:
                    row = [p.source, "", "", "", *[""] * (2 * top_k), p.error]
                writer.writerow(row)

    write_path_atomic(target, write)


def _line(p: Prediction) -> str:
    if not p.ok:
        return f"{p.source}\tERROR\t{p.error}"
    ranked = ", ".join(f"{cls} {prob:.3f}" for cls, prob in p.top)
    return f"{p.source}\t{p.label}{' (uncertain)' if p.uncertain else ''}\t{ranked}"


def run(args: argparse.Namespace) -> int:
    prog = "leaflens predict"
    try:
        if args.top_k < 1:
            raise UsageError(f"--top-k must be >= 1, got {args.top_k}")
        if args.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.threads is not None and args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        if args.csv and not Path(args.csv).resolve().parent.is_dir():
            raise UsageError(f"{args.csv}: the folder for the CSV file does not exist")
        files = collect_images(args.images)
        if not files:
            raise UsageError(f"no image files found in {', '.join(map(str, args.images))}")
        predictor = Predictor(args.model, intra_op_threads=args.threads)
    except (UsageError, ModelError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2

    from tqdm import tqdm

    top_k = min(args.top_k, len(predictor.classes))
    results: list[Prediction] = []
    with tqdm(total=len(files), unit="img", desc="predict", file=sys.stderr,
              disable=True if args.no_progress else None) as bar:
        for prediction in predictor.iter_predict_files(files, top_k=top_k, batch_size=args.batch_size):
            results.append(prediction)
            if not args.csv:
                bar.write(_line(prediction), file=sys.stdout)
            bar.update(1)
    if args.csv:
        write_csv(args.csv, results, top_k)

    failed = sum(not p.ok for p in results)
    uncertain = sum(p.ok and p.uncertain for p in results)
    summary = (f"{len(results)} images with {predictor.model_path.name} on {predictor.provider}: "
               f"{len(results) - failed} classified ({uncertain} uncertain), {failed} unreadable")
    if args.csv:
        summary += f"; results in {args.csv}"
    print(summary, file=sys.stderr)
    return 1 if failed else 0
