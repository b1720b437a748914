"""The FP16 model under float16 arithmetic, against the FP32 one.

onnxruntime on the CPU, where `leaflens export` checks ``student_fp16.onnx``, computes a float16 graph in
float32 (it inserts casts), so the export's parity measures the float16 weights' rounding, not float16
arithmetic, which is what a GPU does with the file. ONNX's reference evaluator computes float16 operators in
float16; it is slow (pure NumPy), so this runs it on a few validation photos, and on generated photos the
out-of-domain score must flag (noise, a checkerboard, stripes: their scores are in the tens of thousands,
beyond float16's 65,504 once squared and summed in float16).

    python benchmarks/fp16_arith.py --export artifacts/export --dataset artifacts/dataset [--photos 8]

The validation photos are given to the models as `leaflens export` gives them: the dataset's stored arrays, or,
when the export is a kept teacher (served at its own input size), the original photos decoded by its contract.

Last line: one JSON object: ``photos``, ``top1_agreement`` (FP16 under float16 arithmetic vs FP32 on
onnxruntime), ``max_logit_diff``, ``max_ood_rel_diff`` (relative to max(1, |score|)), ``ood_finite`` (every
score finite, generated photos included), ``generated_flagged`` (how many of them the FP16 file's own
threshold flags) and ``whole_fp16_nonfinite``: scores that are inf or NaN when the whole graph, the score
included, computes in float16 (as the FP16 file did before the score was kept in float32); null, with the reason
in ``whole_fp16_refused``, when the FP16 converter refuses the whole graph (a constant beyond float16's range).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402  (benchmarks/ is not a package)

from leaflens.apps.model_card import ModelCard, ModelError  # noqa: E402
from leaflens.data_prep.manifest import DatasetError, load_dataset  # noqa: E402
from leaflens.engine.onnx_export import convert_float16  # noqa: E402
from leaflens.engine.onnx_graph import ExportError  # noqa: E402
from leaflens.pipeline.teachers.served import split_batches  # noqa: E402
from leaflens.pipeline.teachers.stage import TeacherStageError  # noqa: E402


def generated(size: int, seed: int = 0) -> np.ndarray:
    """uint8 [3, size, size, 3]: noise, a 1 px checkerboard, red/blue stripes."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    checker = np.repeat((np.indices((size, size)).sum(0) % 2 * 255).astype(np.uint8)[..., None], 3, axis=2)
    stripes = np.zeros((size, size, 3), np.uint8)
    stripes[:, ::2, 0] = 255
    stripes[:, 1::2, 2] = 255
    return np.stack([noise, checker, stripes])


def val_photos(dataset: Path, card: ModelCard, count: int) -> np.ndarray:
    """The first ``count`` validation photos at the model's stored size, as `leaflens export` scores it: the
    dataset's stored arrays, or for a kept teacher (served at its own input size) the original photos decoded by
    its contract (only the first batch is decoded)."""
    ds = load_dataset(dataset, verify=False)
    if "val" not in ds.splits or not len(ds["val"]):
        sys.exit(f"fp16_arith.py: dataset {dataset} has no validation photos")
    batches = split_batches(ds, "val", card.contract, count)
    try:
        return next(batches)
    finally:
        batches.close()  # a generator: its decoding threads end with it


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, required=True, help="export folder (student.onnx, student_fp16.onnx)")
    ap.add_argument("--dataset", type=Path, required=True, help="the dataset folder it was exported from")
    ap.add_argument("--photos", type=positive_int, default=8, help="validation photos to run (default 8)")
    args = ap.parse_args(argv)
    fp16 = onnx.load(str(args.export / "student_fp16.onnx"))
    card = ModelCard.from_metadata({p.key: p.value for p in fp16.metadata_props}, "student_fp16.onnx")
    stored = val_photos(args.dataset, card, args.photos)
    made = generated(card.stored_size)
    x = card.contract.prepare(np.concatenate([np.asarray(stored), made])).transpose(0, 3, 1, 2).copy()
    n = len(stored)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        half = ReferenceEvaluator(fp16).run(None, {"input": x})
        seconds = time.perf_counter() - t0
        # before the score was kept in float32: the same FP32 file converted whole, when the conversion takes it
        # (a teacher's out-of-domain constants can exceed float16's range: the converter refuses them)
        try:
            whole_model, whole_refused = convert_float16(onnx.load(str(args.export / "student.onnx"))), None
        except ExportError as exc:
            whole_model, whole_refused = None, str(exc)
        whole = None if whole_model is None else ReferenceEvaluator(whole_model).run(None, {"input": x})
    full = ort.InferenceSession(str(args.export / "student.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"input": x})
    agree = float(np.mean(half[0][:n].argmax(1) == full[0][:n].argmax(1)))
    logit_diff = float(np.abs(half[0][:n] - full[0][:n]).max())
    result: dict[str, object] = {"photos": n, "top1_agreement": agree, "max_logit_diff": logit_diff,
                                 "seconds": round(seconds, 1)}
    if len(half) > 1 and card.ood is not None:
        s16, s32 = (a[1].astype(np.float64) for a in (half, full))
        sw = None if whole is None else whole[1].astype(np.float64)
        rel = np.abs(s16 - s32) / np.maximum(1.0, np.abs(s32))
        result.update(max_ood_rel_diff=float(rel.max()), ood_finite=bool(np.isfinite(s16).all()),
                      generated_flagged=int(np.sum(s16[n:] > card.ood.threshold)), generated=len(made),
                      whole_fp16_nonfinite=None if sw is None else int(np.sum(~np.isfinite(sw))),
                      whole_fp16_refused=whole_refused)
        print(f"{'photo':<12}{'ood fp32':>14}{'fp16 file':>14}{'all in fp16':>14}")
        names = [f"val {i}" for i in range(n)] + ["noise", "checkerboard", "stripes"]
        for i, (name, a, b) in enumerate(zip(names, s32, s16)):
            print(f"{name:<12}{a:>14.2f}{b:>14.2f}" + (f"{'-':>14}" if sw is None else f"{sw[i]:>14.2f}"))
        if whole_refused:
            print(f"all in fp16: not measured, {whole_refused}")
    print(f"{n} validation photos: top-1 agreement {agree:.3f}, max logit difference {logit_diff:.4f} "
          f"({seconds:.1f} s in the reference evaluator)")
    print(json.dumps(result))


if __name__ == "__main__":
    try:
        main()
    # a missing or unreadable model or folder, or a teacher's original photos gone: one line, no traceback
    except (ModelError, DatasetError, TeacherStageError, OSError) as exc:
        sys.exit(f"fp16_arith.py: {exc}")
