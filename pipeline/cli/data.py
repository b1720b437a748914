"""`leaflens data synth`: write the built-in synthetic leaf dataset (leaflens.data_prep.synth)."""

from __future__ import annotations

import argparse
import sys

from leaflens.cpus import WorkerDied
from leaflens.data_prep.synth import SynthOptions, generate
from leaflens.files import NotOurFolderError
from leaflens.pipeline.cli import EXIT_REFUSED, EXIT_USAGE, path_text_arg


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="built-in datasets (synthetic leaves)",
                              description="Built-in datasets. `leaflens data synth --out DIR` draws the "
                                          "synthetic leaf dataset (8 classes of photo-like JPEGs).")
    sub = p.add_subparsers(dest="data_command", metavar="DATASET")
    s = sub.add_parser("synth", help="procedural photo-like leaf dataset (8 disease/pest classes)",
                       description="Write OUT/<class>/*.jpg, OUT/classes.toml and OUT/synth.json. Seeded "
                                   "and reproducible; does nothing when OUT already holds the same options.")
    d = SynthOptions()
    s.add_argument("--out", required=True, type=path_text_arg, help="folder to write (replaced atomically)")
    s.add_argument("--per-class", type=int, default=d.per_class,
                   help=f"images per class (default {d.per_class})")
    s.add_argument("--size", type=int, default=d.size, help=f"image side in pixels (default {d.size})")
    s.add_argument("--seed", type=int, default=d.seed, help=f"random seed (default {d.seed})")
    s.add_argument("--broken", type=int, default=d.broken,
                   help=f"deliberately broken files to include (default {d.broken})")
    s.add_argument("--exif-fraction", type=float, default=d.exif_fraction,
                   help=f"fraction stored rotated with an EXIF orientation tag (default {d.exif_fraction})")
    s.add_argument("--unlabeled-fraction", type=float, default=d.unlabeled_fraction, metavar="F",
                   help="share of each class's photos written to OUT/unlabeled/ with their labels withheld "
                        "(seeded; names do not tell the class; synth.json keeps the classes for checks): "
                        "the pipeline uses them for the teacher's targets and distillation, not as labels "
                        f"(default {d.unlabeled_fraction}; `make demo` uses 0.5)")
    s.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    s.add_argument("--force", action="store_true", help="regenerate even if up to date")
    s.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])
    return p


def run(args: argparse.Namespace) -> int:
    opts = SynthOptions(per_class=args.per_class, size=args.size, seed=args.seed, broken=args.broken,
                        exif_fraction=args.exif_fraction, unlabeled_fraction=args.unlabeled_fraction)
    try:
        generate(args.out, opts, workers=args.workers, force=args.force, progress=sys.stderr.isatty())
    except (NotOurFolderError, WorkerDied) as exc:  # --out names a folder of someone else's files; a worker died
        print(f"leaflens data synth: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except ValueError as exc:  # the options
        print(f"leaflens data synth: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0
