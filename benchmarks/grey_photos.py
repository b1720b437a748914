"""Photos without colour shown to a model that learnt from colour photos: answered, or refused?

Takes an exported model (``student.onnx``, whose metadata records ``leaflens.grey_share``) and a folder of
its kind of photos in class folders (its test photos). Every photo is served twice through the Predictor,
as it is and made greyscale (Pillow's ``convert("L")``, saved as PNG), by the model as exported and by the
same file without the ``leaflens.grey_share`` key (what every model did before the "no_colour" refusal).
Counts per verdict, and how many of the diagnoses were right; the colour photos show what the refusal costs
genuine photos (none should be refused for lack of colour).

    python benchmarks/grey_photos.py --model artifacts/export/student.onnx --photos PHOTOS/test

Last line: one JSON object with ``photos``, ``grey_share`` (the model's), and for ``before`` / ``now``
each set's (``grey``, ``colour``) verdict counts and ``right`` (right diagnoses).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import onnx
from PIL import Image

from leaflens.apps.model_card import ModelError
from leaflens.apps.predictor import Predictor
from leaflens.data_prep.quality import REFUSAL_REASONS
from leaflens.data_prep.scan import IMAGE_EXTENSIONS

VERDICTS = ("diagnosis", "ambiguous", "out_of_domain", "refused", "error")


def photos_by_class(root: Path) -> list[tuple[Path, str]]:
    return sorted((p, d.name) for d in root.iterdir() if d.is_dir() for p in d.rglob("*")
                  if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def without_key(model: Path, out: Path, key: str) -> Path:
    proto = onnx.load(str(model))
    kept = [p for p in proto.metadata_props if p.key != key]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    onnx.save(proto, str(out))
    return out


def serve(model: Path, files: list[tuple[Path, str]]) -> dict[str, int]:
    predictor = Predictor(model, intra_op_threads=2)
    counts: Counter[str] = Counter()
    for (_, label), p in zip(files, predictor.iter_predict_files([str(f) for f, _ in files], top_k=2)):
        verdict = p.verdict if p.ok else ("refused" if p.reason in REFUSAL_REASONS else "error")
        counts[verdict] += 1
        counts["right"] += int(p.ok and verdict == "diagnosis" and p.label == label)
        counts["no_colour"] += int(not p.ok and p.reason == "no_colour")
    return {k: counts[k] for k in (*VERDICTS, "right", "no_colour")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="exported model (student.onnx)")
    ap.add_argument("--photos", type=Path, required=True, help="folder of class folders (its test photos)")
    args = ap.parse_args()
    files = photos_by_class(args.photos)
    if not files:
        raise SystemExit(f"no photos in class folders under {args.photos}")
    share = Predictor(args.model, intra_op_threads=1).card.grey_share
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        grey = []
        for i, (path, label) in enumerate(files):
            out = work / "grey" / label / f"{i:05d}.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            with Image.open(path) as im:
                im.convert("L").save(out)
            grey.append((out, label))
        before = without_key(args.model, work / "before.onnx", "leaflens.grey_share")
        results = {"before": {"grey": serve(before, grey), "colour": serve(before, files)},
                   "now": {"grey": serve(args.model, grey), "colour": serve(args.model, files)}}
        shutil.rmtree(work / "grey")
    print(f"{len(files)} photos of {args.photos}, model {args.model} (grey_share {share})")
    print(f"{'model':<8}{'set':<8}" + "".join(f"{v:>15}" for v in (*VERDICTS, "right")))
    for when, sets in results.items():
        for name, c in sets.items():
            print(f"{when:<8}{name:<8}" + "".join(f"{c[v]:>15}" for v in (*VERDICTS, "right")))
    print(json.dumps({"photos": len(files), "grey_share": share, **results}))


if __name__ == "__main__":
    try:
        main()
    except (ModelError, OSError) as exc:  # a missing or unreadable model or folder: one line, no traceback
        sys.exit(f"grey_photos.py: {exc}")
