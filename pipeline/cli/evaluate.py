"""`leaflens evaluate`: accuracy, per-class table and confusion matrix of an exported model on photo files.

Exit code: 0 every photo evaluated; 1 some photos (in the class folders or --not-known) could not be read
(the figures are over the rest), or none could; 2 usage or model error (missing folder, a class folder the
model does not know, no photos, bad model).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from leaflens.apps.model_arg import add_model_argument, missing_model
from leaflens.apps.providers import add_provider_argument, requested_providers, unmet_request
from leaflens.pipeline.cli import path_arg


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "evaluate",
        help="accuracy of an exported model on photo files in class folders",
        description="Evaluate the SERVED model: the exported ONNX file run by onnxruntime on raw photo files, "
                    "preprocessed by the contract recorded in the model, as `leaflens predict` and the web app "
                    "run it. PHOTOS holds one folder per class, named like the model's classes. Prints the "
                    "accuracy, a per-class table and the confusion matrix. Exit code 0: all photos evaluated; "
                    "1: some photos could not be read; 2: usage or model error.",
    )
    add_model_argument(p)
    p.add_argument("folder", nargs="?", type=path_arg, metavar="PHOTOS",
                   help="folder of class folders: PHOTOS/<class>/*.jpg (or --photos PHOTOS)")
    p.add_argument("--photos", type=path_arg, default=None, help="the same folder, named as an option")
    p.add_argument("--not-known", type=path_arg, default=None, metavar="FOLDER",
                   help="also photos of no class of the model (other crops, insects, anything): how many it calls "
                        "'not a photo this model knows' or 'unsure', and how many get a diagnosis they should not")
    p.add_argument("--json", type=path_arg, default=None, help="also write the figures to this JSON file (atomically)")
    p.add_argument("--batch-size", type=int, default=32, help="photos per model call (default 32)")
    p.add_argument("--threads", type=int, default=None,
                   help="onnxruntime intra-op threads (default: the CPUs this process may use)")
    add_provider_argument(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from leaflens.apps.model_card import ModelError  # noqa: PLC0415
    from leaflens.apps.predictor import Predictor  # noqa: PLC0415
    from leaflens.files import json_with, results_file_problem, write_json_atomic  # noqa: PLC0415
    from leaflens.pipeline.evaluate import (  # noqa: PLC0415
        EvaluationError,
        NoPhotoReadable,
        evaluate_not_known,
        evaluate_photos,
        format_evaluation,
    )

    prog = "leaflens evaluate"
    if (args.folder is None) == (args.photos is None):
        print(f"{prog}: error: give the folder of class folders once: leaflens evaluate PHOTOS (or --photos PHOTOS)"
              + (f", not both {args.folder} and {args.photos}" if args.folder is not None else ""), file=sys.stderr)
        return 2
    photos = args.folder if args.folder is not None else args.photos
    try:
        if args.batch_size < 1:
            raise EvaluationError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.threads is not None and args.threads < 1:
            raise EvaluationError(f"--threads must be >= 1, got {args.threads}")
        read = {"the model": args.model, "the photos": photos,
                **({"the not-known photos": args.not_known} if args.not_known is not None else {})}
        if args.json is not None and (problem := results_file_problem(args.json, read, ours=json_with(
                ("model", "photos", "summary")))):
            raise EvaluationError(f"--json {problem}")
        if (missing := missing_model(args.model)) is not None:
            raise EvaluationError(missing)
        choice = getattr(args, "provider", "auto")
        predictor = Predictor(args.model, intra_op_threads=args.threads, providers=requested_providers(choice))
        if (unmet := unmet_request(choice, predictor.provider, predictor.provider_line)) is not None:
            raise EvaluationError(unmet)
        print(predictor.provider_line, file=sys.stderr)
        evaluation = evaluate_photos(predictor, photos, batch_size=args.batch_size, not_known=args.not_known)
        if args.not_known is not None:
            evaluation = dataclasses.replace(evaluation, not_known=evaluate_not_known(predictor, args.not_known,
                                                                                      args.batch_size))
    except (EvaluationError, ModelError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, NoPhotoReadable) else 2
    print(format_evaluation(evaluation))
    if args.json is not None:
        try:
            write_json_atomic(args.json, evaluation.to_dict())
        except OSError as exc:  # checked before the work; a disk filled meanwhile still gets one line
            print(f"{prog}: error: cannot write {args.json}: {exc.strerror or exc} (the results are printed above)",
                  file=sys.stderr)
            return 1
        print(f"wrote {args.json}", file=sys.stderr)
    unread_not_known = evaluation.not_known is not None and evaluation.not_known.get("unreadable")
    return 1 if evaluation.unreadable or unread_not_known else 0
