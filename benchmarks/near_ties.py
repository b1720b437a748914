"""Near ties on a model's own validation photos: how often the top two classes are within a ratio, and how
often the model is right there, against its other answers.

    python benchmarks/near_ties.py --model artifacts/export/student.onnx --dataset artifacts/dataset

The photos are those of the dataset's ``--split`` (validation by default: the rule is chosen there, never on
test), scored by the exported model as the Predictor serves them: the stored arrays, or, for a model with its
own stored size (a kept teacher, served at its input size), the original photos decoded by the model's
contract, as `leaflens export` scores a teacher. For each ratio r, a photo is a near tie when its second class
has at least r times the first's probability. The last line is one JSON object: ``photos``, ``accuracy``,
``tie_ratio`` (the served rule's, leaflens.apps.model_card.TIE_RATIO), ``near_ties``, ``near_ties_right``,
``acc_near_ties``, ``acc_rest``, ``threshold_ambiguous`` (below the model's threshold alone), ``rule_ambiguous``
(the served rule: threshold or near tie) and ``per_ratio``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402  (benchmarks/ is not a package)

from leaflens.apps.model_card import TIE_RATIO, ModelError, unsure  # noqa: E402
from leaflens.apps.predictor import Predictor  # noqa: E402
from leaflens.data_prep.manifest import DatasetError, load_dataset  # noqa: E402
from leaflens.pipeline.teachers.served import split_batches  # noqa: E402
from leaflens.pipeline.teachers.stage import TeacherStageError  # noqa: E402

RATIOS = (0.5, 0.6, 0.7, 0.8, 0.9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="exported model (.onnx)")
    p.add_argument("--dataset", required=True, help="the dataset it was trained on (preprocess's folder)")
    p.add_argument("--split", default="val", help="split to score (default %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    args = p.parse_args(argv)

    predictor = Predictor(args.model)
    ds = load_dataset(args.dataset)
    if args.split not in ds.splits or ds[args.split].labels is None:
        p.error(f"--split {args.split}: {args.dataset} has labelled splits {', '.join(ds.splits)}")
    if list(ds.classes) != list(predictor.classes):
        p.error(f"{args.model} (classes {list(predictor.classes)}) was not trained on {args.dataset} (classes "
                f"{list(ds.classes)})")
    labels = np.asarray(ds[args.split].labels)
    # at the model's stored size: the stored arrays, or the original photos decoded by its contract
    probs = np.concatenate([predictor.predict_arrays(batch)
                            for batch in split_batches(ds, args.split, predictor.card.contract, args.batch_size)])
    two = -np.partition(-probs, 1, axis=1)[:, :2]
    right = probs.argmax(1) == labels
    threshold = predictor.card.uncertain_threshold

    def share(mask: np.ndarray) -> float | None:
        return round(float(right[mask].mean()), 4) if mask.any() else None

    rows = []
    print(f"{args.model} on {len(labels)} {args.split} photos: accuracy {right.mean():.3f}, threshold {threshold:.3f}")
    print(f"{'ratio':>6} {'near ties':>10} {'share':>7} {'right there':>12} {'right elsewhere':>16}")
    for r in RATIOS:
        tie = two[:, 1] >= r * two[:, 0]
        rows.append({"ratio": r, "near_ties": int(tie.sum()), "acc_near_ties": share(tie), "acc_rest": share(~tie)})
        there = "-" if not tie.any() else f"{right[tie].mean():.1%}"
        print(f"{r:>6} {int(tie.sum()):>10} {tie.mean():>7.1%} {there:>12} {right[~tie].mean():>16.1%}")
    tie = two[:, 1] >= TIE_RATIO * two[:, 0]
    below = two[:, 0] < threshold
    rule = np.asarray(unsure(probs, threshold))
    print(f"served rule (below {threshold:.3f} or a near tie at {TIE_RATIO}): {int(rule.sum())} ambiguous "
          f"({int(below.sum())} by the threshold alone)")
    print(json.dumps({"model": args.model, "split": args.split, "photos": int(len(labels)),
                      "accuracy": round(float(right.mean()), 4), "tie_ratio": TIE_RATIO,
                      "near_ties": int(tie.sum()), "near_ties_right": int(right[tie].sum()),
                      "acc_near_ties": share(tie), "acc_rest": share(~tie),
                      "threshold_ambiguous": int(below.sum()), "rule_ambiguous": int(rule.sum()),
                      "per_ratio": rows}))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    # a missing or unreadable model or folder, or a teacher's original photos gone: one line
    except (ModelError, DatasetError, TeacherStageError, OSError) as exc:
        sys.exit(f"near_ties.py: {exc}")
