"""Real field photos: teacher, scratch student and distilled student on iBeans (3 classes).

    python benchmarks/ibeans.py --data ../shared/data/ibeans [--seeds 2] [--fraction 0.25] [--jobs 2]

Train on train, select on val, report on test (the official split). Two settings:
- full: every training photo labelled;
- fraction (default 25 %): a stratified, seeded 25 % of the training photos keep their labels and the
  other 75 % are given to the pipeline as unlabelled photos (labels hidden). The scratch student can
  only use the labelled 25 %; the teacher is fine-tuned on them, self-trains on the unlabelled photos it
  labels confidently (teacher.self_train; the benchmark scores those pseudo-labels against the classes the
  unlabelled files' names keep, which the pipeline never reads), and gives features and logits for all
  photos, which the distilled student learns from.
The teacher (EfficientNet-Lite0, ImageNet weights) is measured frozen (1-NN and linear probe on its
1280-d features) and fine-tuned once per setting; student seeds share it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import checked_config  # noqa: E402  (benchmarks/ is not a package)

from leaflens.data_prep.ingest import IngestOptions, ingest  # noqa: E402
from leaflens.data_prep.manifest import load_dataset  # noqa: E402
from leaflens.engine import Tensor, nn, ops  # noqa: E402
from leaflens.engine.optim import AdamW  # noqa: E402
from leaflens.engine.parallel import num_threads  # noqa: E402
from leaflens.pipeline.cli.runtime import configure_process  # noqa: E402
from leaflens.pipeline.config import TeacherSection, load_config  # noqa: E402
from leaflens.pipeline.distill import member_pair, run_distill  # noqa: E402
from leaflens.pipeline.teachers.artefact import load_teacher  # noqa: E402
from leaflens.pipeline.teachers.effnet import build_effnet_teacher  # noqa: E402
from leaflens.pipeline.teachers.stage import knn_accuracy, served_teacher_writer, write_teacher  # noqa: E402

EXTS = {".jpg", ".jpeg", ".png"}


def fraction_sources(src: Path, work: Path, fraction: float, seed: int = 0) -> tuple[Path, Path]:
    """Symlink trees: labelled (fraction of train + all val/test) and unlabelled (the rest of train)."""
    lab, unl = work / f"labelled_{fraction}", work / f"unlabeled_{fraction}"
    shutil.rmtree(lab, ignore_errors=True)
    shutil.rmtree(unl, ignore_errors=True)
    rng = np.random.default_rng(seed)
    for split in ("train", "val", "test"):
        for cdir in sorted(p for p in (src / split).iterdir() if p.is_dir()):
            files = sorted(f for f in cdir.iterdir() if f.suffix.lower() in EXTS)
            if split == "train":
                keep = set(rng.choice(len(files), max(1, round(fraction * len(files))), replace=False).tolist())
            else:
                keep = set(range(len(files)))
            (lab / split / cdir.name).mkdir(parents=True, exist_ok=True)
            for i, f in enumerate(files):
                if i in keep:
                    os.symlink(f.resolve(), lab / split / cdir.name / f.name)
                else:
                    unl.mkdir(parents=True, exist_ok=True)
                    os.symlink(f.resolve(), unl / f"{cdir.name}__{f.name}")
    return lab, unl


def pseudo_label_accuracy(ds, stage: dict) -> dict | None:
    """The teacher's self-training pseudo-labels (teacher.json ``stage.self_train``) scored against the class
    that :func:`fraction_sources` keeps in each unlabelled file's name (``<class>__<file>``)."""
    st = stage.get("self_train")
    if not st or "pseudo_labels" not in st:
        return None
    rows, labels = st["pseudo_labels"]["rows"], st["pseudo_labels"]["labels"]
    truth = [ds.classes.index(Path(ds["unlabeled"].files[r]).name.split("__")[0]) for r in rows]
    right = sum(int(t == y) for t, y in zip(truth, labels))
    return {"kept": len(rows), "of": st["unlabeled_photos"], "threshold": st["threshold"],
            "accuracy": round(right / len(rows), 4) if rows else None, "kept_round": st.get("kept_round")}


