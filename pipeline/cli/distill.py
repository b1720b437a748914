"""`leaflens distill`: train the student from the teacher and from scratch; keep the best model within the budget."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from leaflens.pipeline.cli import EXIT_REFUSED, EXIT_STOPPED, EXIT_USAGE, Once, interrupted, path_arg
from leaflens.pipeline.config import (
    DEFAULT_CONFIG,
    ConfigError,
    epochs_as_given,
    given_settings,
    load_config,
    sets_a_flag_overrides,
    settings_not_read,
)
from leaflens.pipeline.models.family import family_option


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "distill", help="students (distilled, from scratch); keep the best model within budget",
        description="Train the small students (--family) on a preprocessed dataset, learning from the teacher's "
                    "features (and logits), beside the same student trained from scratch; the best on the validation "
                    "split within the serving budget (--max-params, --max-ms) is kept: a student, or the "
                    "fine-tuned teacher when it serves (teacher.onnx) and beats the best student by "
                    "distill.teacher_margin. Writes checkpoints, metrics.jsonl, curves.png, confusion.png, "
                    f"report.json and report.md. Defaults: pipeline/{DEFAULT_CONFIG.name}.")
    p.add_argument("--dataset", type=path_arg, default=Path("artifacts/dataset"),
                   help="preprocessed dataset folder (default %(default)s)")
    p.add_argument("--teacher", type=path_arg, default=Path("artifacts/teacher"),
                   help="teacher folder, as `leaflens teacher` writes it (default %(default)s)")
    p.add_argument("--out", type=path_arg, default=Path("artifacts/student"),
                   help="run folder to write (default %(default)s)")
    p.add_argument("--config", type=path_arg, action=Once, help="TOML file overriding the defaults (once)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting, e.g. --set train.epochs=10 (repeatable)")
    p.add_argument("--no-teacher", action="store_true", help="train from scratch only (cross-entropy alone)")
    p.add_argument("--seed", type=int, help="random seed (same as --set train.seed=N)")
    p.add_argument("--epochs", type=int,
                   help="epochs, taken as given (same as --set train.epochs=N; the recipe's own epochs may be "
                        "raised on few photos to train.min_steps steps, which naming the epochs turns off)")
    p.add_argument("--max-params", type=int, metavar="N",
                   help="serving budget: keep no model with more than N parameters while one fits (none fits: "
                        "the best student is kept with a warning; 0: no limit; same as --set distill.max_params=N)")
    p.add_argument("--max-ms", type=float, metavar="MS",
                   help="serving budget: keep no model slower than MS milliseconds per photo at batch 1 on this "
                        "machine while one fits (none fits: the best student is kept with a warning; 0: no limit; "
                        "same as --set distill.max_ms=MS)")
    p.add_argument("--family", metavar="NAMES",
                   help="students to train and choose from on validation, comma-separated, e.g. lite8,m or m,m@128 "
                        "(default lite8: the first 8 blocks of ImageNet EfficientNet-Lite0 and a small head; liteN: "
                        "N blocks; s/m/l: the [model] CNN with widths x0.5/x1/x1.5; -ds: depthwise-separable; "
                        "@PX: input size; same as --set model.family='[\"lite8\", \"m\"]')")
    p.add_argument("--escalate", metavar="NAMES",
                   help="larger students, comma-separated, each trained (distilled) only while the teacher beats "
                        "every student so far by distill.teacher_margin on validation, e.g. lite16@128 (default none: "
                        "ship the teacher; same as --set model.escalate='[\"lite16@128\"]')")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run in <out>.partial; when it ends it replaces a finished <out>, "
                        "as the interrupted run would have (with no interrupted run, a finished <out> is left as "
                        "it is); settings changed since it began are listed in its report")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or epoch lines (bars are drawn only when stderr is a terminal)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from leaflens.data_prep.manifest import DatasetError  # noqa: PLC0415
    from leaflens.engine.checkpoint import CheckpointError  # noqa: PLC0415
    from leaflens.files import OutputBusy, output_folder  # noqa: PLC0415
    from leaflens.pipeline.distill import partial_dir, run_distill  # noqa: PLC0415
    from leaflens.pipeline.teachers.artefact import TeacherError  # noqa: PLC0415
    from leaflens.pipeline.training import TrainingStopped  # noqa: PLC0415

    overrides: list[str | tuple[str, str]] = list(args.overrides)
    if args.seed is not None:
        overrides.append((f"train.seed={args.seed}", f"--seed {args.seed}"))
    if args.epochs is not None:
        overrides.append((f"train.epochs={args.epochs}", f"--epochs {args.epochs}"))
    if args.max_params is not None:
        overrides.append((f"distill.max_params={args.max_params}", f"--max-params {args.max_params}"))
    if args.max_ms is not None:
        overrides.append((f"distill.max_ms={float(args.max_ms)!r}", f"--max-ms {args.max_ms}"))
    if args.family is not None:
        overrides.append((f"model.family={json.dumps(list(family_option(args.family)))}", f"--family {args.family}"))
    if args.escalate is not None:
        overrides.append((f"model.escalate={json.dumps(list(family_option(args.escalate)))}",
                          f"--escalate {args.escalate}"))
    try:
        cfg = load_config(args.config, [*overrides, *epochs_as_given(overrides, args.config, "distill")])
        given = given_settings(overrides, args.config)
    except ConfigError as exc:
        print(f"leaflens distill: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for typed, flag in sets_a_flag_overrides(overrides):
        print(f"leaflens distill: note: {flag} overrides {typed}", file=sys.stderr)
    for unread in settings_not_read(args.overrides, ("model", "train", "augment", "distill")):
        print(f"leaflens distill: warning: --set {unread} changes nothing here: [teacher] is the teacher stage's "
              "(`leaflens teacher --set ...`)", file=sys.stderr)
    teacher = None if args.no_teacher else args.teacher
    if teacher is not None and not (teacher / "teacher.json").exists():
        print(f"leaflens distill: no teacher at {teacher} (run `leaflens teacher` first, or pass --no-teacher)",
              file=sys.stderr)
        return EXIT_REFUSED
    try:
        report = run_distill(args.dataset, teacher, args.out, cfg, no_teacher=args.no_teacher,
                             resume=args.resume, progress=not args.quiet, family_given="model.family" in given)
    except (DatasetError, TeacherError, CheckpointError, ValueError, OutputBusy) as exc:
        fix = ("; without --resume the same command starts over (the interrupted run is then discarded)"
               if args.resume and isinstance(exc, CheckpointError) else "")
        print(f"leaflens distill: {exc}{fix}", file=sys.stderr)
        return EXIT_REFUSED
    except TrainingStopped as exc:
        print(f"leaflens distill: stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        return interrupted(partial_dir(output_folder(args.out)), "the run's")
    v = report["variants"]
    if report.get("selection"):
        v = {c["name"]: c for c in report["selection"]["candidates"]}
    why = (report.get("selection") or {}).get("why")
    test = report["test_accuracy"]
    print(f"kept: {report['winner']}{f' ({why})' if why else ''}: val accuracy {report['val_accuracy']:.4f}; "
          f"test accuracy {test if test is None else format(test, '.4f')}")
    if len(v) > 1:
        print("  " + ", ".join(f"{k}: val {x['val_accuracy']:.4f}" for k, x in v.items()))
    print(f"report: {args.out / 'report.md'}")
    return 0
