"""How well a distill run's probabilities mean what they say, before and after temperature scaling.

    python benchmarks/calibration.py --run artifacts/student --dataset artifacts/dataset
    python benchmarks/calibration.py --teacher artifacts/teacher --dataset artifacts/dataset

Scores the run's kept student (its ``best.npz``, at the centre crop the run chose) on the validation and test
photos, fits the temperature on validation exactly as distill does (leaflens.pipeline.calibration: negative
log-likelihood), and reports on both splits the expected calibration error (15 bins), the negative
log-likelihood, the mean top probability against the accuracy, and the share of photos the served "ambiguous"
rule (a threshold chosen on validation by the run's rule, or a near tie) would leave unanswered, with the
raw logits and with the calibrated ones. The temperature is chosen on validation only; test says whether it
holds. Works on runs from before calibration (it fits the temperature they did not record). With ``--teacher``
instead of ``--run``, the teacher's logits that teacher.json records (the ones distill weighs the teacher by)
are measured, the temperature fitted as distill fits a teacher candidate's. The last line is
one JSON object: ``temperature``, ``recorded_temperature`` and, per split and for ``raw`` / ``calibrated``,
``<split>_<kind>_ece``, ``_nll``, ``_mean_top``, ``_accuracy``, ``_ambiguous``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import existing_dir  # noqa: E402  (benchmarks/ is not a package)

from leaflens.apps.model_card import unsure  # noqa: E402
from leaflens.data_prep.manifest import DatasetError, load_dataset  # noqa: E402
from leaflens.engine.checkpoint import CheckpointError  # noqa: E402
from leaflens.pipeline import calibration  # noqa: E402
from leaflens.pipeline.report import metrics  # noqa: E402
from leaflens.pipeline.runs import load_model  # noqa: E402
from leaflens.pipeline.teachers.artefact import TeacherError, load_teacher  # noqa: E402
from leaflens.pipeline.teachers.served import TeacherNotServable, read_served  # noqa: E402
from leaflens.pipeline.train_student import predict_logits  # noqa: E402


def _nll(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(-np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-12, None)).mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", type=existing_dir, help="a distill run folder (its best.npz)")
    which.add_argument("--teacher", type=existing_dir, help="a teacher folder (its teacher.json's logits)")
    p.add_argument("--dataset", required=True, type=existing_dir, help="the dataset it was trained on")
    args = p.parse_args(argv)
    try:
        ds = load_dataset(args.dataset)
        if args.teacher is not None:
            tt = load_teacher(args.teacher, ds)
            if not tt.has_logits:
                print(f"calibration.py: error: {args.teacher} records no logits for the dataset's classes",
                      file=sys.stderr)
                return 1
            served = read_served(tt.info.stage, "teacher.json")
            recorded = None if served is None else served.temperature
        else:
            model, info = load_model(args.run)
            recorded = info.metrics.temperature
            if info.kept == "teacher":
                print("calibration.py: note: this run kept its teacher; its student is measured (pass --teacher "
                      "for the teacher)", file=sys.stderr)
    except (CheckpointError, DatasetError, TeacherError, TeacherNotServable, OSError) as exc:
        print(f"calibration.py: error: {exc}", file=sys.stderr)
        return 1
    splits = [s for s in ("val", "test") if s in ds and ds[s].labels is not None and len(ds[s])]
    if "val" not in splits:
        print(f"calibration.py: error: {args.dataset} has no labelled validation photos", file=sys.stderr)
        return 1
    if args.teacher is not None:
        logits = {s: np.asarray(tt.logits[s], np.float32) for s in splits}
    else:
        size, crop = info.dataset.model_input_size, info.dataset.centre_crop
        logits = {s: predict_logits(model, ds[s].images, ds.mean, ds.std, 64, size, crop) for s in splits}
    labels = {s: np.asarray(ds[s].labels) for s in splits}
    temperature = calibration.fit_temperature(logits["val"], labels["val"])
    figures: dict[str, float] = {}
    print(f"temperature {temperature:.3f} (chosen on validation; the run recorded "
          f"{recorded if recorded is not None else 'none'})")
    print(f"{'split':<6} {'probabilities':<12} {'ECE':>6} {'NLL':>6} {'mean top':>9} {'accuracy':>9} "
          f"{'unanswered':>11}")
    for kind, t in (("raw", 1.0), ("calibrated", temperature)):
        val_probs = metrics.softmax(logits["val"] / t)
        threshold = float(metrics.choose_uncertain_threshold(val_probs, labels["val"])["threshold"])
        for s in splits:
            probs = metrics.softmax(logits[s] / t)
            row = {"ece": metrics.expected_calibration_error(probs, labels[s]), "nll": _nll(probs, labels[s]),
                   "mean_top": float(probs.max(1).mean()), "accuracy": float((probs.argmax(1) == labels[s]).mean()),
                   "ambiguous": float(np.mean(unsure(probs, threshold)))}
            figures.update({f"{s}_{kind}_{k}": round(v, 4) for k, v in row.items()})
            print(f"{s:<6} {kind:<12} {row['ece']:>6.3f} {row['nll']:>6.3f} {row['mean_top']:>9.3f} "
                  f"{row['accuracy']:>9.3f} {row['ambiguous']:>10.1%}")
    print(json.dumps({"temperature": round(temperature, 4), "recorded_temperature": recorded,
                      **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