def linear_probe(ds, feats) -> float:
    """Logistic regression on frozen features (engine, AdamW, full batch), chosen on val, scored on test."""
    mu = np.asarray(feats["train"], np.float32).mean(0)
    sd = np.asarray(feats["train"], np.float32).std(0) + 1e-6
    x = {s: (np.asarray(feats[s], np.float32) - mu) / sd for s in ("train", "val", "test")}
    y = {s: np.asarray(ds[s].labels) for s in ("train", "val", "test")}
    model = nn.Linear(x["train"].shape[1], ds.num_classes, rng=np.random.default_rng(0))
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    best = (-1.0, 0.0)
    for _ in range(300):
        opt.zero_grad()
        ops.cross_entropy(model(Tensor(x["train"])), y["train"]).backward()
        opt.step()
        val = float((model(Tensor(x["val"])).data.argmax(1) == y["val"]).mean())
        if val > best[0]:
            best = (val, float((model(Tensor(x["test"])).data.argmax(1) == y["test"]).mean()))
    return best[1]


def teacher_recipe(frozen: bool, epochs: int | None, overrides: Sequence[str] = ()) -> TeacherSection:
    """The default [teacher] recipe, frozen or fine-tuned for ``epochs`` (None: the recipe's), with the
    ``teacher.`` settings among ``overrides`` (the command line's ``--set``)."""
    sets = [f"teacher.frozen={'true' if frozen else 'false'}"] + ([f"teacher.epochs={epochs}"] if epochs else [])
    return load_config(None, sets + teacher_overrides(overrides)).teacher


def teacher_overrides(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if o.strip().startswith("teacher.")]


def teacher_tag(overrides: Sequence[str]) -> str:
    """A suffix for the fine-tuned teachers' folders naming a changed [teacher] recipe, so that ``--reuse``
    never takes a teacher trained with other settings ("" for the default recipe)."""
    own = teacher_overrides(overrides)
    return "_" + hashlib.sha256("\n".join(own).encode()).hexdigest()[:8] if own else ""


def student_sets(seed: int, size: int, epochs: int | None, overrides: Sequence[str]) -> list[str]:
    """The config overrides of one student run: its seed, input size and epochs, then the command line's."""
    return [f"train.seed={seed}", f"model.input_size={size}", *([f"train.epochs={epochs}"] if epochs else []),
            *overrides]


def student_run(job: tuple) -> dict:
    """One (seed, setting) pair: scratch and distilled students by the distill stage, as a result row."""
    work, seed, name, ds_dir, teacher_dir, sets = job
    cfg = load_config(None, sets)
    run_dir = work / f"run_{name}_{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run per recipe, never a resumed one
    rep = run_distill(ds_dir, teacher_dir, run_dir, cfg, progress=False)
    distilled, scratch = member_pair(rep["variants"], rep["best_student"])  # the best member's, in a family run
    return {"seed": seed, "setting": name, "scratch": scratch["test_accuracy"],
            "distilled": distilled["test_accuracy"], "winner": rep["winner"],
            "scratch_val": scratch["val_accuracy"], "distilled_val": distilled["val_accuracy"],
            "params": rep["params"]}


def report_row(row: dict) -> dict:
    print(f"seed {row['seed']} {row['setting']:>4}: scratch {row['scratch']:.4f}  distilled {row['distilled']:.4f}  "
          f"(val {row['scratch_val']:.4f} / {row['distilled_val']:.4f}, kept {row['winner']})", flush=True)
    return row


