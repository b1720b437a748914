"""False alarms of preprocess's shortcut check: made-up metadata with random labels must never warn.

Draws ``--datasets`` datasets of 20-400 photos in 3-10 classes (unbalanced, Dirichlet class shares) whose
metadata (size, format, EXIF, colour mode, camera, orientation, JPEG quality) is random and independent of
the labels, and counts the warnings of :func:`leaflens.data_prep.shortcut.check_shortcuts` (all classes at
once and each class against the rest). Prints a table and, last, one JSON object
``{"datasets", "false_alarms", "one_class_alarms"}``.

    python benchmarks/shortcut_null.py [--datasets 1500] [--seed 1]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from leaflens.data_prep.shortcut import PhotoMeta, check_shortcuts


def random_metas(rng: np.random.Generator, n: int) -> list[PhotoMeta]:
    return [PhotoMeta(int(rng.choice([640, 800, 1024, 4000])), int(rng.integers(100, 3000)),
                      ["JPEG", "PNG", "WEBP"][int(rng.choice(3, p=[0.9, 0.07, 0.03]))], bool(rng.random() < 0.95),
                      bool(rng.random() < 0.5), ["RGB", "L"][int(rng.random() < 0.05)],
                      ["", "A", "B", "C"][int(rng.integers(0, 4))], int(rng.choice([1, 6, 8], p=[0.8, 0.15, 0.05])),
                      int(rng.integers(2, 30))) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    alarms = one_class = 0
    for t in range(args.datasets):
        n, k = int(rng.integers(20, 400)), int(rng.integers(3, 11))
        metas = random_metas(rng, n)
        labels = rng.choice(k, n, p=rng.dirichlet(np.ones(k) * 2))
        result = check_shortcuts(metas, labels, [f"c{i}" for i in range(k)], seed=t)
        if not isinstance(result, str) and result.warns:
            alarms += 1
            one_class += result.one_class is not None
            print(f"false alarm: dataset {t}, {n} photos, {k} classes, {result.balanced_accuracy:.2f} >= "
                  f"{result.warn_at:.2f} ({result.one_class or 'all classes'})")
    print(f"{'datasets':<14}{'false alarms':>14}{'of which one class':>20}")
    print(f"{args.datasets:<14}{alarms:>14}{one_class:>20}")
    print(json.dumps({"datasets": args.datasets, "false_alarms": alarms, "one_class_alarms": one_class}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
