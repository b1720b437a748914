"""`leaflens export`: a trained run -> ONNX FP32/FP16/INT8 with a parity report and a Triton repository."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from leaflens.pipeline.cli import EXIT_REFUSED, EXIT_USAGE, path_arg

if TYPE_CHECKING:
    from leaflens.pipeline.export.quantize import Int8Recipe


def add_parser(subparsers) -> argparse.ArgumentParser:
    from leaflens.pipeline.export.quantize import Int8Recipe  # noqa: PLC0415

    default = Int8Recipe()
    p = subparsers.add_parser(
        "export",
        help="kept model -> ONNX (FP32, FP16, INT8 within 1 point) + Triton repository",
        description="Export the model the run kept (its student in best.npz, or the fine-tuned teacher when the run "
                    "kept it: teacher_model.npz, served under the same file names) to ONNX (student.onnx FP32, "
                    "student_fp16.onnx, and "
                    "student_int8.onnx when its validation accuracy is within --int8-max-drop of FP32's), "
                    "check engine-vs-onnxruntime parity on the validation split and the served model's "
                    "accuracy on the test split's original photo files (parity.json), and write a Triton "
                    "model repository. Fails (exit 1, nothing replaced) when FP32/FP16 parity does not hold "
                    "or the served test accuracy is more than 0.5 points from the engine's.",
    )
    p.add_argument("--run", type=path_arg, default=Path("artifacts/student"),
                   help="trained run folder holding best.npz (default artifacts/student)")
    p.add_argument("--out", type=path_arg, default=Path("artifacts/export"),
                   help="output folder, replaced atomically (default artifacts/export)")
    p.add_argument("--dataset", type=path_arg, default=None,
                   help="the dataset the run was trained on, for calibration and parity (default: the one the "
                        "run's best.npz names, confirmed by its manifest's SHA-256, also after the project "
                        "folder was moved)")
    p.add_argument("--triton", type=path_arg, default=None,
                   help="Triton model repository to write <name>/ into (default OUT/triton)")
    p.add_argument("--name", default="leaflens_student", help="Triton model name (default leaflens_student)")
    p.add_argument("--triton-variant", choices=("fp32", "fp16", "int8"), default="fp32",
                   help="model file the Triton repository serves (default fp32: runs on CPU and GPU)")
    p.add_argument("--max-batch-size", type=int, default=64, help="Triton max_batch_size (default 64)")
    p.add_argument("--queue-delay-us", type=int, default=2000,
                   help="Triton dynamic_batching max_queue_delay_microseconds (default 2000)")
    p.add_argument("--no-int8", action="store_true", help="skip the INT8 variant")
    p.add_argument("--no-ood", action="store_true",
                   help="export without the out-of-domain score output (photos unlike the training photos "
                        "then get a class name like any other)")
    p.add_argument("--no-ood-branch", action="store_true",
                   help="the out-of-domain score reads the model's own feature maps only (block-mahalanobis-1), "
                        "without the frozen EfficientNet-Lite0 branch (smaller and faster, detects less)")
    p.add_argument("--ood-budget", type=float, default=0.03,
                   help="share of genuine new photos the out-of-domain check may flag, with 90%% confidence; its "
                        "threshold is chosen on the validation photos (default 0.03)")
    p.add_argument("--int8-max-drop", type=float, default=0.01,
                   help="write INT8 only when its validation accuracy is at most this far below FP32's "
                        "(a fraction; default 0.01 = 1 point)")
    p.add_argument("--int8-calibration", choices=("minmax", "percentile", "entropy"), default=default.calibration,
                   help=f"how INT8 activation ranges are set from the calibration images (default "
                        f"{default.calibration})")
    p.add_argument("--int8-percentile", type=float, default=default.percentile,
                   help=f"share of values the percentile ranges hold (default {default.percentile:g})")
    p.add_argument("--calib-images", type=int, default=default.calib_images,
                   help=f"training images used to calibrate INT8 (default {default.calib_images})")
    p.add_argument("--int8-per-channel", action=argparse.BooleanOptionalAction, default=default.per_channel,
                   help="one weight scale per output channel (default) or one per tensor")
    p.add_argument("--int8-float-first-conv", choices=("auto", "yes", "no"), default="auto",
                   help="keep the first convolution in float: slower, more accurate (default auto: try without, "
                        "then with it when INT8 loses too much)")
    p.add_argument("--int8-float-classifier", action=argparse.BooleanOptionalAction,
                   default=default.float_classifier, help="keep the classifier in float (default: yes)")
    p.add_argument("--int8-activations", choices=("uint8", "int8"), default=default.activations,
                   help="INT8 activation type (default uint8; weights are always int8)")
    p.add_argument("--int8-weight-bits", type=int, choices=(7, 8), default=7 if default.reduce_range else 8,
                   help="bits of the INT8 weights (default 8). 7 (-64..64) for x86 CPUs without VNNI (most before "
                        "2020): they sum int8 products in 16 bits, which 8-bit weights can saturate, so a file "
                        "checked on a VNNI CPU (parity.json's int8.checked_on) may score lower there")
    p.add_argument("--speed-seconds", type=float, default=1.0,
                   help="time spent timing each variant on the CPU (default 1.0)")
    p.add_argument("--threads", type=int, default=None, help="onnxruntime CPU threads (default: usable CPUs)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (warnings still), as teacher and distill --quiet")
    p.add_argument("--allow-dataset-mismatch", action="store_true",
                   help="export even if --dataset is not the dataset the run was trained on")
    p.set_defaults(func=run)
    _INT8_DEFAULTS.update({a.dest: a.default for a in p._actions  # noqa: SLF001
                           if a.dest.startswith("int8_") or a.dest == "calib_images"})
    return p


_INT8_DEFAULTS: dict[str, object] = {}  # the --int8-* options' defaults, to tell the ones a person typed


def int8_options_with_no_int8(args: argparse.Namespace) -> list[str]:
    """The --int8-* options given other values beside --no-int8, which would make them do nothing (a usage
    error, as the teacher's flags that do nothing)."""
    if not getattr(args, "no_int8", False):
        return []
    return [f"--{dest.replace('_', '-')}" for dest, default in _INT8_DEFAULTS.items()
            if getattr(args, dest, default) != default]


def int8_recipes(args: argparse.Namespace) -> tuple[Int8Recipe, ...]:
    """The INT8 recipes to try, in order, from the --int8-* options."""
    from leaflens.pipeline.export.quantize import Int8Recipe, int8_ladder  # noqa: PLC0415

    base = Int8Recipe(calibration=args.int8_calibration, percentile=args.int8_percentile,
                      calib_images=args.calib_images, per_channel=args.int8_per_channel,
                      float_first_conv=args.int8_float_first_conv == "yes",
                      float_classifier=args.int8_float_classifier, activations=args.int8_activations,
                      reduce_range=args.int8_weight_bits == 7)
    return int8_ladder(base) if args.int8_float_first_conv == "auto" else (base,)


def run(args: argparse.Namespace) -> int:
    from leaflens.data_prep.manifest import DatasetError  # noqa: PLC0415
    from leaflens.engine.checkpoint import CheckpointError  # noqa: PLC0415
    from leaflens.engine.onnx_export import ExportError  # noqa: PLC0415
    from leaflens.pipeline.export.stage import ExportFailed, ExportOptions, export_run, summary  # noqa: PLC0415
    from leaflens.pipeline.export.triton import TritonConfigError  # noqa: PLC0415

    if idle := int8_options_with_no_int8(args):
        print(f"leaflens export: error: {', '.join(idle)} do{'es' if len(idle) == 1 else ''} nothing with --no-int8 "
              "(no INT8 file is made); leave one or the other out", file=sys.stderr)
        return EXIT_USAGE
    try:
        recipes = int8_recipes(args)
    except ValueError as exc:
        print(f"leaflens export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not (Path(args.run) / "best.npz").is_file():
        what = "does not exist" if not Path(args.run).exists() else "holds no best.npz"
        print(f"leaflens export: error: run folder {args.run} {what}: `leaflens distill` trains one "
              "(another run: --run RUN)", file=sys.stderr)
        return EXIT_REFUSED
    try:
        opts = ExportOptions(run=args.run, out=args.out, dataset=args.dataset, triton=args.triton, name=args.name,
                             int8=not args.no_int8, triton_variant=args.triton_variant,
                             max_batch_size=args.max_batch_size, queue_delay_us=args.queue_delay_us,
                             int8_max_drop=args.int8_max_drop, int8_recipes=recipes,
                             speed_seconds=args.speed_seconds, threads=args.threads,
                             allow_dataset_mismatch=args.allow_dataset_mismatch, ood=not args.no_ood,
                             ood_branch=not args.no_ood_branch, ood_budget=args.ood_budget)
    except ValueError as exc:
        print(f"leaflens export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def log(msg: str) -> None:
        if not args.quiet or msg.startswith(("warning", "INT8 not written")):
            print(msg, file=sys.stderr, flush=True)

    try:
        report = export_run(opts, log=log)
    except (ExportFailed, ExportError, TritonConfigError, CheckpointError, DatasetError) as exc:
        print(f"leaflens export: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(summary(report))
    print(f"wrote {Path(args.out) / 'parity.json'}")
    return 0
