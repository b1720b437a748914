"""Real pest photos: teacher, scratch and distilled students at several input sizes (issue #16, item 7).

    python benchmarks/insects.py --data ../shared/data/insects [--sizes 64,96,128] [--seed 0] [--work DIR]
                                 [--store-size 256] [--jobs 2] [--quick]

The photos (``<class>/*.jpg``, no split given) go through the default pipeline with the `leaflens`
command, as a user runs it:

1. ``leaflens preprocess --split 70/15/15 --seed SEED``: preprocess's own stratified, seeded split, which
   keeps each group of exact or near copies in one split (the set has a series of near-identical studio
   shots in one class; a random split of files would leak them into test). Stored at ``--store-size``
   px (default 256, twice the largest default student input, so every student's crops are cut from a
   sharper image, as 128 px stored / 64 px input beat 64 / 64 on iBeans; the photos are at most 256 px).
2. ``leaflens teacher``: the EfficientNet-Lite0 teacher fine-tuned with the default ``[teacher]`` recipe,
   once, shared by every student size (it decodes the original photos at its own input size).
3. ``leaflens distill --set model.input_size=N`` per size: the scratch and the distilled student with
   the default recipe, and the model the pipeline keeps (pipeline/selection.py: the best student on
   validation, or the teacher when it beats it by ``distill.teacher_margin`` within the budget). The run at
   the default size also trains the recipe's larger students (``model.escalate``) while the teacher leads
   by that margin, as the default pipeline does; they are reported on their own lines (``escalated`` in the
   JSON) and count as students for the first target (``--set 'model.escalate=["lite16@128"]'``: the default
   is none). The other sizes' runs set ``model.escalate=[]``, whatever ``--set`` says.

A stage is skipped when its output is there and its command and inputs (the dataset's manifest, the
teacher's teacher.json, the settings of the installed leaflens's distill_default.toml: not its comments) are
those recorded when it was made (benchmarks/ood.py's ``stage``), so a rerun with more sizes trains only the new
students.

Reported on the test split, which nothing here is chosen on: the teacher's accuracy, each student's,
what each run keeps and its accuracy, parameters and latency (ms per photo at batch 1 on this machine,
as the selection measured it). ``kept_model``/``kept_acc`` are those of the run at the default input
size (``model.input_size`` of pipeline/distill_default.toml), i.e. what `make export` would ship.
Targets (issue #16): the best student >= teacher - 0.02, and every run's kept model >= teacher - 0.02.
Prints a table, then one JSON object as the last line of output: ``wall_s`` is this invocation's wall
time, ``stage_wall_s`` what each stage took when it was made (reused stages cost nothing now).
Invocations with different ``--sizes`` may share ``--work`` side by side once the teacher is made (each
size keeps its own stamps).

``--quick``: a seeded choice of a few photos per class, 1 teacher epoch and 2 student epochs, no warm-up: a
smoke run of the whole path (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import checked_config, positive_int  # noqa: E402  (benchmarks/ is not a package)
from ood import leaflens, photo_files, stage  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = (64, 96, 128)
STORE_SIZE = 256  # twice the largest default input size
SPLIT = "70/15/15"
TARGET_GAP = 0.02  # issue #16: students and the kept model within 2 points of the teacher
QUICK_PER_CLASS, QUICK_TEACHER_EPOCHS, QUICK_EPOCHS = 8, 1, 2
# the smoke recipe, before any --set: no warm-up for the teacher or the students (a warm-up as long as the run
# would leave the learning rate rising throughout, and the stages warn of it)
QUICK_SETS = (f"teacher.epochs={QUICK_TEACHER_EPOCHS}", "teacher.min_steps=0", "teacher.warmup_epochs=0",
              f"train.epochs={QUICK_EPOCHS}", "train.min_steps=0", "train.warmup_epochs=0")
SCRIPT = "insects.py"  # what a failed stage's message starts with (the stage helpers are ood.py's)


# ---------------------------------------------------------------------------------------------- sources
def subset_source(src: Path, out: Path, per_class: int, seed: int = 0) -> Path:
    """A folder ``out/<class>/`` of symlinks to a seeded choice of ``per_class`` photos of each class of
    ``src`` (all of a class's photos when it has fewer). The same ``src``, ``per_class`` and ``seed``
    give the same choice; ``out`` is rebuilt each time."""
    shutil.rmtree(out, ignore_errors=True)
    rng = np.random.default_rng(seed)
    for cdir in sorted(p for p in src.iterdir() if p.is_dir()):
        files = photo_files(cdir, "*")
        pick = sorted(rng.choice(len(files), min(per_class, len(files)), replace=False).tolist()) if files else []
        (out / cdir.name).mkdir(parents=True, exist_ok=True)
        for i in pick:
            os.symlink(files[i].resolve(), out / cdir.name / files[i].name)
    return out


def dataset_splits(ds_dir: Path) -> dict[str, dict[str, list[str]]]:
    """The photos of each split of a preprocessed dataset, per class: {split: {class: [file, ...]}}."""
    from leaflens.data_prep.manifest import load_dataset  # noqa: PLC0415

    ds = load_dataset(ds_dir, verify=False)
    out: dict[str, dict[str, list[str]]] = {}
    for split in ("train", "val", "test"):
        per: dict[str, list[str]] = {c: [] for c in ds.classes}
        if split in ds and ds[split].labels is not None:
            for f, y in zip(ds[split].files, np.asarray(ds[split].labels)):
                per[ds.classes[int(y)]].append(str(f))
        out[split] = per
    return out


def preprocess(src: Path, ds: Path, store: int, seed: int, progress: bool) -> None:
    """`leaflens preprocess` of ``src`` into ``ds`` with the 70/15/15 split of ``seed`` (does nothing when
    the photos and options are unchanged)."""
    leaflens("preprocess", "--src", str(src), "--out", str(ds), "--size", str(store), "--split", SPLIT,
             "--seed", str(seed), *([] if progress else ["--no-progress"]), script=SCRIPT)


# ---------------------------------------------------------------------------------------------- results
def student_row(report: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one distill run's report.json: each student's test accuracy (those of the best student's
    member in a family run), what was kept, its test accuracy, the student's parameters and latency, the
    teacher's when it was a candidate. Members the run trained because the teacher led (``model.escalate``) are
    kept apart under ``escalated`` ({member: its students' figures, parameters, latency}), so a size's row is
    always that size's own student."""
    from leaflens.pipeline.distill import member_pair  # noqa: PLC0415  (the engine only once a run is read)

    variants = report["variants"]
    cands = {c["name"]: c for c in report["selection"]["candidates"]}
    steps = (report.get("escalation") or {}).get("steps") or []
    escalated = [s["member"] for s in steps if s.get("trained")]
    own = [n for n in variants if not any(n.startswith(m + "/") for m in escalated)]
    best_own = (report["best_student"] if report["best_student"] in own
                else max(own, key=lambda n: variants[n]["val_accuracy"]))

    def pair(name: str) -> dict[str, Any]:
        distilled, scratch = member_pair(variants, name)
        return {"scratch": None if scratch is None else scratch["test_accuracy"],
                "distilled": None if distilled is None else distilled["test_accuracy"],
                "scratch_val": None if scratch is None else scratch["val_accuracy"],
                "distilled_val": None if distilled is None else distilled["val_accuracy"]}

    student = cands[best_own]  # its member's size and latency (both variants share them)
    teacher = cands.get("teacher")
    extra = {}
    for member in escalated:
        first = next(n for n in variants if n.startswith(member + "/"))
        extra[member] = {**pair(first), "params": int(cands[first]["params"]), "ms": cands[first]["ms_per_photo"],
                         "network": cands[first].get("architecture")}
    return {**pair(best_own),
            "kept": report["winner"], "kept_acc": report["test_accuracy"], "kept_why": report["selection"]["why"],
            "params": int(student["params"]), "ms": student["ms_per_photo"],
            "teacher_val": None if teacher is None else teacher["val_accuracy"],
            "teacher_params": None if teacher is None else int(teacher["params"]),
            "teacher_ms": None if teacher is None else teacher["ms_per_photo"],
            "teacher_unavailable": report["selection"].get("teacher_unavailable"),
            "escalated": extra}


def _r(x: float | None) -> float | None:
    return None if x is None or x != x else round(float(x), 4)


def summary(teacher_acc: float, rows: Mapping[int, Mapping[str, Any]], default_size: int,
            wall_s: float, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The benchmark's JSON object from the teacher's test accuracy and each size's :func:`student_row`.

    ``kept_model``/``kept_acc``: the run at ``default_size`` (what the default pipeline ships; None when
    that size was not run); ``kept_model_<size>``/``kept_acc_<size>`` for every run. The two targets of
    issue #16 are evaluated on test: ``target_best_student`` (the best student of any size >= teacher -
    0.02) and ``target_kept`` (every run's kept model >= teacher - 0.02)."""
    if not rows:
        raise ValueError("summary() needs at least one student size")
    out: dict[str, Any] = {"teacher_acc": _r(teacher_acc)}
    for size in sorted(rows):
        out[f"scratch_acc_{size}"] = _r(rows[size]["scratch"])
        out[f"distilled_acc_{size}"] = _r(rows[size]["distilled"])
    default = rows.get(default_size)
    out["kept_model"] = None if default is None else default["kept"]
    out["kept_acc"] = None if default is None else _r(default["kept_acc"])
    out["default_size"] = default_size
    for size in sorted(rows):
        out[f"kept_model_{size}"] = rows[size]["kept"]
        out[f"kept_acc_{size}"] = _r(rows[size]["kept_acc"])
    params = {int(r["params"]) for r in rows.values()}
    out["student_params"] = params.pop() if len(params) == 1 else {str(s): int(r["params"]) for s, r in rows.items()}
    for size in sorted(rows):
        out[f"student_ms_{size}"] = rows[size]["ms"]
    teacher_row = next((r for r in rows.values() if r.get("teacher_params") is not None), None)
    out["teacher_params"] = None if teacher_row is None else teacher_row["teacher_params"]
    out["teacher_ms"] = None if teacher_row is None else teacher_row["teacher_ms"]
    escalated = {f"{m}@{size}" if "@" not in m else m: {k: (_r(v) if k in ("scratch", "distilled") else v)
                                                         for k, v in e.items() if not k.endswith("_val")}
                 for size, r in sorted(rows.items()) for m, e in (r.get("escalated") or {}).items()}
    if escalated:
        out["escalated"] = escalated
    students = [a for r in rows.values() for a in (r["scratch"], r["distilled"]) if a is not None]
    students += [a for e in escalated.values() for a in (e["scratch"], e["distilled"]) if a is not None]
    floor = teacher_acc - TARGET_GAP
    out["best_student_acc"] = _r(max(students)) if students else None
    out["target_best_student"] = bool(students) and max(students) >= floor - 1e-9
    out["target_kept"] = all(r["kept_acc"] is not None and r["kept_acc"] >= floor - 1e-9 for r in rows.values())
    out.update(extra or {})
    out["wall_s"] = round(wall_s, 1)
    return out


def print_table(teacher_acc: float, rows: Mapping[int, Mapping[str, Any]], default_size: int) -> None:
    """One line per student input size: test accuracy of each student, what the run kept and why."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}"

    print()
    print(f"insect photos, test accuracy (%); teacher fine-tuned: {pct(teacher_acc)}")
    print(f"{'input':>6} {'scratch':>8} {'distilled':>10} {'(val s/d)':>12} {'kept':>10} {'kept acc':>9} "
          f"{'params':>9} {'ms/photo':>9}")
    for size in sorted(rows):
        r = rows[size]
        mark = " (default)" if size == default_size else ""
        print(f"{size:>6} {pct(r['scratch']):>8} {pct(r['distilled']):>10} "
              f"{pct(r['scratch_val']) + '/' + pct(r['distilled_val']):>12} {r['kept']:>10} {pct(r['kept_acc']):>9} "
              f"{r['params']:>9,} {r['ms'] if r['ms'] is not None else '-':>9}{mark}")
        print(f"{'':>6} kept: {r['kept_why']}")
        for member, e in (r.get("escalated") or {}).items():
            print(f"{'':>6} {pct(e['scratch']):>8} {pct(e['distilled']):>10} "
                  f"{pct(e['scratch_val']) + '/' + pct(e['distilled_val']):>12} {'':>10} {'':>9} {e['params']:>9,} "
                  f"{e['ms'] if e['ms'] is not None else '-':>9} larger student {member} ({e['network']}), trained "
                  "because the teacher led")
    t = next((r for r in rows.values() if r.get("teacher_params") is not None), None)
    if t is not None:
        print(f"teacher: {t['teacher_params']:,} parameters, {t['teacher_ms']} ms per photo")
    else:
        print(f"teacher: not a candidate ({next(iter(rows.values())).get('teacher_unavailable')})")


def made_in(stamps: Path, name: str, marker: Path, make: Callable[[], None]) -> float | None:
    """Run ``make`` (a stage that rewrites ``marker`` when it does any work) and return the seconds the
    stage took when it was made: measured now when ``marker`` changed, else the figure recorded in
    ``stamps``/walls.json when it was (None: made before figures were recorded). So ``stage_wall_s`` of
    a rerun that reuses every stage still says what each one cost."""
    from leaflens.files import write_json_atomic  # noqa: PLC0415

    def stamp() -> int | None:
        return marker.stat().st_mtime_ns if marker.is_file() else None

    before, t = stamp(), time.perf_counter()
    make()
    took = round(time.perf_counter() - t, 1)
    path = stamps / "walls.json"
    walls = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if stamp() != before:
        walls[name] = took
        write_json_atomic(path, walls)
    return walls.get(name)


def git_commit() -> str | None:
    """The repository's commit (with "+dirty" when tracked files differ from it), or None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "insects",
                   help="photos as <class>/*.jpg (default ../shared/data/insects)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="student input sizes (comma-separated)")
    p.add_argument("--seed", type=int, default=0, help="seed of the 70/15/15 split (and of --quick's choice)")
    p.add_argument("--work", type=Path,
                   help="stage outputs, reused when their inputs are the same (default artifacts/bench_insects; "
                        "--quick: artifacts/bench_insects_quick)")
    p.add_argument("--store-size", type=positive_int, default=STORE_SIZE,
                   help=f"size the photos are stored at (default {STORE_SIZE}; the same for every --sizes, so runs "
                        "with other sizes share the dataset and the teacher)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_PER_CLASS} photos per class, {QUICK_TEACHER_EPOCHS} teacher epoch, "
                        f"{QUICK_EPOCHS} student epochs")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="student sizes trained side by side, each process with its share of the cores")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="config override, repeatable: teacher.* keys go to the teacher stage, the others to distill "
                        "(e.g. train.epochs=15: a reduced run, say so when quoting it)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args()
    t_all = time.perf_counter()
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        p.error(f"--sizes must be integers separated by commas, got {args.sizes!r}")
    if not sizes or min(sizes) < 8:
        p.error(f"--sizes needs at least one size of 8 px or more, got {args.sizes!r}")
    store = args.store_size
    if store < max(sizes):
        p.error(f"--store-size {store} is below the largest input size {max(sizes)}: the student's photos would be "
                "blown up")
    sets = [*(QUICK_SETS if args.quick else ()), *args.overrides]
    cfg = checked_config(p, sets)  # a bad --set is refused before anything runs
    # photos straight in class folders: an already split set (train/val/test/<class>/) has none there
    if not args.data.is_dir() or not photo_files(args.data, "*/*"):
        sys.exit(f"{SCRIPT}: {args.data} is not a folder of <class>/ photo folders (the insects set is "
                 "../shared/data/insects; it is not distributed with leaflens)")
    work = args.work or REPO / "artifacts" / ("bench_insects_quick" if args.quick else "bench_insects")
    work.mkdir(parents=True, exist_ok=True)
    progress = not args.quiet
    quiet = [] if progress else ["--quiet"]

    from leaflens.data_prep.manifest import load_dataset  # noqa: PLC0415
    from leaflens.pipeline.config import DEFAULT_CONFIG, load_config  # noqa: PLC0415
    from leaflens.pipeline.teachers.artefact import load_teacher  # noqa: PLC0415

    default_size = load_config(None, []).model.input_size
    # [teacher] settings go to the teacher stage, the rest to distill: a student override never retrains the teacher
    teacher_args = [a for s in sets if s.startswith("teacher.") for a in ("--set", s)]
    distill_args = [a for s in sets if not s.startswith("teacher.") for a in ("--set", s)]
    walls: dict[str, float | None] = {}

    src = subset_source(args.data, work / "source", QUICK_PER_CLASS, args.seed) if args.quick else args.data
    ds, teacher = work / f"dataset_s{store}_seed{args.seed}", work / f"teacher_s{store}_seed{args.seed}"
    walls["preprocess"] = made_in(work, "preprocess", ds / "manifest.json",
                                  lambda: preprocess(src, ds, store, args.seed, progress))
    counts = {s: sum(len(v) for v in per.values()) for s, per in dataset_splits(ds).items()}
    print(f"dataset {ds}: stored {store} px; train {counts['train']}, val {counts['val']}, test {counts['test']} "
          f"photos (split {SPLIT}, seed {args.seed})", flush=True)

    walls["teacher"] = made_in(work, "teacher", teacher / "teacher.json", lambda: stage(
        work, "teacher", teacher / "teacher.json", ["teacher", "--dataset", str(ds), "--out", str(teacher),
                                                    *teacher_args], [ds / "manifest.json", DEFAULT_CONFIG], quiet,
        script=SCRIPT))
    dataset = load_dataset(ds)
    tt = load_teacher(teacher, dataset)
    teacher_acc = float((np.asarray(tt.logits["test"]).argmax(1) == np.asarray(dataset["test"].labels)).mean())
    print(f"teacher: {teacher_acc:.4f} test accuracy ({cfg.teacher.epochs} epochs)", flush=True)

    def distill(size: int) -> dict[str, Any]:
        run, stamps = work / f"run_{size}_s{store}_seed{args.seed}", work / f"stamps_{size}"
        stamps.mkdir(exist_ok=True)  # one stamps file per size: sizes may run side by side
        walls[f"distill_{size}"] = made_in(stamps, "distill", run / "report.json", lambda: stage(
            stamps, "distill", run / "report.json",
            ["distill", "--dataset", str(ds), "--teacher", str(teacher), "--out", str(run),
             "--set", f"model.input_size={size}", *distill_args,
             # the larger students are tried once, by the run at the default size (what the pipeline ships),
             # also when --set gives model.escalate
             *([] if size == default_size else ["--set", "model.escalate=[]"])],
            [ds / "manifest.json", teacher / "teacher.json", DEFAULT_CONFIG], quiet, script=SCRIPT))
        return student_row(json.loads((run / "report.json").read_text(encoding="utf-8")))

    if args.jobs > 1:
        from leaflens.cpus import usable_cpus  # noqa: PLC0415

        share = str(max(1, usable_cpus() // args.jobs))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LEAFLENS_THREADS"):
            os.environ[var] = share  # inherited by the `leaflens distill` processes
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = dict(zip(sizes, pool.map(distill, sizes)))
    else:
        rows = {size: distill(size) for size in sizes}

    print_table(teacher_acc, rows, default_size)
    print("wall time per stage when it was made (s): "
          + ", ".join(f"{k} {'?' if v is None else f'{v:.0f}'}" for k, v in walls.items()))
    extra = {"store_size": store, "split": SPLIT, "seed": args.seed, "counts": counts, "quick": args.quick,
             "overrides": sets, "teacher_epochs": cfg.teacher.epochs, "student_epochs": cfg.train.epochs,
             "commit": git_commit(), "stage_wall_s": walls}
    print(json.dumps(summary(teacher_acc, rows, default_size, time.perf_counter() - t_all, extra)))


if __name__ == "__main__":
    main()
