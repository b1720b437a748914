"""The "ambiguous" rule on small validation splits: what it leaves unanswered and which mistakes it catches.

The rule flags the least confident 1.5 % of the validation photos. Under 67 photos that share is less than
one photo; the rule then flags the least confident one (before: none, so a model trained on a small dataset
never said "unsure"). This script measures both on validation photos only: a teacher's cached validation
logits (``logits_val.npy`` of ``leaflens teacher``) are split at random into a small "validation" split of
``n`` photos, on which the threshold is chosen, and the remaining photos, which play the new photos.
For comparison: the accuracy-target rule (flag until the answered reach 95 %) and the fixed default 0.5.

    python benchmarks/ambiguous_small_val.py --case T DS [--case T2 DS2 ...] [--sizes 24,36] [--draws 300]

Last line: one JSON object, per case (keyed by its TEACHER folder as given) and size the rules'
``unanswered``, ``accuracy_answered``, ``mistakes_caught`` (share of the wrong answers left unanswered) and
``flagged_wrong`` (share of the unanswered photos that were wrong answers). Sizes that leave fewer than 10
photos to measure on are skipped, and said on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int, positive_ints  # noqa: E402  (benchmarks/ is not a package)

from leaflens.pipeline.report import metrics  # noqa: E402

Rule = Callable[[np.ndarray, np.ndarray], float]


def _before(p: np.ndarray, y: np.ndarray) -> float:
    small = len(y) * metrics.AMBIGUOUS_BUDGET < 1
    return metrics.choose_uncertain_threshold(p, y, max_flagged=0.0 if small else metrics.AMBIGUOUS_BUDGET)["threshold"]


RULES: dict[str, Rule] = {
    "before (none under one photo)": _before,
    "now (at least one)": lambda p, y: metrics.choose_uncertain_threshold(p, y)["threshold"],
    "95 % target": lambda p, y: metrics.choose_uncertain_threshold(p, y, max_flagged=None)["threshold"],
    "fixed 0.5": lambda p, y: 0.5,
}


def measure(probs: np.ndarray, labels: np.ndarray, n: int, draws: int, seed: int) -> dict[str, dict[str, float]]:
    """Each rule's figures on the photos left out, averaged over ``draws`` random small splits of ``n``."""
    rng = np.random.default_rng(seed)
    sums = {r: np.zeros(4) for r in RULES}
    for _ in range(draws):
        order = rng.permutation(len(labels))
        chosen, new = order[:n], order[n:]
        conf, right = probs[new].max(1), probs[new].argmax(1) == labels[new]
        for name, rule in RULES.items():
            answered = conf >= rule(probs[chosen], labels[chosen])
            sums[name] += (np.sum(~answered), np.sum(right & answered), np.sum(~right & ~answered), np.sum(~right))
    out = {}
    for name, (unanswered, right_answered, caught, wrong) in sums.items():
        total = draws * (len(labels) - n)
        out[name] = {"unanswered": unanswered / total,
                     "accuracy_answered": right_answered / max(1.0, total - unanswered),
                     "mistakes_caught": caught / max(1.0, wrong), "flagged_wrong": caught / max(1.0, unanswered)}
    return out


def load_array(path: Path) -> np.ndarray:
    """A ``.npy`` file, or exit with one line naming it."""
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise SystemExit(f"ambiguous_small_val.py: {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"ambiguous_small_val.py: {path}: not a readable .npy file ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", nargs=2, action="append", metavar=("TEACHER", "DATASET"), required=True,
                    help="a teacher folder (its logits_val.npy) and the dataset it was made on (val_labels.npy)")
    ap.add_argument("--sizes", type=positive_ints, default="24,36,48",
                    help="small validation split sizes, comma-separated (default 24,36,48)")
    ap.add_argument("--draws", type=positive_int, default=300, help="random splits per size (default 300)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.sizes:
        ap.error("--sizes: give at least one size")
    teachers = [teacher for teacher, _ in args.case]
    if len(set(teachers)) < len(teachers):  # the JSON is keyed by the teacher folder as given
        ap.error("--case: the same teacher folder is given twice")
    loaded = {}  # every case read before the table starts, so a missing file stops the run at once
    for teacher, dataset in args.case:
        probs = metrics.softmax(load_array(Path(teacher) / "logits_val.npy"))
        labels = load_array(Path(dataset) / "val_labels.npy").astype(np.int64)
        if len(labels) != len(probs):
            raise SystemExit(f"ambiguous_small_val.py: {teacher}: {len(probs)} validation logits but {dataset} has "
                             f"{len(labels)} labels")
        loaded[teacher] = probs, labels
    results: dict[str, dict[str, object]] = {}
    print(f"{'case':<28} {'n':>3} {'rule':<30} {'unanswered':>10} {'acc answered':>12} {'caught':>7} "
          f"{'flagged wrong':>13}")
    for teacher, (probs, labels) in loaded.items():
        name = teacher[-28:]
        case: dict[str, object] = {"val_photos": len(labels), "classes": probs.shape[1],
                                   "accuracy": float(np.mean(probs.argmax(1) == labels))}
        # each split of n leaves the other photos to measure on: at least 10 of them
        too_big = [n for n in args.sizes if n > len(labels) - 10]
        if too_big:
            print(f"ambiguous_small_val.py: {teacher}: sizes {', '.join(map(str, too_big))} skipped: above "
                  f"{len(labels) - 10} ({len(labels)} validation photos, 10 kept to measure on)", file=sys.stderr)
        for n in args.sizes:
            if n in too_big:
                continue
            figures = measure(probs, labels, n, args.draws, args.seed)
            case[str(n)] = figures
            for rule, f in figures.items():
                print(f"{name:<28} {n:>3} {rule:<30} {f['unanswered']:>10.3f} {f['accuracy_answered']:>12.3f} "
                      f"{f['mistakes_caught']:>7.2f} {f['flagged_wrong']:>13.2f}")
        results[teacher] = case
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
