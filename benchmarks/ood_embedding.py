"""A fine-tuned teacher's out-of-domain score against two scores from its embedding and logits, side by side.

For a teacher folder made by `leaflens teacher` (its ``model.npz``) on dataset DS, in 5 x 2 random halvings of
the validation photos (standardised on one half, measured on the other), the AUROC (in domain positive) of:

- ``blocks``: today's score (leaflens.pipeline.ood: Mahalanobis distances of the feature-map statistics);
- ``knn1``: minus the cosine similarity of the photo's embedding to its nearest training photo;
- ``msp``: minus the top softmax probability;
- ``blocks+knn1``, ``blocks+msp``: each standardised on the validation half, summed with equal weight;

against GENERATED negatives (what a method is chosen on: benchmarks/ood.py's six kinds) and, to measure only,
the photos of ``--photos`` (any folder of JPEGs, e.g. leaves for a pest model).

    python benchmarks/ood_embedding.py --teacher T --dataset DS --photos FOLDER [--max-photos 200]

Last line: one JSON object ``{score: {"auroc_generated", "auroc_photos"}}`` plus ``teacher``, ``photos``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import existing_dir, positive_int  # noqa: E402
from ood import auroc, generated_negatives  # noqa: E402

from leaflens.data_prep.manifest import DatasetError, load_dataset  # noqa: E402
from leaflens.engine import Tensor, no_grad  # noqa: E402
from leaflens.engine.checkpoint import CheckpointError  # noqa: E402
from leaflens.pipeline import ood  # noqa: E402
from leaflens.pipeline.teachers import served  # noqa: E402
from leaflens.pipeline.teachers.stage import TeacherStageError  # noqa: E402

SCORES = ("blocks", "knn1", "msp", "blocks+knn1", "blocks+msp")
GENERATED, GENERATED_SEED, REPEATS = 300, 1, 5


def outputs(net, contract, images: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(embedding, logits, per-map statistics) of uint8 photos at the contract's stored size."""
    feats, logits, stats = [], [], []
    with no_grad():
        for i in range(0, len(images), 32):
            x = Tensor(contract.prepare(np.asarray(images[i:i + 32])))
            lg, maps = net.forward_blocks(x)
            stats.append([np.asarray(ood.block_stats(m).data) for m in maps])
            feats.append(np.asarray(net.features(x).data))
            logits.append(np.asarray(lg.data))
    return np.concatenate(feats), np.concatenate(logits), [np.concatenate(s) for s in zip(*stats)]


def decode(folder: Path, contract, limit: int) -> np.ndarray:
    """The JPEG/PNG photos under ``folder`` (sorted, at most ``limit``) decoded as the teacher's contract does:
    shorter side to ``contract.shorter_side``, centre crop to the stored size."""
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))[:limit]
    side, out = contract.shorter_side or contract.stored_size, []
    for f in files:
        im = ImageOps.exif_transpose(Image.open(f)).convert("RGB")
        w, h = im.size
        im = im.resize((max(side, round(w * side / min(w, h))), max(side, round(h * side / min(w, h)))),
                       Image.BILINEAR)
        w, h, m = *im.size, contract.stored_size
        out.append(np.asarray(im.crop(((w - m) // 2, (h - m) // 2, (w - m) // 2 + m, (h - m) // 2 + m))))
    if not out:
        raise SystemExit(f"ood_embedding.py: {folder}: no JPEG or PNG photos")
    return np.stack(out)


def standardised_sum(terms: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> np.ndarray:
    """Each score term standardised by its mean and spread on the reference validation photos, summed."""
    return np.sum([(v - ref[t].mean()) / (ref[t].std() + 1e-9) for t, v in terms.items()], axis=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", type=Path, required=True, help="teacher folder (its model.npz)")
    ap.add_argument("--dataset", type=Path, required=True, help="the dataset the teacher was made on")
    ap.add_argument("--photos", type=existing_dir, required=True,
                    help="photos of no class of the model (measured only)")
    ap.add_argument("--max-photos", type=positive_int, default=200)
    args = ap.parse_args(argv)
    # a missing or unreadable folder, file or original photo: one line naming it, exit 1
    try:
        ds = load_dataset(args.dataset, verify=False)
        net, meta = served.load_teacher_model(args.teacher / served.MODEL_FILE)
        contract = meta.contract
        if contract is None:
            raise SystemExit(f"ood_embedding.py: {args.teacher}: not a servable teacher ({meta.reason})")

        def split(name: str) -> np.ndarray:
            return np.concatenate(list(served.split_batches(ds, name, contract, 64)))

        train = split("train")
        sets = {"train": train, "val": split("val"),
                "generated": generated_negatives(train, GENERATED, np.random.default_rng(GENERATED_SEED)),
                "photos": decode(args.photos, contract, args.max_photos)}
    except (DatasetError, CheckpointError, TeacherStageError, OSError) as exc:  # TeacherStageError: photos gone
        raise SystemExit(f"ood_embedding.py: {exc}") from None
    out = {k: outputs(net, contract, v) for k, v in sets.items()}
    labels = np.asarray(ds["train"].labels)
    bank = out["train"][0] / np.linalg.norm(out["train"][0], axis=1, keepdims=True)

    def term(name: str, key: str, head: ood.OODHead) -> np.ndarray:
        feats, logits, stats = out[key]
        if name == "blocks":
            return head.score_numpy(stats)
        if name == "knn1":
            return -(feats / np.linalg.norm(feats, axis=1, keepdims=True) @ bank.T).max(1)
        e = np.exp(logits - logits.max(1, keepdims=True))
        return -(e / e.sum(1, keepdims=True)).max(1)

    rng = np.random.default_rng(0)
    n_val = len(sets["val"])
    folds = [np.array_split(rng.permutation(n_val), 2) for _ in range(REPEATS)]
    results: dict[str, dict[str, float]] = {}
    for score in SCORES:
        gen, photos = [], []
        for halves in folds:
            for a, b in ((0, 1), (1, 0)):
                head, _, _ = ood.fit_ood_head(out["train"][2], labels, [s[halves[a]] for s in out["val"][2]],
                                              ds.num_classes)
                parts = {k: {t: term(t, k, head) for t in score.split("+")} for k in ("val", "generated", "photos")}
                ref = {t: v[halves[a]] for t, v in parts["val"].items()}
                held = standardised_sum({t: v[halves[b]] for t, v in parts["val"].items()}, ref)
                gen.append(auroc(held, standardised_sum(parts["generated"], ref)))
                photos.append(auroc(held, standardised_sum(parts["photos"], ref)))
        results[score] = {"auroc_generated": round(float(np.mean(gen)), 4),
                          "auroc_photos": round(float(np.mean(photos)), 4)}
    print(f"{'score':<14}{'AUROC generated':>17}{'AUROC photos':>14}")
    for score, r in results.items():
        print(f"{score:<14}{r['auroc_generated']:>17.4f}{r['auroc_photos']:>14.4f}")
    print(json.dumps({**results, "teacher": str(args.teacher), "photos": str(args.photos),
                      "n_photos": len(sets["photos"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
