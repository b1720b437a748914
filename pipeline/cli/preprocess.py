"""`leaflens preprocess`: folders of leaf photos -> memory-mapped arrays + manifest (leaflens.data_prep.ingest)."""

from __future__ import annotations

import argparse
import sys

from leaflens.cpus import WorkerDied
from leaflens.data_prep.decode import DEFAULT_MAX_PIXELS
from leaflens.data_prep.ingest import IngestError, IngestOptions, check_options, ingest
from leaflens.data_prep.scan import ScanError
from leaflens.data_prep.split import parse_ratios
from leaflens.files import json_with, results_file_problem
from leaflens.pipeline.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, path_text_arg


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "preprocess",
        help="photos in class folders -> memory-mapped arrays + manifest",
        description="Decode every photo under --src (ROOT/<class>/* or ROOT/{train,val,test}/<class>/*, "
                    "plus ROOT/unlabeled/) into uint8 arrays in --out, with manifest.json, rejected.jsonl and "
                    "data_report.json (exact and near duplicates within and across classes and splits, photos "
                    "per class, and whether image size, format or EXIF alone predict the class; printed too). "
                    "Re-running with unchanged input and options does nothing. --check runs the checks alone.",
    )
    p.add_argument("--src", required=True, type=path_text_arg, help="folder of photos")
    p.add_argument("--out", default=None, type=path_text_arg,
                   help="dataset folder to write (replaced atomically); required, but for --check, which writes none")
    p.add_argument("--check", action="store_true",
                   help="run the data checks and the refusals only, decoding small: prints the report, writes no "
                        "dataset; exit code 1 when preprocess would refuse the data")
    p.add_argument("--report", default=None, type=path_text_arg, metavar="PATH",
                   help="also write the data report (JSON) to PATH")
    p.add_argument("--dedupe", action="store_true",
                   help="remove duplicates (exact or near) within a split and across splits, keeping the copy in the "
                        "earliest split (train, val, test); a photo filed under two classes loses every copy. "
                        "data_report.json lists what was removed")
    p.add_argument("--size", type=int, default=IngestOptions.size,
                   help="square output size in pixels, 8 to 2048 (default 128: twice the student's 64 px input, "
                        "so its training crops are cut from a sharper image; see model.input_size)")
    p.add_argument("--resize", choices=("crop", "pad"), default="crop",
                   help="centre crop (default) or letterbox pad to a square")
    p.add_argument("--split", default="70/15/15",
                   help="train/val/test shares for ROOT/<class>/ layouts: percentages adding up to 100, or fractions "
                        "adding up to 1 (default 70/15/15)")
    p.add_argument("--seed", type=int, default=0, help="seed of the automatic split (default 0)")
    p.add_argument("--unlabeled", default=None, type=path_text_arg,
                   help="extra folder of unlabelled photos (split 'unlabeled')")
    p.add_argument("--also", action="append", type=path_text_arg, default=[], metavar="DIR",
                   help="extra folder of labelled photos, DIR/<class>/*, e.g. the web app's corrections folder "
                        "(leaflens serve --corrections): merged into the source's classes (with train/val/test "
                        "folders: into train). A class the source lacks is refused; DIR/not_a_leaf/ is skipped "
                        "with a note. Repeatable")
    p.add_argument("--workers", type=int, default=None, help="decode processes (default: all cores)")
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                   help=f"refuse images declaring more pixels than this (default {DEFAULT_MAX_PIXELS})")
    p.add_argument("--force", action="store_true", help="rebuild even if the output is up to date")
    p.add_argument("--strict", action="store_true",
                   help="refuse classes with fewer than 3 usable photos instead of warning about them")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        if args.out is None and not args.check:
            raise ValueError("--out is required (or --check to run the data checks alone)")
        if args.out is not None and args.check:
            raise ValueError("--check writes no dataset: leave out --out (or --check, to build it)")
        opts = IngestOptions(size=args.size, resize=args.resize, ratios=parse_ratios(args.split),
                             seed=args.seed, max_pixels=args.max_pixels, dedupe=args.dedupe or None)
        check_options(opts)
        if args.workers is not None and args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        if args.report and (problem := results_file_problem(args.report, {"the photos": args.src},
                                                                ours=json_with(("source", "layout", "decode_size")))):
            raise ValueError(f"--report {problem}")
    except (ValueError, IngestError) as exc:
        print(f"leaflens preprocess: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        ingest(args.src, None if args.check else args.out, opts, unlabeled=args.unlabeled, workers=args.workers,
               progress=not args.no_progress and sys.stderr.isatty(), force=args.force,
               strict=args.strict, check=args.check, report_path=args.report, also=args.also)
    except (IngestError, ScanError, ValueError, WorkerDied) as exc:
        print(f"leaflens preprocess: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK
