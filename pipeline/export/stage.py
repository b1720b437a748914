"""The export stage: a trained run -> ONNX FP32/FP16/INT8, a parity report, a Triton repository.

Reads ``<run>/best.npz`` (leaflens.pipeline.runs) and the dataset it was trained on, and writes into
``--out`` (replaced atomically, only when parity holds) the model the run kept: its student or, when the
run kept the fine-tuned teacher (``kept: teacher``, leaflens.pipeline.selection), the teacher from
``<run>/teacher_model.npz``, with the preprocessing contract the teacher stage used (the original photos
decoded at its input size, shorter side first; pipeline/teachers/served.py). The file names stay the same
either way, so ``student.onnx`` is always the served model (what `make serve` and the app open);
``parity.json``'s ``model.kind`` and the ONNX doc string say which it is:

- ``student.onnx``: FP32, BatchNorm folded, the model card in its metadata (leaflens.apps.model_card);
- ``student_fp16.onnx``: float16 weights/compute for GPU providers, float32 input/output;
- ``student_int8.onnx``: static INT8 (QDQ) for CPUs, calibrated on training images
  (leaflens.pipeline.export.quantize), written only when its validation accuracy is within
  ``int8_max_drop`` (1 point) of FP32's. The recipes of ``int8_recipes`` are tried in order (by
  default the fast one, then one with the first convolution in float too) and the first within the
  drop is kept; when none is, no INT8 file is written and ``parity.json``'s ``int8`` entry says why,
  with the accuracies of every attempt;
- ``parity.json``: engine vs onnxruntime on the validation split (max |logit difference|, top-1
  agreement), test accuracy of every variant, CPU speed of every variant, and ``served``: the test
  accuracy of ``student.onnx`` as users meet it (``served_test_accuracy``: through the Predictor on the
  test split's original photo files, leaflens.pipeline.evaluate) next to the engine's on the stored
  arrays (skipped with a warning when those photos are gone or changed);
- ``triton/<name>/{config.pbtxt, labels.txt, 1/model.onnx}`` (or under ``--triton DIR``).

Gates: FP32 max |difference| <= 1e-4 with top-1 agreement 100 % (flips between classes tied
within that tolerance excepted, and counted), FP16 agreement >= 99.5 %, served and engine test
accuracy within 0.5 points. When a gate fails nothing
is replaced, the report is written beside the output as ``<out>.parity-failed.json`` and
:class:`ExportFailed` says which gate failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from leaflens.apps.model_card import PREFIX, TIE_RATIO, ModelCard, trained_on, unsure
from leaflens.apps.predictor import Predictor
from leaflens.cpus import usable_cpus
from leaflens.data_prep import quality
from leaflens.data_prep.arrays import sha256_file
from leaflens.data_prep.manifest import MANIFEST_NAME, Dataset, is_dataset, load_dataset, manifest_sha256
from leaflens.engine.nn import Module
from leaflens.engine.onnx_export import IR_VERSION, OPSET, convert_float16, export_onnx, save_onnx
from leaflens.files import (
    NotOurFolderError,
    OutputBusy,
    check_replaceable,
    clean_stale_temps,
    find_moved,
    new_temp_dir,
    output_lock,
    stage_folder_above,
    swap_into_place,
    write_json_atomic,
)
from leaflens.pipeline import calibration
from leaflens.pipeline import ood as ood_check
from leaflens.pipeline.chance import chance_warning
from leaflens.pipeline.evaluate import PhotosUnavailable, dataset_photo_files, evaluate_files
from leaflens.pipeline.export import parity, triton
from leaflens.pipeline.export.quantize import (
    Int8Recipe,
    calibration_indices,
    int8_ladder,
    int8_shortfall,
    quantize_int8,
)
from leaflens.pipeline.hardware import cpu_int8_dot
from leaflens.pipeline.report import metrics
from leaflens.pipeline.runs import BEST, RunInfo, RunMetrics, load_model
from leaflens.pipeline.teachers.stage import split_source_dir

FP32_FILE, FP16_FILE, INT8_FILE = "student.onnx", "student_fp16.onnx", "student_int8.onnx"
REPORT = "parity.json"
REPORT_FORMAT = "leaflens-export-1"


class ExportFailed(RuntimeError):
    """The export cannot be produced or did not pass its parity gates (the message says which)."""


@dataclass
class ExportOptions:
    run: Path
    out: Path
    dataset: Path | None = None  # None: the dataset the run records (run_dataset)
    triton: Path | None = None  # default: <out>/triton
    name: str = "leaflens_student"
    int8: bool = True
    triton_variant: str = "fp32"  # which file goes into the Triton repository: fp32 | fp16 | int8
    max_batch_size: int = 64
    queue_delay_us: int = 2000
    int8_recipes: tuple[Int8Recipe, ...] = int8_ladder()  # tried in order; the first within the drop is kept
    int8_max_drop: float = 0.01  # INT8 is written only when val accuracy >= FP32's - this
    fp32_tolerance: float = 1e-4  # FP32 logit error allowed, relative to the largest |logit| (at least 1)
    fp16_min_agreement: float = 0.995  # top-1 agreement with the engine, flips on near-ties not counted
    fp16_tolerance: float = 4 * 2.0 ** -10  # FP16 logit error allowed, relative to the largest |logit|: 4 ulps
    served_max_points: float = 0.5  # served vs engine test accuracy, in percentage points
    speed_seconds: float = 1.0
    batch: int = 64
    threads: int | None = None
    allow_dataset_mismatch: bool = False
    ood: bool = True  # add the out-of-domain score output (leaflens.pipeline.ood)
    ood_branch: bool = True  # a student's score also reads the frozen EfficientNet-Lite0 branch (GenericBranch)
    ood_budget: float = ood_check.DEFAULT_BUDGET  # share of genuine new photos it may flag (with 0.9 confidence)
    ood_tolerance: float = 1e-3  # FP32 ONNX vs engine score, relative to max(1, |score|)

    def __post_init__(self) -> None:
        """ValueError naming the option that cannot work, before minutes of checks end in it."""
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be at least 1, got {self.max_batch_size}")
        if self.queue_delay_us < 0:
            raise ValueError(f"--queue-delay-us must be 0 or more, got {self.queue_delay_us}")
        if not 0 <= self.int8_max_drop <= 1:
            raise ValueError(f"--int8-max-drop is a share of accuracy from 0 to 1, got {self.int8_max_drop}")
        if not 0 < self.ood_budget < 0.5:
            raise ValueError(f"--ood-budget is a share of genuine photos above 0 and under 0.5, got {self.ood_budget}")
        if not self.speed_seconds > 0:
            raise ValueError(f"--speed-seconds must be above 0, got {self.speed_seconds}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if self.triton is not None and self.triton.exists() and not self.triton.is_dir():
            raise ValueError(f"--triton {self.triton} is a file; give a folder for the Triton model repository")
        if not str(self.out).strip():
            raise ValueError("--out is empty; give the export folder (e.g. artifacts/export)")
        if self.triton is not None and not str(self.triton).strip():
            raise ValueError("--triton is empty; give a folder for the Triton model repository")
        if self.triton_variant not in ("fp32", "fp16", "int8"):
            raise ValueError(f"--triton-variant must be fp32, fp16 or int8, got {self.triton_variant!r}")
        if self.triton_variant == "int8" and not self.int8:
            raise ValueError("--triton-variant int8 needs the INT8 model (drop --no-int8)")
        try:
            triton.check_model_name(self.name)  # it becomes a folder
        except triton.TritonConfigError as exc:
            raise ValueError(f"--name: {exc}") from None


def run_dataset(info: RunInfo, run_dir: Path) -> Path:
    """The dataset folder run ``info`` was trained on: the folder its best.npz names (recorded relative to the
    folder distill ran in by runs before they recorded it absolute: tried from here and beside the run folder),
    or where it went when the project folder was moved or renamed; confirmed by the manifest's SHA-256. A
    dataset rebuilt in place since is returned as it is, for the dataset check to refuse; a run that names
    none falls back to ``artifacts/dataset`` (checked like any --dataset)."""
    recorded = info.dataset.root
    if not recorded:
        return Path("artifacts/dataset")
    same = is_dataset(info.dataset.manifest_sha256) or (lambda d: (d / MANIFEST_NAME).is_file())
    run_dir = run_dir.resolve()
    tried = [Path(recorded)] if Path(recorded).is_absolute() else [Path.cwd() / recorded, run_dir.parent / recorded]
    for folder in tried:
        if folder.is_dir() and same(folder):
            return folder
    moved = find_moved(tried[0], run_dir, same)
    if moved is not None:
        return moved
    changed = next((f for f in tried if (f / MANIFEST_NAME).is_file()), None)
    if changed is not None:  # rebuilt since: the dataset check says so (or goes on with --allow-dataset-mismatch)
        return changed
    raise ExportFailed(f"the dataset run {info.run_id} was trained on ({recorded}, named in {info.path}) is not "
                       "there any more, and no folder near the run holds it; pass its folder with --dataset")


def _over_budget(run: Path, info: RunInfo) -> str | None:
    """The warning that the run kept a model outside its serving budget (distill said so; export says it again,
    as the file it writes is what gets shipped), or None (within it, or a run without report.json)."""
    from leaflens.pipeline.selection import Selection  # noqa: PLC0415

    try:
        report = json.loads((run / "report.json").read_text(encoding="utf-8"))
        selection = Selection.from_dict(report["selection"], "report.json: selection")
    except (OSError, ValueError, KeyError, TypeError):  # no report, or one from before the selection
        return None
    if selection.within_budget:
        return None
    kept = next((c for c in selection.candidates if c.kept), None)
    over = [] if kept is None else selection.budget.over(kept.params, kept.ms_per_photo)
    return (f"run {info.run_id} kept {selection.kept} although no model fitted its serving budget"
            + (f" ({'; '.join(over)})" if over else "") + ": this export is larger or slower than that budget asked")


def _check_dataset(info: RunInfo, ds: Dataset, opts: ExportOptions) -> list[str]:
    """Refuse a dataset other than the run's (unless allowed); returns warnings."""
    warnings = []
    want = (info.dataset.manifest_sha256 or "").removeprefix("sha256:")
    have = manifest_sha256(ds.root)
    if not want:
        warnings.append(f"{info.path} records no dataset manifest_sha256; cannot confirm {ds.root} is the "
                        "dataset this run was trained on")
    elif want != have:
        msg = (f"{ds.root}/manifest.json (sha256 {have[:12]}...) is not the dataset run {info.run_id} was "
               f"trained on (manifest_sha256 {want[:12]}... in {info.path}); pass the right --dataset")
        if not opts.allow_dataset_mismatch:
            raise ExportFailed(msg + " or --allow-dataset-mismatch")
        warnings.append(msg)
    classes = list(info.dataset.classes)
    if classes != list(ds.classes):
        raise ExportFailed(f"run {info.run_id} has classes {classes} but dataset {ds.root} has {ds.classes}")
    if info.dataset.image_size != ds.image_size:
        raise ExportFailed(f"run {info.run_id} was trained at {info.dataset.image_size} px but "
                           f"dataset {ds.root} holds {ds.image_size} px images")
    return warnings


def model_card(info: RunInfo, model: Module) -> ModelCard:
    d, m = info.dataset, info.metrics
    threshold = m.uncertain_threshold
    return ModelCard(
        classes=d.classes, contract=d.contract(),
        uncertain_threshold=threshold if threshold is not None else 0.5,
        threshold_from_model=threshold is not None, run_id=info.run_id,
        accuracy=m.test_accuracy,
        params=int(model.num_parameters()),
    )


def _file_facts(path: Path) -> dict[str, Any]:
    return {"file": path.name, "bytes": path.stat().st_size,
            "sha256": sha256_file(path).removeprefix("sha256:")}


def _pick_split(ds: Dataset, preferred: str) -> str:
    for name in (preferred, "test", "train"):
        if name in ds and len(ds[name]) and ds[name].labels is not None:
            return name
    raise ExportFailed(f"dataset {ds.root} has no labelled images to check parity on")


def _check_out(out: Path) -> None:
    try:
        check_replaceable(out, REPORT, "leaflens export folder")
    except NotOurFolderError as exc:
        raise ExportFailed(str(exc)) from None


def _gates(report: dict[str, Any], opts: ExportOptions) -> list[str]:
    failures = []
    fp32 = report["parity"]["fp32"]
    if (why := parity.fp32_failure(fp32, opts.fp32_tolerance)) is not None:
        failures.append(f"FP32 {why}")
    score = report.get("ood", {}).get("variants", {}).get("fp32")
    if score is not None and score["max_rel_diff"] > opts.ood_tolerance:
        failures.append(f"FP32 out-of-domain score differs from the engine's by {score['max_rel_diff']:.3g} "
                        f"(relative) > {opts.ood_tolerance:g}")
    if fp32["disagreements"] - fp32["ties"] > 0:
        failures.append(f"FP32 top-1 agreement {fp32['top1_agreement']:.2%} ({fp32['disagreements']} images "
                        f"differ, {fp32['ties']} of them ties)")
    fp16 = report["parity"]["fp16"]
    agreement = 1.0 - (fp16["disagreements"] - fp16.get("ties", 0)) / fp16["images"]  # near-ties do not count
    if not fp16["finite"] or agreement < opts.fp16_min_agreement:
        failures.append(f"FP16 top-1 agreement {agreement:.2%} < {opts.fp16_min_agreement:.1%} "
                        f"({fp16['disagreements']} images differ, {fp16.get('ties', 0)} of them near-ties)"
                        + ("" if fp16["finite"] else " (non-finite outputs)"))
    served = report.get("served", {})
    if served.get("checked") and abs(served["difference_points"]) > opts.served_max_points:
        failures.append(
            f"served test accuracy {served['served_test_accuracy']:.2%} ({served['model']} through the Predictor "
            f"on the {served['photos']} test photo files) differs from the engine's "
            f"{served['engine_test_accuracy']:.2%} on the stored arrays by {abs(served['difference_points']):.2f} "
            f"points > {opts.served_max_points:g}: serving does not preprocess photos as training did, or the "
            f"photos in {served['source']} changed since `leaflens preprocess`")
    return failures