def main() -> None:
    configure_process(engine=True)  # what the `leaflens` command runs with
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="iBeans folder with train/val/test/<class>/")
    p.add_argument("--seeds", type=int, default=2, help="student seeds per setting")
    p.add_argument("--fraction", type=float, default=0.25, help="labelled fraction of the training photos")
    p.add_argument("--size", type=int, default=64, help="student input size (model.input_size)")
    p.add_argument("--store-size", type=int, default=128,
                   help="size the photos are preprocessed to (default 128: the student's crops are cut from the "
                        "sharper stored image; 0: the student input size)")
    p.add_argument("--epochs", type=int, help="student epochs (default: the distill config's)")
    p.add_argument("--teacher-epochs", type=int, default=8, help="teacher fine-tuning epochs")
    p.add_argument("--teacher-views", type=int, default=1, metavar="K",
                   help="teacher view bank: K augmented views per training/unlabelled photo, so the distilled "
                        "student learns on the views the teacher judged (default 1: plain photos)")
    p.add_argument("--work", type=Path, help="keep intermediate artefacts here (default: a temp folder)")
    p.add_argument("--reuse", action="store_true",
                   help="with --work: reuse the frozen-teacher figures and fine-tuned teachers already there "
                        "(to try student recipes without re-training the teachers)")
    p.add_argument("--settings", default="full,frac",
                   help="which student settings to train: full, frac or both (comma-separated)")
    p.add_argument("--jobs", type=int, default=1,
                   help="student runs side by side, each in its own process with its share of the cores "
                        "(2 on a 2-core CPU: about 1.5x the throughput of one run using both cores)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="config override (repeatable); teacher.* settings also change the fine-tuned teachers")
    args = p.parse_args()
    settings = {x.strip() for x in args.settings.split(",") if x.strip()}
    for bad, why in ((args.seeds < 1, f"--seeds must be 1 or more, got {args.seeds}"),
                     (not 0 < args.fraction <= 1, f"--fraction must be in (0, 1], got {args.fraction}"),
                     (args.jobs < 1, f"--jobs must be 1 or more, got {args.jobs}"),
                     (args.epochs is not None and args.epochs < 1, f"--epochs must be 1 or more, got {args.epochs}"),
                     (args.teacher_epochs < 1, f"--teacher-epochs must be 1 or more, got {args.teacher_epochs}"),
                     (not settings or not settings <= {"full", "frac"},
                      f"--settings takes full, frac or both (comma-separated), got {args.settings!r}")):
        if bad:
            p.error(why)
    # every --set as the stages will read it, before any of them runs: the teachers' recipe and the students'
    checked_config(p, [f"teacher.epochs={args.teacher_epochs}", *args.overrides])
    checked_config(p, student_sets(0, args.size, args.epochs, args.overrides))
    if not args.data.is_dir():
        sys.exit(f"ibeans.py: {args.data} does not exist (the iBeans photos: ../shared/data/ibeans beside the "
                 "project, or the official release in train/val/test/<class>/ folders)")
    missing = [s for s in ("train", "val", "test") if not (args.data / s).is_dir()]
    if missing:
        sys.exit(f"ibeans.py: {args.data} has no {', '.join(m + '/' for m in missing)} folder (expected the iBeans "
                 "layout: train/, val/ and test/ with a folder per class)")
    t_all = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="leaflens-ibeans-"))
    work.mkdir(parents=True, exist_ok=True)
    walls: dict[str, float] = {}

    def timed(name, fn, *a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        walls[name] = walls.get(name, 0.0) + time.perf_counter() - t0
        return out

    quiet = dict(log=lambda s: None)
    store = args.store_size or args.size
    tag = f"_s{store}"  # datasets (and the teachers tied to them) per stored size
    ds_dirs = {"full": work / f"ds_full{tag}", "frac": work / f"ds_frac{tag}"}
    lab, unl = fraction_sources(args.data, work / "sources", args.fraction)
    timed("preprocess", ingest, args.data, ds_dirs["full"], IngestOptions(size=store), **quiet)
    timed("preprocess", ingest, lab, ds_dirs["frac"], IngestOptions(size=store), unlabeled=unl, **quiet)
    ds_full, ds_frac = load_dataset(ds_dirs["full"]), load_dataset(ds_dirs["frac"])

    # frozen teacher: how good are ImageNet features on these photos?
    frozen_json = work / "teacher_frozen.json"
    if args.reuse and frozen_json.is_file():
        knn, probe = (json.loads(frozen_json.read_text())[k] for k in ("knn", "probe"))
    else:
        enc, _ = timed("teacher_frozen", build_effnet_teacher, ds_full, teacher_recipe(True, None), progress=False)
        feats = enc.features
        knn = knn_accuracy(np.asarray(feats["train"], np.float32), np.asarray(ds_full["train"].labels),
                           np.asarray(feats["test"], np.float32), np.asarray(ds_full["test"].labels))
        probe = timed("teacher_probe", linear_probe, ds_full, feats)
        frozen_json.write_text(json.dumps({"knn": knn, "probe": probe}))

    teachers, teacher_acc, pseudo = {}, {}, {}
    for name, ds in (("full", ds_full), ("frac", ds_frac)):
        tdir = work / f"teacher_{name}_e{args.teacher_epochs}_v{args.teacher_views}{tag}{teacher_tag(args.overrides)}"
        if not (args.reuse and (tdir / "teacher.json").is_file()):
            recipe = teacher_recipe(False, args.teacher_epochs, args.overrides)
            enc, extra = timed(f"teacher_finetune_{name}", build_effnet_teacher, ds, recipe, progress=False)
            # with the served teacher, as `leaflens teacher` writes it: distill may keep it (or start a student
            # from it, or run it in the training loop: --set model.trunk_init=teacher, distill.teacher_online=true)
            timed(f"teacher_features_{name}", write_teacher, tdir, ds, enc, progress=False, stage=extra,
                  views=args.teacher_views, view_scale=recipe.view_scale, view_seed=recipe.seed,
                  finish=served_teacher_writer(enc.network, ds, enc.identity(), batch=recipe.encode_batch_size))
        tt = load_teacher(tdir, ds)
        teachers[name] = tdir
        teacher_acc[name] = float((np.asarray(tt.logits["test"]).argmax(1) == np.asarray(ds["test"].labels)).mean())
        pseudo[name] = pseudo_label_accuracy(ds, tt.info.stage)

    jobs = [(work, seed, name, ds_dirs[name], teachers[name],
             student_sets(seed, args.size, args.epochs, args.overrides))
            for seed in range(args.seeds) for name in ds_dirs if name in args.settings.split(",")]
    rows = []
    if args.jobs > 1:
        # Each run in its own process with its share of the cores (BLAS and the engine's threads), so
        # that the single-threaded parts of a training step overlap too.
        share = str(max(1, num_threads() // args.jobs))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LEAFLENS_THREADS"):
            os.environ[var] = share
        t0 = time.perf_counter()
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for row in pool.map(student_run, jobs):
                rows.append(report_row(row))
        walls["students"] = time.perf_counter() - t0
    else:
        for job in jobs:
            rows.append(report_row(timed(f"students_{job[2]}", student_run, job)))

    def rounded(v: float) -> float | None:
        return None if v != v else round(v, 4)

    def teacher_minutes(name: str) -> float | None:
        parts = [walls[k] for k in (f"teacher_finetune_{name}", f"teacher_features_{name}") if k in walls]
        return round(sum(parts) / 60, 1) if parts else None

    def stat(setting, key):
        vals = [r[key] for r in rows if r["setting"] == setting]
        if not vals:
            return float("nan"), float("nan")
        return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)

    print()
    print(f"iBeans test accuracy ({args.seeds} seeds; student {args.size}x{args.size}, stored at {store} px, "
          f"{rows[0]['params']:,} parameters; fraction setting: {args.fraction:.0%} labelled + the rest unlabelled)")
    print(f"{'':<34}{'full labels':>16}{f'{args.fraction:.0%} labels':>16}")
    print(f"{'teacher frozen, 1-NN':<34}{knn:>16.4f}{'':>16}")
    print(f"{'teacher frozen, linear probe':<34}{probe:>16.4f}{'':>16}")
    print(f"{'teacher fine-tuned':<34}{teacher_acc['full']:>16.4f}{teacher_acc['frac']:>16.4f}")
    for key in ("scratch", "distilled"):
        (mf, sf), (mr, sr) = stat("full", key), stat("frac", key)
        print(f"{'student ' + key:<34}{f'{mf:.4f} ± {sf:.4f}':>16}{f'{mr:.4f} ± {sr:.4f}':>16}")
    print("wall time per stage (s): " + ", ".join(f"{k} {v:.0f}" for k, v in walls.items()))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({
        "teacher_knn_acc": round(knn, 4), "teacher_probe_acc": round(probe, 4),
        "teacher_finetuned_acc": round(teacher_acc["full"], 4),
        "teacher_finetuned_acc_25": round(teacher_acc["frac"], 4),
        # the 25 % teacher's self-training: unlabelled photos kept, of how many, and how many rightly labelled
        "teacher_pseudo_labels_25": pseudo.get("frac"),
        # the fine-tune (and features) of the full-labels teacher, the 1034-photo budget; None with --reuse
        "teacher_minutes": teacher_minutes("full"), "teacher_minutes_25": teacher_minutes("frac"),
        "scratch_acc": rounded(stat("full", "scratch")[0]), "distilled_acc": rounded(stat("full", "distilled")[0]),
        "scratch_acc_25": rounded(stat("frac", "scratch")[0]),
        "distilled_acc_25": rounded(stat("frac", "distilled")[0]),
        # per setting, per seed: what each run keeps and `leaflens export` ships (a student, or "teacher")
        "kept_models": {s: [r["winner"] for r in rows if r["setting"] == s] for s in args.settings.split(",")},
        "student_params": rows[0]["params"], "seeds": args.seeds, "fraction": args.fraction,
        "teacher_views": args.teacher_views, "overrides": args.overrides, "input_size": args.size,
        "store_size": store,
        "wall_s": round(time.perf_counter() - t_all, 1), "stage_wall_s": {k: round(v, 1) for k, v in walls.items()},
    }))


if __name__ == "__main__":
    main()