def served_check(model_path: Path, ds: Dataset, engine_test_accuracy: float | None, threads: int,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """Test accuracy of the exported model as users meet it: `leaflens evaluate` on the test split's
    ORIGINAL photo files (through the Predictor and the contract in the model's metadata), beside the
    engine's on the stored arrays. When the photos are gone or no longer decode, the check is skipped
    (``checked`` False, with the reason): the export does not depend on the photos still being there."""
    entry: dict[str, Any] = {"split": "test", "model": model_path.name, "served_test_accuracy": None,
                             "engine_test_accuracy": engine_test_accuracy}
    if engine_test_accuracy is None:
        return {**entry, "checked": False, "reason": f"dataset {ds.root} has no labelled test split"}
    try:
        source, files = dataset_photo_files(ds, "test")
    except PhotosUnavailable as exc:
        return {**entry, "checked": False, "reason": str(exc)}
    t0 = time.perf_counter()
    log(f"served check: {model_path.name} on the {len(files)} test photo files")
    evaluation = evaluate_files(Predictor(model_path, intra_op_threads=threads), files, ds["test"].labels,
                                photos=f"the test split of {ds.root}")
    if evaluation.unreadable:
        first = evaluation.unreadable[0].error
        return {**entry, "checked": False, "reason": f"{len(evaluation.unreadable)} test photo(s) no longer decode "
                                                     f"(first: {first}); they changed since `leaflens preprocess`"}
    served = evaluation.accuracy
    return {**entry, "checked": True, "photos": len(files), "source": str(source), "served_test_accuracy": served,
            "difference_points": 100.0 * (served - engine_test_accuracy),
            "seconds": round(time.perf_counter() - t0, 2)}


@dataclass
class _Subject:
    """What the export ships: the engine model, its model card, its photos per split at its input size (uint8,
    lazily), how its out-of-domain check is fitted, and what the files are."""

    kind: str                          # "student" or "teacher"
    model: Module
    card: ModelCard
    images: Callable[[str], Any]       # split -> uint8 [N, S, S, 3] at the input size (memmaps welcome)
    # budget -> (head, check, validation logits, the module the score reads: the model, or it with the generic branch)
    fit_ood: Callable[[float], tuple[Any, Any, np.ndarray, Module]]
    source: Path                       # the checkpoint it came from
    doc: str


def _student(model: Module, info: RunInfo, ds: Dataset, branch: bool, warnings: list[str],
             log: Callable[[str], None]) -> _Subject:
    card = model_card(info, model)

    def fit(budget: float) -> tuple[Any, Any, np.ndarray, Module]:
        # the student's own blocks and a frozen ImageNet branch (pipeline/ood.py); without its weights, its own alone
        scored, why = ood_check.with_generic_branch(model, card.mean, card.std) if branch else (model, None)
        if why is not None:
            warnings.append(why)
            log(f"warning: {why}")
        head, check, _, val_logits = ood_check.fit_for_dataset(scored, ds, card.contract, card.num_classes, budget)
        return head, check, val_logits, scored

    def images(split: str) -> Any:
        return parity.at_size(ds[split].images, card.input_size, card.contract.centre_crop)

    return _Subject("student", model, card, images, fit, info.path, f"leaflens student, run {info.run_id}")


def _teacher(info: RunInfo, ds: Dataset, threads: int, stack: contextlib.ExitStack,
             log: Callable[[str], None]) -> _Subject:
    """The teacher a run kept (pipeline/teachers/served.py): its network from the run's teacher_model.npz, its
    contract from the teacher stage; its photos are decoded by that contract once, into a temporary folder."""
    from leaflens.pipeline.teachers import served  # noqa: PLC0415

    path = info.teacher_model
    if not path.is_file():
        raise ExportFailed(f"run {info.run_id} kept the teacher but {path} is missing: run `leaflens distill` again")
    net, meta = served.load_teacher_model(path)
    if meta.contract is None:
        raise ExportFailed(f"{path}: the teacher cannot be served ({meta.reason})")
    kept = info.kept_metrics or RunMetrics()
    threshold = kept.uncertain_threshold
    card = ModelCard(classes=meta.classes, contract=meta.contract,
                     uncertain_threshold=threshold if threshold is not None else 0.5,
                     threshold_from_model=threshold is not None, run_id=info.run_id, accuracy=kept.test_accuracy,
                     params=int(net.num_parameters()))
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="leaflens-export-photos-")))
    decoded: dict[str, np.ndarray] = {}

    contract = meta.contract
    how = f"{contract.stored_size} px" + ("" if contract.shorter_side is None else
                                          f" from a shorter side of {contract.shorter_side} px")

    def images(split: str) -> np.ndarray:
        if split not in decoded:
            log(f"decoding the {len(ds[split])} '{split}' photos as the teacher sees them ({how})")
            try:
                decoded[split] = served.decode_split(ds, split, contract, folder)
            except (ValueError, OSError) as exc:  # TeacherStageError (photos gone), ImageDecodeError
                raise ExportFailed(f"the teacher needs the original photos of split '{split}': {exc}") from exc
        return decoded[split]

    def chunks(split: str, batch: int = 32) -> Any:
        x = images(split)
        return (np.asarray(x[i:i + batch]) for i in range(0, len(x), batch))

    def fit(budget: float) -> tuple[Any, Any, np.ndarray, Module]:
        for split in ("train", "val"):
            if split not in ds or not len(ds[split]) or ds[split].labels is None:
                raise ValueError(f"dataset {ds.root} has no labelled '{split}' photos to fit the out-of-domain "
                                 "check on")
        runner = served.StatsRunner(net, contract.input_size, threads)
        head, check, val_logits, _ = served.fit_teacher_ood(runner, contract, chunks("train"),
                                                            np.asarray(ds["train"].labels), chunks("val"),
                                                            len(meta.classes), budget)
        return head, check, val_logits, net  # Lite0's own blocks are the generic features: no branch

    return _Subject("teacher", net, card, images, fit, path,
                    f"leaflens teacher (EfficientNet-Lite0 fine-tuned), kept by run {info.run_id}")


def _check_triton_target(root: Path, name: str) -> None:
    """Refuse, before any work, a Triton repository that another stage's next run would delete, and a model
    folder there holding what this export would delete with it: versions other than the 1 it writes (Triton
    serves the highest version, so an older copy there would have been served instead of this one anyway)."""
    if (above := stage_folder_above(root / name)) is not None:
        parent, kind, stage = above
        raise ExportFailed(f"--triton {root} is inside the {kind} folder {parent}, which `{stage}` replaces whole "
                           "when it runs again: give a folder outside it")
    existing = root / name
    if not existing.is_dir():
        return
    if not (existing / "config.pbtxt").exists():
        raise ExportFailed(f"{existing} exists and is not a Triton model folder; refusing to replace it")
    ours = {"1", "config.pbtxt", triton.LABELS}
    others = sorted(p.name for p in existing.iterdir() if p.name not in ours and not p.name.startswith("."))
    if others:
        raise ExportFailed(f"{existing} holds {', '.join(others)}, which this export would delete (it writes version "
                           "1 and its config); move them out of the folder, or give another --name")


def export_run(opts: ExportOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the export stage (see the module docstring); returns the parity report."""
    with contextlib.ExitStack() as stack:  # the teacher's decoded photos live until the export ends
        return _export_run(opts, log, stack)


def _export_run(opts: ExportOptions, log: Callable[[str], None], stack: contextlib.ExitStack) -> dict[str, Any]:
    t_start = time.perf_counter()
    out = Path(opts.out).resolve()
    if opts.triton_variant not in ("fp32", "fp16", "int8"):
        raise ExportFailed(f"triton variant must be fp32, fp16 or int8, got {opts.triton_variant!r}")
    if opts.triton_variant == "int8" and not opts.int8:
        raise ExportFailed("--triton-variant int8 needs the INT8 model (drop --no-int8)")
    if not 0.0 <= opts.int8_max_drop <= 1.0:
        raise ExportFailed(f"int8_max_drop is a share of the images (0.01 = 1 point), got {opts.int8_max_drop}")
    if opts.int8 and not opts.int8_recipes:
        raise ExportFailed("no INT8 recipe to try; pass --no-int8 to export without INT8")
    triton.check_model_name(opts.name)  # before any work: the name becomes a folder
    triton_root = Path(opts.triton).resolve() if opts.triton is not None else out / "triton"
    triton_inside = triton_root == out or out in triton_root.parents
    _check_out(out)
    if not triton_inside:
        _check_triton_target(triton_root, opts.name)
    # a second export to the same folder (or Triton model) is refused while this one runs, not raced: the
    # loser's summary would describe files the winner replaced
    try:
        stack.enter_context(output_lock(out, "export"))
        if not triton_inside:
            stack.enter_context(output_lock(triton_root / opts.name, "export"))
    except OutputBusy as exc:
        raise ExportFailed(str(exc)) from None
    model, info = load_model(opts.run)
    ds = load_dataset(opts.dataset if opts.dataset is not None else run_dataset(info, Path(opts.run)))
    warnings = _check_dataset(info, ds, opts)
    warnings += [w for w in [_over_budget(Path(opts.run), info)] if w]
    parent = Path(opts.run).resolve().parent
    if (parent / "report.json").is_file() and (parent / BEST).is_file():  # distill's folder of one student
        warnings.append(f"{opts.run} is one student of the run {parent}: it is exported without what that run "
                        "chose for it on validation (its centre crop), so it may answer worse than the run's report "
                        f"says; to ship the model the run kept, export {parent}")
    kept_val = (info.kept_metrics or info.metrics).val_accuracy
    if kept_val is not None and "val" in ds and ds["val"].labels is not None:
        learnt = chance_warning(kept_val, np.asarray(ds["val"].labels), f"the {info.kept or 'student'} of run "
                                f"{info.run_id}")
        warnings += [learnt] if learnt else []
    for w in warnings:
        log(f"warning: {w}")
    threads = opts.threads or usable_cpus()
    # the kept model's probabilities distill chose the "ambiguous" threshold on, and reported: the logits / T
    kept_t = (info.kept_metrics or RunMetrics()).temperature if info.kept == "teacher" else info.metrics.temperature
    temperature = None if kept_t in (None, 1.0) else float(kept_t)
    subject = (_teacher(info, ds, threads, stack, log) if info.kept == "teacher"
               else _student(model, info, ds, opts.ood_branch, warnings, log))
    model, card = subject.model, subject.card
    if temperature is not None:  # before the out-of-domain fit and the checks, which read the served logits
        calibration.scale_classifier(model, temperature)
        log(f"probabilities calibrated on validation: the logits divided by the temperature {temperature:.3f} "
            "(folded into the classifier)")
    if subject.kind == "teacher":
        log(f"run {info.run_id} kept the fine-tuned teacher ({info.teacher_model.name}): exporting it as "
            f"{FP32_FILE}, the served model")
    # drawn demo leaves or photos: the app says which (the source folder found again if the project moved)
    learnt_from = trained_on(ds.manifest, source_root=split_source_dir(ds, "train"))
    if info.kept is not None or info.variant != "distilled":  # only a distilled student learns from them
        learnt_from = replace(learnt_from, unlabeled=None)
    card = replace(card, trained_on=learnt_from, grey_share=_grey_share(ds), temperature=temperature)
    if card.refuses_grey:
        log("the training photos all have colour: a photo without colour will be refused (\"no_colour\")")
    mean, std = np.asarray(card.mean, np.float32), np.asarray(card.std, np.float32)
    size = card.input_size

    exported: Module = model
    outputs: tuple[str, ...] = ("logits",)
    no_val = "val" not in ds or len(ds["val"]) == 0
    if opts.ood and ood_check.supports_ood(model) and no_val:
        msg = (f"dataset {ds.root} has no validation photos to set the out-of-domain threshold on: exported "
               "without an out-of-domain check")
        warnings.append(msg)
        log(f"warning: {msg}")
    elif opts.ood and ood_check.supports_ood(model):
        log("fitting the out-of-domain check on the training photos, thresholding it on the validation photos")
        try:
            head, check, val_logits, scored = subject.fit_ood(opts.ood_budget)
        except ValueError as exc:
            raise ExportFailed(f"cannot fit the out-of-domain check: {exc} (or pass --no-ood)") from exc
        probs = metrics.softmax(val_logits)
        labels = ds["val"].labels
        choice = None if labels is None else metrics.choose_uncertain_threshold(probs, np.asarray(labels))
        if choice is not None and choice["method"] != "default":
            # the "ambiguous" rule of today (a run may record an older rule's threshold); too few validation
            # photos to choose ("default"): the run's own threshold stays
            chosen = float(choice["threshold"])
            if abs(chosen - card.uncertain_threshold) > 1e-6:
                log(f"ambiguous threshold {chosen:.4f}, chosen on validation with today's rule (the run recorded "
                    f"{card.uncertain_threshold:.4f})")
            card = replace(card, uncertain_threshold=chosen, threshold_from_model=True)
        card = replace(card, ood=check, val_ambiguous=float(np.mean(unsure(probs, card.uncertain_threshold))),
                       tie_ratio=TIE_RATIO)
        asked = ood_check.DEFAULT_CONFIDENCE  # what the fit asked; check.confidence is what holds
        if check.confidence is not None and check.confidence < asked:
            need = ood_check.photos_for_confidence(check.budget, asked)
            msg = (f"only {check.val_photos} validation photos: the out-of-domain threshold flags at most "
                   f"{check.budget:.1%} of genuine new photos with {check.confidence:.0%} confidence, not "
                   f"{asked:.0%} ({need} validation photos would give it); add validation photos")
            warnings.append(msg)
            log(f"warning: {msg}")
        exported, outputs = ood_check.ServedModel(scored, head), ("logits", ood_check.OOD_OUTPUT)
        if check.branch is not None:
            b = check.branch
            log(f"out-of-domain check {check.method}: {check.blocks} feature maps, {b.maps} of them from the first "
                f"{b.blocks} blocks of ImageNet EfficientNet-Lite0 ({b.weights}, frozen; {b.params} parameters)")
    elif opts.ood:
        msg = f"{type(model).__name__} does not expose its block outputs: exported without an out-of-domain check"
        warnings.append(msg)
        log(f"warning: {msg}")
    log(f"exporting run {info.run_id} ({type(model).__name__}, {card.params} parameters, "
        f"{size}x{size} input, outputs {', '.join(outputs)})")
    proto = export_onnx(exported, (3, size, size), output_name=outputs, metadata=card.to_metadata(),
                        graph_name=opts.name, doc_string=subject.doc)
    # the out-of-domain score sums squared distances: in float16 a photo far from the training photos, the very
    # one it must flag, overflows 65,504 (inf, or NaN through a spatial mean): it is computed in float32
    proto16 = convert_float16(proto, keep_float32=[o for o in outputs if o == ood_check.OOD_OUTPUT])

    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out)  # folders of killed runs
    if not triton_inside:
        clean_stale_temps(triton_root / opts.name)
    tmp = new_temp_dir(out)
    triton_tmp: Path | None = None
    try:
        paths = {"fp32": save_onnx(proto, tmp / FP32_FILE), "fp16": save_onnx(proto16, tmp / FP16_FILE)}
        if opts.int8 and ("train" not in ds or len(ds["train"]) == 0):
            raise ExportFailed(f"dataset {ds.root} has no training images to calibrate INT8 with; pass --no-int8")
        sessions = {k: parity.cpu_session(p, threads) for k, p in paths.items()}
        split = _pick_split(ds, "val")
        split_labels = ds[split].labels
        if split_labels is None:  # _pick_split picks a labelled split
            raise ExportFailed(f"internal error: the parity split '{split}' of {ds.root} has no labels")
        log(f"parity on the '{split}' split ({len(ds[split])} images)")
        split_images = subject.images(split)
        val, val_ood = parity.engine_and_onnx_outputs(exported, sessions, split_images, mean, std, opts.batch)
        int8: dict[str, Any] | None = None  # parity.json's "int8" entry: the recipes tried and the verdict
        if opts.int8:
            int8 = {"max_drop": opts.int8_max_drop, "attempts": [], "checked_on": cpu_int8_dot()}
            if split != "val":  # the rule is judged on the validation split, never on test
                _skip_int8(int8, f"dataset {ds.root} has no labelled validation split to check INT8 on", opts, log)
            else:
                kept = _first_good_int8(int8, opts, _Int8Inputs(paths["fp32"], tmp / INT8_FILE,
                                                                subject.images("train"), split_images,
                                                                split_labels, val["fp32"], mean, std, threads), log)
                if kept is not None:
                    paths["int8"], sessions["int8"], val["int8"] = kept
        ood_report = None
        if card.ood is not None:
            if "int8" in paths:
                val_ood["int8"] = parity.onnx_scores(sessions["int8"], split_images, mean, std, opts.batch)
            ood_report = _ood_variants(card, paths, val_ood)
        acc = {split: {k: parity.accuracy(v, split_labels) for k, v in val.items()}}
        if split != "test" and "test" in ds and len(ds["test"]) and ds["test"].labels is not None:
            test = parity.engine_and_onnx_logits(model, sessions, subject.images("test"), mean, std, opts.batch)
            acc["test"] = {k: parity.accuracy(v, ds["test"].labels) for k, v in test.items()}
        acc_split = "test" if "test" in acc else split
        own_cards = _own_cards(card, paths, val, split_labels if split == "val" else None, acc[acc_split], ood_report)
        largest = float(np.abs(val["engine"]).max())
        tie = 2 * parity.relative_tolerance(opts.fp32_tolerance, largest)  # as _gates allows
        # FP16 keeps ~3 significant digits: a photo whose two best logits are closer than twice its rounding
        # error (a few ulps of the largest logit) may flip without anything being wrong with the file
        tie16 = 2 * parity.relative_tolerance(opts.fp16_tolerance, largest)
        report: dict[str, Any] = {
            "format": REPORT_FORMAT,
            # absolute, so that `leaflens serve` finds the run and dataset from any working folder
            "run": {"id": info.run_id, "path": str(Path(info.path).resolve()), "metrics": info.metrics.to_dict()},
            # what student.onnx is: the run's student, or the teacher the run kept (and its checkpoint)
            "model": {"kind": subject.kind, "source": str(subject.source), "params": card.params,
                      **({"metrics": info.kept_metrics.to_dict()} if subject.kind == "teacher"
                         and info.kept_metrics is not None else {})},
            "dataset": {"root": str(Path(ds.root).resolve()), "manifest_sha256": manifest_sha256(ds.root),
                        "parity_split": split},
            "onnx": {"opset": OPSET, "ir_version": IR_VERSION, "input": proto.graph.input[0].name,
                     "output": proto.graph.output[0].name, "input_shape": ["batch", 3, size, size],
                     "metadata": card.to_metadata()},
            "files": {k: _file_facts(p) for k, p in paths.items()},
            "parity": {k: {**parity.compare(val["engine"], val[k], {"fp32": tie, "fp16": tie16}.get(k, 0.0)),
                           "split": split} for k in paths},
            **({"ood": ood_report} if ood_report is not None else {}),
            "gates": {"fp32_max_abs_diff_per_logit": opts.fp32_tolerance, "fp32_top1_agreement": 1.0,
                      "fp32_tie_margin": tie, "fp16_min_top1_agreement": opts.fp16_min_agreement,
                      "fp16_tie_margin": tie16},
            "warnings": warnings,
            "options": options_dict(opts),
        }
        report["accuracy"] = acc
        report["variants"] = own_cards
        if int8 is not None:
            report["int8"] = int8
        if int8 is not None and int8["written"]:
            a = acc[acc_split]
            int8.update(split=acc_split, accuracy_fp32=a["fp32"], accuracy_int8=a["int8"],
                        accuracy_change=a["int8"] - a["fp32"],
                        # measured on the parity split (val), not on ``split`` of the accuracies above
                        top1_agreement_with_engine=report["parity"]["int8"]["top1_agreement"],
                        top1_agreement_split=split)

        bench_images = subject.images(acc_split)[: min(32, len(ds[acc_split]))]
        x32 = next(parity.batches(bench_images, mean, std, 32)).transpose(0, 3, 1, 2)
        x32 = np.ascontiguousarray(np.resize(x32, (32, *x32.shape[1:])))  # always a full batch of 32
        log(f"timing on {threads} CPU thread(s)")
        report["speed_cpu"] = {"threads": threads, **{k: parity.speed(s, x32, opts.speed_seconds)
                                                      for k, s in sessions.items()}}
        if int8 is not None and int8["written"]:
            sp = report["speed_cpu"]
            report["int8"]["speedup_vs_fp32"] = sp["int8"]["img_s"] / sp["fp32"]["img_s"]
        del sessions

        served = served_check(paths["fp32"], ds, acc.get("test", {}).get("engine"), threads, log)
        report["served"] = {**served, "max_difference_points": opts.served_max_points}
        if not served["checked"]:
            warnings.append(f"served-accuracy check skipped: {served['reason']}")
            log(f"warning: {warnings[-1]}")

        failures = _gates(report, opts)
        report["passed"] = not failures
        report["failures"] = failures
        if failures:
            failed = out.parent / f"{out.name}.parity-failed.json"
            write_json_atomic(failed, report)
            raise ExportFailed("parity check failed, nothing was replaced: " + "; ".join(failures)
                               + f" (full report: {failed})")

        variant_bytes = paths[opts.triton_variant].read_bytes()
        comment = (f"Written by `leaflens export` for run {info.run_id}: {paths[opts.triton_variant].name}, "
                   f"opset {OPSET}, IR {IR_VERSION}.\nInput: float32 NCHW, normalised (pixel/255 - mean)/std "
                   f"with mean {[round(v, 6) for v in card.mean]} and std {[round(v, 6) for v in card.std]}; "
                   "output: logits (no softmax).")
        config = triton.config_text(onnx.load_from_string(variant_bytes), opts.name, opts.max_batch_size,
                                    opts.queue_delay_us, labels=True, comment=comment)
        if triton_inside:
            rel = triton_root.relative_to(out)
            model_dir = triton.write_model_dir(tmp / rel / opts.name, variant_bytes, config, card.classes)
        else:
            existing = triton_root / opts.name
            if existing.exists() and not (existing / "config.pbtxt").exists():
                raise ExportFailed(f"{existing} exists and is not a Triton model folder; refusing to "
                                   "replace it")
            triton_tmp = new_temp_dir(triton_root / opts.name)
            model_dir = triton.write_model_dir(triton_tmp, variant_bytes, config, card.classes)
        if triton_inside:
            triton.check_model_dir(model_dir)
        else:
            _check_renamed(model_dir, opts.name)
        report["triton"] = {"repository": str(triton_root), "model": opts.name,
                            "variant": opts.triton_variant, "max_batch_size": opts.max_batch_size,
                            "max_queue_delay_microseconds": opts.queue_delay_us}
        report["seconds"] = round(time.perf_counter() - t_start, 2)
        write_json_atomic(tmp / REPORT, report)
        swap_into_place(tmp, out)
        if triton_tmp is not None:
            swap_into_place(triton_tmp, triton_root / opts.name)
            triton_tmp = None
        stale = out.parent / f"{out.name}.parity-failed.json"
        if stale.exists():
            stale.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if triton_tmp is not None:
            shutil.rmtree(triton_tmp, ignore_errors=True)
        raise
    return report


def _grey_share(ds: Dataset) -> float | None:
    """Share of the photos the model learnt from (train, and unlabelled ones) without colour; None when the
    dataset stores no uint8 RGB photos to measure."""
    sets = [ds[s].images for s in ("train", "unlabeled") if s in ds and len(ds[s])]
    if not sets or any(a.dtype != np.uint8 or a.ndim != 4 or a.shape[-1] != 3 for a in sets):
        return None
    total = sum(len(a) for a in sets)
    return sum(quality.grey_share(a) * len(a) for a in sets) / total


def _own_cards(card: ModelCard, paths: dict[str, Path], val_logits: dict[str, np.ndarray], val_labels: Any,
               accuracy: dict[str, float], ood_report: dict[str, Any] | None) -> dict[str, Any]:
    """Write into the FP16 and INT8 files their own figures, which their own rounding moves: the "ambiguous"
    threshold chosen again by the same rule on their own validation probabilities (when the parity split is the
    validation split; else FP32's stays), the share of validation photos it flags, the accuracy (test, when the
    dataset has a labelled test split) and the out-of-domain threshold of ``ood_report``. Returns parity.json's
    "variants" entry: per file, what its metadata says."""
    out: dict[str, Any] = {}
    for k, path in paths.items():
        own = card
        if k != "fp32":
            probs = metrics.softmax(val_logits[k])
            threshold = card.uncertain_threshold
            if val_labels is not None and card.threshold_from_model:
                choice = metrics.choose_uncertain_threshold(probs, np.asarray(val_labels))
                if choice["method"] != "default":
                    threshold = float(choice["threshold"])
            own = replace(card, uncertain_threshold=threshold, accuracy=float(accuracy[k]),
                          val_ambiguous=float(np.mean(unsure(probs, threshold))), tie_ratio=TIE_RATIO,
                          precision="int8" if k == "int8" else "fp16")
            if card.ood is not None and ood_report is not None:
                flagged = ood_report["variants"][k]
                own = replace(own, ood=replace(card.ood, threshold=flagged["threshold"],
                                               val_flagged=flagged["val_flagged"]))
            model = onnx.load(str(path))
            others = {p.key: p.value for p in model.metadata_props if not p.key.startswith(PREFIX)}
            onnx.helper.set_model_props(model, {**others, **own.to_metadata()})  # the variant's own card, whole
            save_onnx(model, path)
        out[k] = {"accuracy": own.accuracy, "uncertain_threshold": own.uncertain_threshold,
                  "val_ambiguous": own.val_ambiguous,
                  "ood_threshold": None if own.ood is None else own.ood.threshold}
    return out


def _ood_variants(card: ModelCard, paths: dict[str, Path], val_ood: dict[str, np.ndarray]) -> dict[str, Any]:
    """Each file's own out-of-domain threshold: FP16 and INT8 compute the score with their own rounding, so
    their thresholds are chosen again on their own validation scores (same budget and confidence), and written
    into their metadata by :func:`_own_cards`. Returns parity.json's "ood" entry: the check, and per file the
    threshold, the share of validation photos flagged, the score's difference from the engine's and the flags'
    agreement."""
    check = card.ood
    assert check is not None
    engine = val_ood["engine"].astype(np.float64)
    variants: dict[str, Any] = {}
    for k in paths:
        scores = val_ood[k].astype(np.float64)
        confidence = ood_check.DEFAULT_CONFIDENCE if check.confidence is None else check.confidence
        threshold = check.threshold if k == "fp32" else ood_check.threshold_for(scores, check.budget, confidence)
        diff = np.abs(scores - engine)
        variants[k] = {"threshold": threshold, "val_flagged": float(np.mean(scores > threshold)),
                       "max_abs_diff": float(diff.max()),
                       "max_rel_diff": float((diff / np.maximum(1.0, np.abs(engine))).max()),
                       "flag_agreement_with_engine": float(np.mean((scores > threshold) == (engine > check.threshold))),
                       "finite": bool(np.isfinite(scores).all())}
    return {**check.to_dict(), "val_ambiguous": card.val_ambiguous, "variants": variants}


@dataclass
class _Int8Inputs:
    """What choosing the INT8 model needs: the FP32 file, where INT8 goes, the (input-size) training images
    to calibrate on, the validation images, labels and FP32 logits, the normalisation, CPU threads."""

    fp32: Path
    out: Path
    train_images: Any
    val_images: Any
    val_labels: np.ndarray
    val_fp32: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    threads: int


def _first_good_int8(int8: dict[str, Any], opts: ExportOptions, src: _Int8Inputs,
                     log: Callable[[str], None]) -> tuple[Path, Any, np.ndarray] | None:
    """Quantise with each of ``opts.int8_recipes`` in turn; keep the first whose validation accuracy is
    within ``opts.int8_max_drop`` of FP32's and return (file, session, validation logits), or None (and
    the reasons) when none is. Every attempt is recorded in ``int8["attempts"]``."""
    fp32_acc = parity.accuracy(src.val_fp32, src.val_labels)
    reasons = []
    for recipe in opts.int8_recipes:
        idx = calibration_indices(len(src.train_images), recipe.calib_images)
        log(f"calibrating INT8 on {len(idx)} training images ({recipe.describe()})")
        q = quantize_int8(src.fp32, src.out, src.train_images[idx], src.mean, src.std, recipe)
        sess = parity.cpu_session(q.path, src.threads)
        logits = parity.onnx_logits(sess, src.val_images, src.mean, src.std, opts.batch)
        acc = parity.accuracy(logits, src.val_labels)
        attempt = {"recipe": recipe.to_dict(), "calibration_images": q.calibration_images,
                   "float_nodes": list(q.float_nodes), "quantize_seconds": round(q.seconds, 2),
                   "validation": {"split": "val", "accuracy_fp32": fp32_acc, "accuracy_int8": acc,
                                  "top1_agreement_with_fp32": float(np.mean(logits.argmax(1)
                                                                            == src.val_fp32.argmax(1)))}}
        int8["attempts"].append(attempt)
        reason = int8_shortfall(fp32_acc, acc, opts.int8_max_drop)
        if reason is None:
            int8.update(attempt, written=True, reason=None)
            return q.path, sess, logits
        log(f"INT8 with {recipe.describe()}: {reason}")
        reasons.append(f"with {recipe.describe()}, {reason}" if len(opts.int8_recipes) > 1 else reason)
        del sess
        q.path.unlink()
    _skip_int8(int8, "; ".join(reasons), opts, log)
    return None


def _skip_int8(int8: dict[str, Any], reason: str, opts: ExportOptions, log: Callable[[str], None]) -> None:
    """Record (and say) why no INT8 file is written; refuse when Triton was asked to serve it."""
    int8.update(written=False, reason=reason)
    log(f"INT8 not written: {reason}")
    if opts.triton_variant == "int8":
        raise ExportFailed(f"--triton-variant int8 asks Triton to serve the INT8 model, which is not written: "
                           f"{reason}; choose another --triton-variant")


def _check_renamed(model_dir: Path, name: str) -> None:
    """Check a model folder still under its temporary name (Triton requires name == folder name)."""
    config = triton.parse_pbtxt((model_dir / "config.pbtxt").read_text(encoding="utf-8"))
    triton.check_config(config, onnx.load(str(model_dir / "1" / "model.onnx")), name)


def summary(report: dict[str, Any]) -> str:
    """A few readable lines about an export report."""
    lines = []
    for k, p in report["parity"].items():
        ties = p.get("ties") or 0
        lines.append(f"{k:>5}: max |diff| {p['max_abs_diff']:.2e}, top-1 agreement {p['top1_agreement']:.2%} "
                     f"on {p['images']} {p['split']} images"
                     # the gates do not count a flip between two classes the engine itself rates alike
                     + (f" ({ties} of the {p['disagreements']} that differ are near-ties, not counted by the "
                        "gate)" if ties and k in ("fp32", "fp16") else ""))
    for split, acc in report.get("accuracy", {}).items():
        lines.append(f"{split} accuracy: " + ", ".join(f"{k} {v:.2%}" for k, v in acc.items()))
    speed = report.get("speed_cpu", {})
    for k in ("fp32", "fp16", "int8"):
        if k in speed:
            s = speed[k]
            lines.append(f"{k:>5} CPU: {s['img_s']:.0f} img/s at batch {s['batch']}, batch-1 p50 "
                         f"{s['b1_p50_ms']:.2f} ms ({speed['threads']} threads)")
    served = report.get("served")
    if served and served["checked"]:
        lines.append(f"served test accuracy {served['served_test_accuracy']:.2%} ({served['model']} on the "
                     f"{served['photos']} test photo files) vs engine {served['engine_test_accuracy']:.2%}")
    elif served:
        lines.append(f"served-accuracy check skipped: {served['reason']}")
    i8 = report.get("int8")
    if i8 and i8.get("written"):
        v = i8.get("validation") or {}
        judged = (f"{100 * (v['accuracy_int8'] - v['accuracy_fp32']):+.2f} points on validation (kept when at most "
                  f"{100 * i8['max_drop']:g} down), " if {"accuracy_int8", "accuracy_fp32"} <= set(v) else "")
        lines.append(f"INT8: accuracy {judged}{100 * i8['accuracy_change']:+.2f} points on {i8['split']}, "
                     f"{i8['speedup_vs_fp32']:.2f}x FP32 throughput")
    elif i8:
        lines.append(f"INT8: not written ({i8['reason']})")
    if "triton" in report:
        t = report["triton"]
        lines.append(f"Triton: {t['repository']}/{t['model']} ({t['variant']}, "
                     f"max_batch_size {t['max_batch_size']})")
    return "\n".join(lines)


def options_dict(opts: ExportOptions) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}


def read_report(out: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads((Path(out) / REPORT).read_text(encoding="utf-8"))
