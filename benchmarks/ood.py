"""Out-of-domain photos: does the served model say "not one of mine" to photos it has never seen?

    python benchmarks/ood.py --data ../shared/data/ibeans [--work DIR] [--candidates]
    python benchmarks/ood.py --data ../shared/data/ibeans --run RUN [--dataset DS]    (exports RUN)
    python benchmarks/ood.py --data ../shared/data/ibeans --model student.onnx        (as it is)
    python benchmarks/ood.py --demo [--data ../shared/data/ibeans]
    python benchmarks/ood.py --run RUN [--dataset DS] --branch-sweep                  (choose the branch)

The model: an iBeans student trained here with the default recipe through the `leaflens` command
(preprocess, teacher, distill, export into ``--work``; a stage is skipped when its output is there and
its inputs and command are the same as last time), or a given run exported here, or a given export.
``--demo`` does the same with the demo model (the Makefile's ``make demo``: `leaflens data synth`,
pipeline/distill_demo.toml).

Photo FILES go through :class:`leaflens.apps.predictor.Predictor` as the app and `leaflens predict`
serve them, and each gets a verdict (refused, out_of_domain, ambiguous, diagnosis, error):

- in domain: the iBeans test photos (``--demo``: the synthetic test split);
- out of domain: ``insects`` (every photo of ``--insects``), ``digits`` (500 MNIST test digits, seeded
  choice, grey to RGB, 224 px PNG), ``synthetic`` (600 leaves of another "crop": `leaflens data synth
  --per-class 75 --broken 0 --seed 7`), ``blank`` (200 seeded solid colours, noise, gradients and
  checkerboards, 224 px PNG); ``--demo`` replaces ``synthetic`` by ``ibeans`` (all iBeans photos).
  The generated sets are written as PNG files under ``--work``/sets. A set whose source is missing is
  skipped, with the reason.

Figures: ``in_domain_not_answered`` (share of in-domain photos whose verdict is not diagnosis),
``in_domain_acc_answered`` (accuracy on those with a diagnosis), ``in_domain_acc`` (plain accuracy:
every photo's top class), and per set ``ood_flagged_<set>`` (share NOT given a diagnosis or an
ambiguous answer, i.e. refused or out_of_domain) and ``auroc_<set>``: AUROC of the model's
``ood_score`` with the in-domain photos as positives (lower score), computed on EVERY decodable photo
(decoded without the refusal check), so that refusing a blank photo does not hide how the score ranks
it. Beside it, the AUROC of the simple alternatives read from the same model's logits: max softmax
probability (the app's old rule) and energy (logsumexp of the logits; Liu et al. 2020).
``--candidates`` (needs the engine run: ``--run``, or the model trained here) adds the engine-side
candidates of the method's exploration - Mahalanobis and 5-NN (cosine) distance on the final
embedding, Mahalanobis distance on all block statistics at once - on the same photos, and the AUROC on
GENERATED negatives (shuffled patches, colour-permuted and grey-scrambled training photos, blobs,
shapes, sinusoid textures): the set the shipped method was chosen on, so its figure there is not
independent. Nothing is tuned on the benchmark's sets: thresholds come with the model.

``--no-ood-branch`` exports ``--run`` with the score of the model's own blocks alone (block-mahalanobis-1,
into ``export_run_own``): the figures before the generic branch. ``--latency-vs OTHER.onnx`` times the
served model against another (batch-1 p50 and batch-32 throughput, interleaved rounds).

``--branch-sweep`` reads no benchmark set: it chooses the length of the score's generic branch
(leaflens.pipeline.ood.GenericBranch) on the run's validation photos and the generated negatives. For 0 to
16 EfficientNet-Lite0 blocks, the score is fitted on the training photos, standardised and thresholded on
one random half of the validation photos and measured on the other half (5 x 2 folds): AUROC of held-out
validation photos against the generated negatives, and the share of negatives flagged. The length kept is
the cheapest within 0.002 AUROC of the best; "alone" rows (the branch's maps without the model's own) are
shown for comparison.

Targets (issue #15): not answered <= 0.05 with accuracy on answered >= plain accuracy; flagged >= 0.95
for blank and digits, >= 0.90 for insects, >= 0.80 for the other crop's leaves (synthetic; ibeans in
``--demo``); AUROC >= 0.95 on every set. Prints a table saying which are met, then one JSON object as
the last line of output.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
EXTS = {".jpg", ".jpeg", ".png"}
VERDICT_ORDER = ("diagnosis", "ambiguous", "out_of_domain", "refused", "error")
ANSWERED = ("diagnosis", "ambiguous")  # verdicts that name a class (flagged = everything else)

SETS = ("insects", "digits", "synthetic", "blank")
DEMO_SETS = ("ibeans", "insects", "digits", "blank")
FLAG_TARGETS = {"blank": 0.95, "digits": 0.95, "insects": 0.90, "synthetic": 0.80, "ibeans": 0.80}
AUROC_TARGET = 0.95
NOT_ANSWERED_TARGET = 0.05

DIGITS, DIGIT_SEED = 500, 0
BLANKS, BLANK_SEED = 200, 1
SET_SIZE = 224  # side of the generated digit and blank PNGs
SYNTH_ARGS = ("--per-class", "75", "--broken", "0", "--seed", "7")
GENERATED, GENERATED_SEED = 600, 123
KNN_K = 5
DEMO_CONFIG = REPO / "pipeline" / "distill_demo.toml"


# ---------------------------------------------------------------------------------------------- metrics
def auroc(in_scores: Sequence[float] | np.ndarray, ood_scores: Sequence[float] | np.ndarray) -> float:
    """AUROC of an out-of-domain score (higher = less like the training photos) with the in-domain
    photos as positives: the chance that a random out-of-domain photo scores above a random in-domain
    one, ties counted half (Mann-Whitney U). 1.0 separates perfectly, 0.5 is chance; NaN when either
    side is empty. Scores must be finite."""
    pos, neg = np.asarray(in_scores, np.float64).ravel(), np.asarray(ood_scores, np.float64).ravel()
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    if not (np.isfinite(pos).all() and np.isfinite(neg).all()):
        raise ValueError("auroc: scores must be finite")
    _, inverse, counts = np.unique(np.concatenate([neg, pos]), return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # average rank of each tie group, from 1
    u = ranks[: len(neg)].sum() - len(neg) * (len(neg) + 1) / 2.0
    return float(u / (len(pos) * len(neg)))


def flagged_share(verdicts: Sequence[str]) -> float:
    """Share of photos NOT given a class (neither ``diagnosis`` nor ``ambiguous``): refused, out of
    domain, or unreadable. NaN for no photos."""
    if not verdicts:
        return float("nan")
    return float(np.mean([v not in ANSWERED for v in verdicts]))


def softmax_score(logits: np.ndarray) -> np.ndarray:
    """Minus the max softmax probability: higher = less sure = more out of domain."""
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(1, keepdims=True))
    return -(z / z.sum(1, keepdims=True)).max(1)


def energy_score(logits: np.ndarray) -> np.ndarray:
    """Minus logsumexp of the logits (the free energy): higher = more out of domain."""
    z = np.asarray(logits, np.float64)
    m = z.max(1)
    return -(m + np.log(np.exp(z - m[:, None]).sum(1)))


def fit_mahalanobis(feats: np.ndarray, labels: np.ndarray, shrink: float) -> tuple[np.ndarray, np.ndarray]:
    """Class means and the shared precision matrix (covariance + ``shrink`` x its mean variance x I)."""
    f = np.asarray(feats, np.float64)
    y = np.asarray(labels)
    means = np.stack([f[y == c].mean(0) for c in np.unique(y)])
    centred = f - means[np.searchsorted(np.unique(y), y)]
    cov = centred.T @ centred / len(f)
    cov += shrink * np.trace(cov) / len(cov) * np.eye(len(cov))
    return means, np.linalg.inv(cov)


def mahalanobis_score(feats: np.ndarray, means: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """Squared Mahalanobis distance to the nearest class mean."""
    f = np.asarray(feats, np.float64)
    return np.stack([np.einsum("nd,de,ne->n", f - m, precision, f - m) for m in means], 1).min(1)


def knn_score(feats: np.ndarray, bank: np.ndarray, k: int = KNN_K) -> np.ndarray:
    """Minus the cosine similarity to the k-th nearest training photo (Sun et al. 2022)."""
    def unit(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, np.float64)
        return a / (np.linalg.norm(a, axis=1, keepdims=True) + 1e-12)

    sims = unit(feats) @ unit(bank).T
    return -np.sort(sims, 1)[:, -min(k, sims.shape[1])]


# ---------------------------------------------------------------------------------------------- photo sets
def photo_files(root: Path, pattern: str = "*/*") -> list[Path]:
    """The photos (jpg/jpeg/png) matching ``pattern`` under ``root``, sorted."""
    return sorted(p for p in root.glob(pattern) if p.is_file() and p.suffix.lower() in EXTS)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file of unsigned bytes (the MNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, ">i4", count=ndim, offset=4))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} values (truncated?)")
    return data.reshape(dims)


def mnist_test_images(mnist: Path) -> Path | None:
    """The MNIST test images file in ``mnist`` (gzipped or not), or None."""
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte"):
        if (mnist / name).is_file():
            return mnist / name
    return None


def blank_image(kind: int, rng: np.random.Generator, size: int = SET_SIZE) -> np.ndarray:
    """One generated non-photo, uint8 ``[size, size, 3]``: kind 0 a solid colour, 1 uniform noise,
    2 Gaussian noise around a colour, 3 a linear gradient between two colours, 4 a checkerboard."""
    yy, xx = np.mgrid[0:size, 0:size] / max(1, size - 1)
    if kind == 0:
        img = np.broadcast_to(rng.integers(0, 256, 3), (size, size, 3)).astype(np.float64)
    elif kind == 1:
        img = rng.integers(0, 256, (size, size, 3)).astype(np.float64)
    elif kind == 2:
        img = rng.normal(rng.uniform(40, 215, 3), rng.uniform(10, 60), (size, size, 3))
    elif kind == 3:
        a, b, angle = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3), rng.uniform(0, 2 * np.pi)
        t = np.cos(angle) * xx + np.sin(angle) * yy
        t = (t - t.min()) / (np.ptp(t) + 1e-9)
        img = a + (b - a) * t[..., None]
    elif kind == 4:
        a, b, cell = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3), int(rng.integers(4, 48))
        board = ((np.arange(size)[:, None] // cell + np.arange(size)[None, :] // cell) % 2).astype(bool)
        img = np.where(board[..., None], a, b)
    else:
        raise ValueError(f"blank kind must be 0..4, got {kind}")
    return np.clip(img, 0, 255).astype(np.uint8)


BLANK_KINDS = ("solid", "uniform_noise", "gaussian_noise", "gradient", "checkerboard")


def write_blanks(out: Path, n: int = BLANKS, size: int = SET_SIZE, seed: int = BLANK_SEED) -> list[Path]:
    """``n`` seeded blanks (the five kinds of :func:`blank_image` in turn) as PNG files in ``out``."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(n):
        path = out / f"{BLANK_KINDS[k % 5]}_{k:03d}.png"
        Image.fromarray(blank_image(k % 5, rng, size)).save(path)
        paths.append(path)
    return paths


def write_digits(images_file: Path, out: Path, n: int = DIGITS, size: int = SET_SIZE,
                 seed: int = DIGIT_SEED) -> list[Path]:
    """A seeded choice of ``n`` digits of an MNIST IDX images file, grey to RGB, resized to ``size`` px,
    as PNG files in ``out`` (named by their index in the file)."""
    digits = read_idx(images_file)
    if digits.ndim != 3:
        raise ValueError(f"{images_file}: expected N x H x W images, got shape {digits.shape}")
    chosen = np.random.default_rng(seed).choice(len(digits), min(n, len(digits)), replace=False)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in sorted(int(i) for i in chosen):
        img = Image.fromarray(digits[i]).convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        path = out / f"digit_{i:05d}.png"
        img.save(path)
        paths.append(path)
    return paths


def cached_set(target: Path, params: dict[str, Any], make: Callable[[Path], object]) -> list[Path]:
    """The photos of a generated set in ``target``: reused when its ``set.json`` holds the same
    ``params``, else ``make(folder)`` writes them into a new folder that then replaces ``target``."""
    from leaflens.files import new_temp_dir, swap_into_place, write_json_atomic  # noqa: PLC0415

    stamp = target / "set.json"
    if not (stamp.is_file() and json.loads(stamp.read_text(encoding="utf-8")) == params):
        tmp = new_temp_dir(target)
        make(tmp)
        write_json_atomic(tmp / "set.json", params)
        swap_into_place(tmp, target)
    return photo_files(target, "*")


def _box_blur(a: np.ndarray, r: int) -> np.ndarray:
    k = 2 * r + 1
    c = np.cumsum(np.pad(a, ((r + 1, r), (0, 0), (0, 0)), mode="reflect"), 0)
    a = (c[k:] - c[:-k]) / k
    c = np.cumsum(np.pad(a, ((0, 0), (r + 1, r), (0, 0)), mode="reflect"), 1)
    return (c[:, k:] - c[:, :-k]) / k


def generated_negatives(train: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` generated non-photos at the stored size of ``train`` (uint8 ``[N, T, T, 3]``), six kinds in
    turn: patch-shuffled training photo, smooth coloured blobs, colour-permuted or inverted training
    photo, random shapes, sinusoid textures, grey training photo with scrambled contrast. What the
    out-of-domain method was chosen on (never the benchmark's sets)."""
    size = train.shape[1]
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            img = np.array(train[rng.integers(len(train))], np.float64)
            g = int(rng.choice([4, 8]))
            p = size // g
            tiles = img[: g * p, : g * p].reshape(g, p, g, p, 3).transpose(0, 2, 1, 3, 4).reshape(g * g, p, p, 3)
            tiles = tiles[rng.permutation(g * g)].reshape(g, g, p, p, 3).transpose(0, 2, 1, 3, 4)
            img[: g * p, : g * p] = tiles.reshape(g * p, g * p, 3)
        elif kind == 1:
            img = _box_blur(_box_blur(rng.uniform(0, 255, (size, size, 3)), int(rng.integers(2, 12))), 3)
            img = (img - img.mean()) * rng.uniform(3, 8) + rng.uniform(60, 200, 3)
        elif kind == 2:
            img = np.array(train[rng.integers(len(train))], np.float64)
            img = img[..., rng.permutation(3)] if rng.random() < 0.5 else 255 - img
        elif kind == 3:
            img = np.broadcast_to(rng.uniform(0, 255, 3), (size, size, 3)).copy()
            yy, xx = np.mgrid[0:size, 0:size]
            for _ in range(int(rng.integers(3, 12))):
                cy, cx = rng.uniform(0, size, 2)
                r = rng.uniform(4, size / 3)
                if rng.random() < 0.5:
                    mask = (yy - cy) ** 2 + (xx - cx) ** 2 < r ** 2
                else:
                    mask = (abs(yy - cy) < r) & (abs(xx - cx) < r * rng.uniform(0.2, 1))
                img[mask] = rng.uniform(0, 255, 3)
        elif kind == 4:
            yy, xx = np.mgrid[0:size, 0:size] / size
            img = np.zeros((size, size, 3))
            for _ in range(3):
                f, th = rng.uniform(1, 20), rng.uniform(0, np.pi)
                wave = np.sin(2 * np.pi * f * (np.cos(th) * xx + np.sin(th) * yy))
                img += wave[..., None] * rng.uniform(-80, 80, 3)
            img += rng.uniform(60, 200, 3)
        else:
            grey = np.array(train[rng.integers(len(train))], np.float64).mean(-1, keepdims=True).repeat(3, -1)
            img = 255 * (grey / 255) ** rng.uniform(0.3, 3)
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return np.stack(out) if out else np.zeros((0, size, size, 3), np.uint8)


# ---------------------------------------------------------------------------------------------- pipeline
def leaflens(*args: str, script: str = "ood.py") -> None:
    """Run one `leaflens` command (its output shown); exit naming it, after ``script`` (the calling
    benchmark), when it fails."""
    cmd = [sys.executable, "-m", "leaflens", *args]
    print("$ leaflens " + " ".join(args), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        sys.exit(f"{script}: `leaflens {' '.join(args)}` failed (exit {rc})")


def file_digest(path: Path) -> str:
    """SHA-256 of a stage input; of a ``.toml`` file, of the settings it parses to, so an edited comment or
    layout in a recipe (pipeline/distill_default.toml) does not make a stage run again."""
    if path.suffix == ".toml":
        from leaflens.pipeline.config import tomllib  # noqa: PLC0415  (tomli before Python 3.11)

        with open(path, "rb") as f:
            settings = tomllib.load(f)
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stage(work: Path, name: str, marker: Path, args: list[str], inputs: Sequence[Path], quiet: list[str],
          script: str = "ood.py") -> None:
    """Run `leaflens ARGS` unless ``marker`` exists and the command and the digests of ``inputs`` are
    those recorded (work/stages.json) when it was last made here. ``quiet`` flags are left out of the key;
    ``script`` names the calling benchmark when the command fails."""
    from leaflens.files import write_json_atomic  # noqa: PLC0415

    key = hashlib.sha256(json.dumps({"args": args, "inputs": [file_digest(p) for p in inputs]}).encode()).hexdigest()
    stamps_path = work / "stages.json"
    stamps = json.loads(stamps_path.read_text(encoding="utf-8")) if stamps_path.is_file() else {}
    if marker.is_file() and stamps.get(name) == key:
        print(f"{name}: reusing {marker.parent} (same command and inputs)", flush=True)
        return
    leaflens(*args, *quiet, script=script)
    stamps[name] = key
    write_json_atomic(stamps_path, stamps)


def train_and_export(work: Path, src: Path, demo: bool, progress: bool) -> tuple[Path, Path, Path]:
    """The default pipeline through the command line into ``work``: (student.onnx, run, dataset)."""
    ds, teacher, run, export = work / "dataset", work / "teacher", work / "student", work / "export"
    cfg = ["--config", str(DEMO_CONFIG)] if demo else []
    leaflens("preprocess", "--src", str(src), "--out", str(ds), "--size", "128",
             *([] if progress else ["--no-progress"]))  # does nothing when the photos are unchanged
    quiet = [] if progress else ["--quiet"]
    stage(work, "teacher", teacher / "teacher.json",
          ["teacher", "--dataset", str(ds), "--out", str(teacher), *cfg], [ds / "manifest.json"], quiet)
    stage(work, "distill", run / "best.npz",
          ["distill", "--dataset", str(ds), "--teacher", str(teacher), "--out", str(run), *cfg],
          [ds / "manifest.json", teacher / "teacher.json"], quiet)
    export_run(work, run, ds, export)
    return export / "student.onnx", run, ds


def export_run(work: Path, run: Path, ds: Path, export: Path, extra: Sequence[str] = ()) -> Path:
    """`leaflens export` of ``run`` (with its dataset ``ds``) into ``export``: always run (seconds), so the
    out-of-domain check and thresholds are those of the leaflens being measured, never a stale export.
    ``extra``: more export options (``--no-ood-branch``)."""
    leaflens("export", "--run", str(run), "--dataset", str(ds), "--out", str(export), *extra)
    return export / "student.onnx"


def test_split(ds_dir: Path) -> tuple[list[Path], list[str]]:
    """A dataset's test photos as files (under the manifest's source folder, found again if the project moved)
    and their class names."""
    from leaflens.data_prep.manifest import load_dataset  # noqa: PLC0415
    from leaflens.pipeline.teachers.stage import split_photo_paths  # noqa: PLC0415

    ds = load_dataset(ds_dir, verify=False)
    if "test" not in ds or ds["test"].labels is None or not ds.manifest.source_root:
        sys.exit(f"ood.py: dataset {ds_dir} has no labelled test split with source files")
    _, files = split_photo_paths(ds, "test")
    return files, [ds.classes[int(y)] for y in ds["test"].labels]


# ---------------------------------------------------------------------------------------------- serving
@dataclass
class Scored:
    """One photo set through the model: served verdicts (refusal on) and raw outputs (refusal off)."""

    name: str
    paths: list[Path]
    verdicts: list[str] = field(default_factory=list)
    labels_served: list[str | None] = field(default_factory=list)
    served_ood: np.ndarray = field(default_factory=lambda: np.zeros(0))
    logits: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # rows of undecodable photos: NaN
    ood: np.ndarray = field(default_factory=lambda: np.zeros(0))
    images: np.ndarray | None = None  # decoded stored-size pixels of the decodable photos (--candidates)

    @property
    def decodable(self) -> np.ndarray:
        return np.isfinite(self.logits).all(1)

    def counts(self) -> dict[str, int]:
        c = Counter(self.verdicts)
        return {v: c[v] for v in VERDICT_ORDER if c[v]}


def model_outputs(predictor: Any, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logits, ood_score) of the exported model for uint8 stored-size images, one onnxruntime call
    (ood_score NaN for a model without that output)."""
    names = [predictor.output_name] + ([predictor.ood_name] if predictor.has_ood else [])
    outs = predictor.session.run(names, {predictor.input_name: predictor.preprocess(images)})
    return outs[0], (outs[1] if len(outs) == 2 else np.full(len(images), np.nan, np.float32))


def serve_set(predictor: Any, name: str, paths: list[Path], batch: int, progress: bool, keep: bool) -> Scored:
    """Verdicts through Predictor.iter_predict_files as served, then every decodable photo's logits and
    ood_score with the refusal check off."""
    from tqdm import tqdm  # noqa: PLC0415

    from leaflens.cpus import usable_cpus  # noqa: PLC0415
    from leaflens.data_prep.decode import ImageDecodeError  # noqa: PLC0415

    s = Scored(name, paths)
    served = tqdm(predictor.iter_predict_files(paths, top_k=2, batch_size=batch), total=len(paths),
                  desc=f"{name}: served", disable=None if progress else True, leave=False)
    preds = list(served)
    s.verdicts = [p.verdict for p in preds]
    s.labels_served = [p.label for p in preds]
    s.served_ood = np.array([np.nan if p.ood_score is None else p.ood_score for p in preds], np.float64)

    def decode(path: Path) -> np.ndarray | None:
        try:
            return predictor.decode(path, refuse=False)
        except ImageDecodeError:
            return None

    k = predictor.card.num_classes
    s.logits = np.full((len(paths), k), np.nan, np.float32)
    s.ood = np.full(len(paths), np.nan, np.float32)
    kept = []
    with ThreadPoolExecutor(usable_cpus()) as pool:
        for start in tqdm(range(0, len(paths), batch), desc=f"{name}: scored", disable=None if progress else True,
                          leave=False):
            decoded = list(pool.map(decode, paths[start:start + batch]))
            rows = [start + i for i, d in enumerate(decoded) if d is not None]
            if rows:
                images = np.stack([d for d in decoded if d is not None])
                s.logits[rows], s.ood[rows] = model_outputs(predictor, images)
                if keep:
                    kept.append(images)
    if keep:
        size = predictor.stored_size
        s.images = np.concatenate(kept) if kept else np.zeros((0, size, size, 3), np.uint8)
    return s


def score_table(s: Scored) -> dict[str, np.ndarray]:
    """Out-of-domain scores (higher = less in domain) of the decodable photos, per method."""
    ok = s.decodable
    out = {"msp": softmax_score(s.logits[ok]), "energy": energy_score(s.logits[ok])}
    if np.isfinite(s.ood[ok]).all():
        out = {"ood_score": s.ood[ok].astype(np.float64), **out}
    return out


# ---------------------------------------------------------------------------------------------- candidates
def candidate_scores(run: Path, ds_dir: Path, in_images: np.ndarray, sets: dict[str, np.ndarray],
                     generated: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    """Engine-side alternatives, fitted on the run's training photos: {method: {set: scores}} for the
    in-domain photos ("in"), every set and the generated negatives ("generated")."""
    from leaflens.data_prep.manifest import load_dataset  # noqa: PLC0415
    from leaflens.pipeline.ood import split_stats  # noqa: PLC0415
    from leaflens.pipeline.runs import load_model  # noqa: PLC0415

    model, info = load_model(run)
    ds = load_dataset(ds_dir, verify=False)
    contract = info.dataset.contract()  # its centre crop included

    def features(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(embedding = the last block's channel means, all block statistics concatenated)."""
        if len(images) == 0:
            return np.zeros((0, 0)), np.zeros((0, 0))
        _, stats = split_stats(model, images, contract)
        last = stats[-1]
        return last[:, : last.shape[1] // 2], np.concatenate(stats, 1)

    emb_tr, all_tr = features(ds["train"].images)
    y = np.asarray(ds["train"].labels)
    mu, sd = all_tr.mean(0), all_tr.std(0) + 1e-6
    maha_e = fit_mahalanobis(emb_tr, y, 1e-3)
    maha_a = fit_mahalanobis((all_tr - mu) / sd, y, 1e-2)
    methods: dict[str, dict[str, np.ndarray]] = {"maha_embedding": {}, "knn_embedding": {}, "maha_all_blocks": {}}
    for name, images in {"in": in_images, **sets, "generated": generated}.items():
        if len(images) == 0:
            continue
        emb, stats = features(images)
        methods["maha_embedding"][name] = mahalanobis_score(emb, *maha_e)
        methods["knn_embedding"][name] = knn_score(emb, emb_tr, KNN_K)
        methods["maha_all_blocks"][name] = mahalanobis_score((stats - mu) / sd, *maha_a)
    return methods


# ---------------------------------------------------------------------------------------------- latency
LATENCY_ROUNDS, LATENCY_SECONDS = 5, 1.0


def compare_latency(models: dict[str, Path], threads: int) -> dict[str, dict[str, float]]:
    """Per named ONNX model (same input shape): file size, median over :data:`LATENCY_ROUNDS` interleaved rounds
    of batch-1 p50 latency and batch-32 throughput on ``threads`` CPU threads (interleaved, so that the
    machine's load falls on every model alike)."""
    from leaflens.pipeline.export import parity  # noqa: PLC0415

    sessions = {k: parity.cpu_session(p, threads) for k, p in models.items()}
    shape = [d if isinstance(d, int) else 32 for d in next(iter(sessions.values())).get_inputs()[0].shape]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in models}
    for _ in range(LATENCY_ROUNDS):
        for k, sess in sessions.items():
            rounds[k].append(parity.speed(sess, x, LATENCY_SECONDS))
    return {k: {"bytes": models[k].stat().st_size, "threads": threads,
                "b1_p50_ms": round(float(np.median([r["b1_p50_ms"] for r in rs])), 3),
                "img_s_batch32": round(float(np.median([r["img_s"] for r in rs])), 1)} for k, rs in rounds.items()}


# ---------------------------------------------------------------------------------------------- the branch
BRANCH_SWEEP = (0, 1, 2, 3, 5, 8, 11, 15, 16)  # Lite0 blocks the generic branch may run (0: no branch)
SWEEP_SEED, SWEEP_REPEATS = 0, 5  # random halves of the validation photos, each fitted on one and measured on the other
SWEEP_TOLERANCE = 0.002  # AUROC within this of the best counts as as good: the fewest parameters win


def _branch_maps(ends: Sequence[int], blocks: int) -> list[int]:
    """Indices (0 = stem, i + 1 = block i) of the maps a branch of ``blocks`` blocks reads
    (:class:`leaflens.pipeline.ood.GenericBranch`)."""
    if blocks == 0:
        return []
    return [0, *[i + 1 for i in sorted({*(e for e in ends if e < blocks), blocks - 1})]]


def all_stats(run: Path, images: dict[str, np.ndarray], threads: int
              ) -> tuple[dict[str, list[np.ndarray]], int, list[int], dict[int, int]]:
    """Per named set of uint8 stored-size photos, the statistics of every map the score may read: the
    student's own blocks, then the generic branch's stem and each of the 16 EfficientNet-Lite0 blocks (one
    onnxruntime pass). Returns them, the number of student blocks, Lite0's stage ends and, per branch length,
    the parameters it adds."""
    from leaflens.engine import Tensor, no_grad  # noqa: PLC0415
    from leaflens.engine.nn import Module  # noqa: PLC0415
    from leaflens.engine.onnx_export import export_onnx  # noqa: PLC0415
    from leaflens.pipeline.export.parity import cpu_session  # noqa: PLC0415
    from leaflens.pipeline.ood import block_stats, generic_branch  # noqa: PLC0415
    from leaflens.pipeline.runs import load_model  # noqa: PLC0415

    model, info = load_model(run)
    contract = info.dataset.contract()  # its centre crop included
    branch, why = generic_branch(contract.mean, contract.std, blocks=16)
    if branch is None:
        sys.exit(f"ood.py: --branch-sweep needs the EfficientNet-Lite0 weights: {why}")
    full_ends = [i for i in range(16)]
    stage_ends = [i for i in range(len(branch.blocks)) if i + 1 == len(branch.blocks)
                  or branch.blocks[i + 1].spec.cout != branch.blocks[i].spec.cout]
    branch.ends = full_ends  # every block's output, to pick from per length
    params = {n: int(sum(p.data.size for m in [branch.stem_conv, branch.stem_bn, *list(branch.blocks)[:n]]
                         for p in m.parameters())) if n else 0 for n in BRANCH_SWEEP}

    class Everything(Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.branch = model, branch

        def forward(self, x: Any) -> tuple[Any, ...]:
            _, own = self.model.forward_blocks(x)
            return tuple(block_stats(m) for m in [*own, *self.branch.maps(x)])

    size = contract.input_size
    with no_grad():
        n_own = len(model.eval().forward_blocks(Tensor(np.zeros((1, size, size, 3), np.float32)))[1])
    graph = export_onnx(Everything(), (3, size, size), output_name=[f"s{i}" for i in range(n_own + 17)])
    session = cpu_session(graph.SerializeToString(), threads)
    out = {}
    for name, imgs in images.items():
        parts = []
        for i in range(0, len(imgs), 64):
            x = contract.prepare(np.asarray(imgs[i:i + 64]))
            parts.append(session.run(None, {"input": np.ascontiguousarray(x.transpose(0, 3, 1, 2))}))
        out[name] = [np.concatenate(p) for p in zip(*parts)]
    return out, n_own, stage_ends, params


def branch_sweep(run: Path, ds_dir: Path, budget: float, threads: int) -> dict[str, Any]:
    """Choose the generic branch's length on validation photos and GENERATED negatives only: for each length
    in :data:`BRANCH_SWEEP`, the score fitted on the training photos with the branch's maps added, in
    :data:`SWEEP_REPEATS` random splits of the validation photos into two folds (standardised and thresholded
    on one half, measured on the other): AUROC of the held-out half against the generated negatives, and the
    share of negatives above the threshold (overall and per kind). No benchmark set is read."""
    from leaflens.data_prep.manifest import load_dataset  # noqa: PLC0415
    from leaflens.pipeline.ood import fit_ood_head  # noqa: PLC0415

    ds = load_dataset(ds_dir, verify=False)
    train = np.asarray(ds["train"].images)
    gen = generated_negatives(train, GENERATED, np.random.default_rng(GENERATED_SEED))
    kinds = np.arange(len(gen)) % 6
    t0 = time.perf_counter()
    stats, n_own, ends, params = all_stats(run, {"train": train, "val": np.asarray(ds["val"].images),
                                                "generated": gen}, threads)
    print(f"statistics of {n_own} own blocks and 17 Lite0 maps for {len(train)} train, {len(ds['val'])} val and "
          f"{len(gen)} generated photos in {time.perf_counter() - t0:.1f} s", flush=True)
    labels = np.asarray(ds["train"].labels)
    n_val = len(ds["val"])
    rng = np.random.default_rng(SWEEP_SEED)
    folds = [np.array_split(rng.permutation(n_val), 2) for _ in range(SWEEP_REPEATS)]
    rows: dict[str, dict[str, Any]] = {}
    for n in BRANCH_SWEEP:
        branch_cols = [n_own + j for j in _branch_maps(ends, n)]
        for only_branch in ((False, True) if n else (False,)):
            cols = branch_cols if only_branch else list(range(n_own)) + branch_cols
            aurocs, flagged, held_flagged, per_kind = [], [], [], []
            for halves in folds:
                for a, b in ((0, 1), (1, 0)):
                    head, check, _ = fit_ood_head([stats["train"][c] for c in cols], labels,
                                                  [stats["val"][c][halves[a]] for c in cols], ds.num_classes, budget)
                    held = head.score_numpy([stats["val"][c][halves[b]] for c in cols])
                    g = head.score_numpy([stats["generated"][c] for c in cols])
                    aurocs.append(auroc(held, g))
                    held_flagged.append(float(np.mean(held > check.threshold)))
                    flagged.append(float(np.mean(g > check.threshold)))
                    per_kind.append([float(np.mean(g[kinds == k] > check.threshold)) for k in range(6)])
            key = f"branch {n}" + (" alone" if only_branch else "")
            rows[key] = {"blocks": n, "own_blocks": not only_branch, "maps": len(cols), "params": params[n],
                         "auroc_generated": float(np.mean(aurocs)), "auroc_spread": float(np.std(aurocs)),
                         "flagged_generated": float(np.mean(flagged)),
                         "flagged_val_heldout": float(np.mean(held_flagged)),
                         "flagged_per_kind": [round(float(v), 3) for v in np.mean(per_kind, 0)]}
    # the method adds the branch's maps to the model's own ("alone" rows are shown for comparison only)
    summed = {k: r for k, r in rows.items() if r["own_blocks"]}
    best = max(r["auroc_generated"] for r in summed.values())
    chosen = min((k for k, r in summed.items() if r["auroc_generated"] >= best - SWEEP_TOLERANCE),
                 key=lambda k: (summed[k]["params"], -summed[k]["auroc_generated"]))
    print(f"\n{'score':<18}{'maps':>5}{'params':>9}{'AUROC gen':>11}{'(sd)':>7}{'gen flagged':>12}{'val flagged':>12}"
          "  flagged per kind (shuffled, blobs, colour-permuted/inverted, shapes, sinusoids, grey-scrambled)")
    for k, r in rows.items():
        print(f"{k:<18}{r['maps']:>5}{r['params']:>9}{r['auroc_generated']:>11.4f}{r['auroc_spread']:>7.4f}"
              f"{r['flagged_generated']:>12.3f}{r['flagged_val_heldout']:>12.3f}  {r['flagged_per_kind']}"
              + ("  <- chosen" if k == chosen else ""))
    print(f"chosen: own blocks + branch, the fewest parameters within {SWEEP_TOLERANCE} AUROC of the best such "
          f"({best:.4f}); {SWEEP_REPEATS} x 2 folds of the validation photos (\"alone\": the branch's maps without the "
          "model's own, for comparison)")
    return {"mode": "branch-sweep", "run": str(run), "dataset": str(ds_dir), "budget": budget,
            "generated": len(gen), "val_photos": n_val, "repeats": SWEEP_REPEATS, "chosen": chosen, "rows": rows}


# ---------------------------------------------------------------------------------------------- main
def rounded(v: float | None) -> float | None:
    return None if v is None or v != v else round(float(v), 4)


def resolve_sets(args: argparse.Namespace, work: Path) -> tuple[dict[str, list[Path]], dict[str, str]]:
    """The out-of-domain photo files per set, and why each missing set was skipped."""
    sets: dict[str, list[Path]] = {}
    skipped: dict[str, str] = {}
    names = DEMO_SETS if args.demo else SETS
    for name in names:
        if name == "insects":
            files = photo_files(args.insects) if args.insects.is_dir() else []
            if not files:
                skipped[name] = f"no photos in {args.insects}/<class>/ (pass --insects DIR)"
                continue
            sets[name] = files
        elif name == "ibeans":
            files = photo_files(args.data, "*/*/*") if args.data.is_dir() else []
            if not files:
                skipped[name] = f"no photos in {args.data}/<split>/<class>/ (pass --data DIR)"
                continue
            sets[name] = files
        elif name == "digits":
            found = mnist_test_images(args.mnist)
            if found is None:
                skipped[name] = f"{args.mnist} has no t10k-images-idx3-ubyte[.gz] (pass --mnist DIR)"
                continue
            idx = found
            params = {"kind": "digits-1", "source": str(idx.resolve()), "size_bytes": idx.stat().st_size,
                      "n": args.digits, "seed": DIGIT_SEED, "px": SET_SIZE}
            sets[name] = cached_set(work / "sets" / "digits", params, partial(write_digits, idx, n=args.digits))
        elif name == "blank":
            params = {"kind": "blank-1", "n": args.blanks, "seed": BLANK_SEED, "px": SET_SIZE}
            sets[name] = cached_set(work / "sets" / "blank", params, lambda out: write_blanks(out, args.blanks))
        elif name == "synthetic":
            out = work / "sets" / "synthetic"
            leaflens("data", "synth", "--out", str(out), *SYNTH_ARGS)  # does nothing when up to date
            sets[name] = photo_files(out)
    return sets, skipped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=SHARED / "ibeans",
                   help="iBeans folder with train/val/test/<class>/ (in-domain; with --demo an out-of-domain set)")
    p.add_argument("--demo", action="store_true", help="the demo model on synthetic leaves instead of iBeans")
    p.add_argument("--model", type=Path, help="an exported student.onnx, used as it is")
    p.add_argument("--run", type=Path, help="a trained run folder to export (instead of training one)")
    p.add_argument("--dataset", type=Path,
                   help="the dataset --run was trained on (default: the one its checkpoint names); with --demo "
                        "and --model, the dataset whose test split is in domain")
    p.add_argument("--work", type=Path, default=Path("artifacts/bench_ood"),
                   help="pipeline outputs and generated sets, reused when their inputs are the same "
                        "(default artifacts/bench_ood)")
    p.add_argument("--insects", type=Path, default=SHARED / "insects", help="insect photos, <class>/*.jpg")
    p.add_argument("--mnist", type=Path, default=SHARED / "mnist", help="folder with the MNIST IDX files")
    p.add_argument("--digits", type=int, default=DIGITS, help=f"MNIST test digits to serve (default {DIGITS})")
    p.add_argument("--blanks", type=int, default=BLANKS, help=f"generated blanks to serve (default {BLANKS})")
    p.add_argument("--candidates", action="store_true",
                   help="also the engine-side candidates and the generated negatives (needs the run)")
    p.add_argument("--no-ood-branch", action="store_true",
                   help="export --run without the generic branch (block-mahalanobis-1: the figures before it)")
    p.add_argument("--latency-vs", type=Path, metavar="ONNX",
                   help="also time the served model against this one (e.g. the same run exported with "
                        "--no-ood-branch), interleaved on this CPU")
    p.add_argument("--branch-sweep", action="store_true",
                   help="only choose the generic branch's length (needs --run): validation photos and generated "
                        "negatives, no benchmark set")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args()
    t_all = time.perf_counter()
    progress = not args.quiet
    mode = "demo" if args.demo else "ibeans"
    if args.model and args.run:
        sys.exit("ood.py: give --model or --run, not both")
    if not args.demo and not (args.data / "test").is_dir():
        sys.exit(f"ood.py: {args.data} has no test/ folder (expected the iBeans layout train/val/test/<class>/)")
    if args.no_ood_branch and not args.run:
        sys.exit("ood.py: --no-ood-branch applies to the export of --run")
    if args.latency_vs and not args.latency_vs.is_file():
        sys.exit(f"ood.py: --latency-vs {args.latency_vs}: file not found")
    if args.model and not args.model.is_file():
        sys.exit(f"ood.py: --model {args.model}: file not found")
    if args.candidates and args.model:
        sys.exit("ood.py: --candidates needs the engine run the model came from: pass --run (or nothing, to train)")
    if args.branch_sweep:
        if not args.run:
            sys.exit("ood.py: --branch-sweep needs --run (and --dataset when the run does not name it)")
        from leaflens.cpus import usable_cpus  # noqa: PLC0415
        from leaflens.pipeline.export.stage import run_dataset  # noqa: PLC0415
        from leaflens.pipeline.ood import DEFAULT_BUDGET  # noqa: PLC0415
        from leaflens.pipeline.runs import read_run  # noqa: PLC0415

        sweep_ds = args.dataset or run_dataset(read_run(args.run), args.run)
        print(json.dumps(branch_sweep(args.run, sweep_ds, DEFAULT_BUDGET, usable_cpus())))
        return
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    mode_work = work / mode

    from leaflens.apps.predictor import Predictor  # noqa: PLC0415
    from leaflens.pipeline.cli.runtime import configure_process  # noqa: PLC0415

    configure_process(engine=args.candidates)
    run: Path | None = None
    ds: Path | None = args.dataset
    if args.demo and ds is None and not args.run:
        synth = mode_work / "synthetic"
        leaflens("data", "synth", "--out", str(synth))  # the Makefile's `make data`; nothing when up to date
    if args.model:
        model = args.model
        if args.demo and ds is None:
            ds = mode_work / "dataset"
            leaflens("preprocess", "--src", str(mode_work / "synthetic"), "--out", str(ds), "--size", "128",
                     *([] if progress else ["--no-progress"]))
    elif args.run:
        from leaflens.pipeline.export.stage import ExportFailed, run_dataset  # noqa: PLC0415
        from leaflens.pipeline.runs import read_run  # noqa: PLC0415

        run = args.run
        if ds is None:
            info = read_run(run)
            if not info.dataset.root:
                sys.exit(f"ood.py: {run}/best.npz names no dataset folder: pass --dataset")
            try:
                ds = run_dataset(info, Path(run))
            except ExportFailed as exc:
                sys.exit(f"ood.py: {exc}")
        model = export_run(mode_work, run, ds, mode_work / ("export_run_own" if args.no_ood_branch else "export_run"),
                           ["--no-ood-branch"] if args.no_ood_branch else [])
    else:
        src = mode_work / "synthetic" if args.demo else args.data
        model, run, ds = train_and_export(mode_work, src, args.demo, progress)

    predictor = Predictor(model)
    card = predictor.card
    method = card.ood.method if card.ood else None
    if args.demo:
        assert ds is not None
        in_paths, in_names = test_split(ds)
    else:
        in_paths = photo_files(args.data / "test", "*/*")
        in_names = [f.parent.name for f in in_paths]
    unknown = sorted(set(in_names) - set(card.classes))
    if unknown:
        sys.exit(f"ood.py: in-domain classes {unknown} are not among the model's classes {list(card.classes)} "
                 f"({model})")
    if not in_paths:
        sys.exit("ood.py: no in-domain test photos found")
    labels = np.array([card.classes.index(c) for c in in_names])

    print(f"model: {model} ({len(card.classes)} classes, stored {card.stored_size} px, input {card.input_size} px)")
    if card.ood:
        print(f"out-of-domain check: {card.ood.method}, threshold {card.ood.threshold:.3f} (flags "
              f"{card.ood.val_flagged:.1%} of {card.ood.val_photos} validation photos; budget {card.ood.budget:.1%}"
              + ("" if card.ood.confidence is None else f" of new photos with {card.ood.achieved_confidence:.0%} "
                 "confidence") + ")"
              f"; ambiguous below top probability {card.uncertain_threshold:.3f}")
    else:
        print("this model has no ood_score output (exported before format 3 or with --no-ood): only the "
              "logit-based scores can be measured")

    sets, skipped = resolve_sets(args, work)
    keep = args.candidates
    t_serve = time.perf_counter()
    in_dom = serve_set(predictor, "in-domain", in_paths, args.batch_size, progress, keep)
    served = {name: serve_set(predictor, name, paths, args.batch_size, progress, keep) for name, paths in sets.items()}
    serve_s = time.perf_counter() - t_serve
    n_photos = len(in_paths) + sum(len(v) for v in sets.values())

    # served vs scored ood_score: the same pixels and model, so the AUROC describes what is served
    diffs = [np.nanmax(np.abs(s.served_ood - s.ood), initial=0.0) for s in (in_dom, *served.values())
             if np.isfinite(s.served_ood).any()]
    parity = float(max(diffs)) if diffs else None

    # in domain
    verd = in_dom.verdicts
    answered = [i for i, v in enumerate(verd) if v == "diagnosis"]
    not_answered = 1.0 - len(answered) / len(verd)
    acc_answered = (float(np.mean([in_dom.labels_served[i] == card.classes[labels[i]] for i in answered]))
                    if answered else float("nan"))
    top = np.where(in_dom.decodable, np.nan_to_num(in_dom.logits, nan=-np.inf).argmax(1), -1)
    acc = float(np.mean(top == labels))

    in_scores = score_table(in_dom)
    results: dict[str, Any] = {}
    alternatives: dict[str, dict[str, float | None]] = {}
    for name, s in served.items():
        ood_scores = score_table(s)
        results[name] = {"photos": len(s.paths), "flagged": flagged_share(s.verdicts),
                         "refused": float(np.mean([v == "refused" for v in s.verdicts])),
                         "unreadable": int((~s.decodable).sum()), "verdicts": s.counts()}
        for m in in_scores:
            alternatives.setdefault(m, {})[name] = rounded(auroc(in_scores[m], ood_scores[m]))

    generated_auroc: dict[str, float | None] = {}
    if args.candidates:
        from leaflens.data_prep.manifest import load_dataset  # noqa: PLC0415

        assert run is not None and ds is not None and in_dom.images is not None
        train = np.asarray(load_dataset(ds, verify=False)["train"].images)
        gen = generated_negatives(train, GENERATED, np.random.default_rng(GENERATED_SEED))
        g_logits, g_ood = model_outputs(predictor, gen) if len(gen) else (np.zeros((0, 1)), np.zeros(0))
        gen_scores = {"ood_score": g_ood.astype(np.float64), "msp": softmax_score(g_logits),
                      "energy": energy_score(g_logits)}
        for m in in_scores:
            generated_auroc[m] = rounded(auroc(in_scores[m], gen_scores[m]))
        print(f"engine-side candidates on {len(in_paths)} in-domain photos, {len(sets)} sets and {len(gen)} "
              f"generated negatives...", flush=True)
        cands = candidate_scores(run, ds, in_dom.images, {k: s.images for k, s in served.items()
                                                          if s.images is not None}, gen)
        for m, per_set in cands.items():
            for name in served:
                if name in per_set:
                    alternatives.setdefault(m, {})[name] = rounded(auroc(per_set["in"], per_set[name]))
            generated_auroc[m] = rounded(auroc(per_set["in"], per_set["generated"])) if "generated" in per_set else None

    # ---- table
    checks: dict[str, bool] = {}

    def mark(key: str, ok: bool | None) -> str:
        checks[key] = bool(ok)
        return "met" if ok else "NOT met"

    print()
    what = "synthetic test split" if args.demo else "iBeans test"
    print(f"in domain: {what}, {len(in_paths)} photos; verdicts {in_dom.counts()}")
    print(f"  plain accuracy (top class, every photo)        {acc:.4f}"
          + (f"   (export's served test accuracy {card.accuracy:.4f})" if card.accuracy is not None else ""))
    print(f"  not answered (no diagnosis)                    {not_answered:.4f}   target <= {NOT_ANSWERED_TARGET:.2f}"
          f"      {mark('in_domain_not_answered', not_answered <= NOT_ANSWERED_TARGET)}")
    print(f"  accuracy on the answered photos                {acc_answered:.4f}   target >= {acc:.4f}    "
          f"{mark('in_domain_acc_answered', acc_answered >= acc)}")
    print()
    method_names = list(alternatives)
    head = f"{'set':<10}{'photos':>7}{'refused':>9}{'flagged':>9}{'target':>8}  {'':<8}"
    head += "".join(f"{'AUROC ' + m if m == 'ood_score' else m:>16}" for m in method_names) + "  verdicts"
    print(head)
    for name in (DEMO_SETS if args.demo else SETS):
        if name in skipped:
            print(f"{name:<10}skipped: {skipped[name]}")
            continue
        r = results[name]
        flag_ok = mark(f"ood_flagged_{name}", r["flagged"] >= FLAG_TARGETS[name])
        line = (f"{name:<10}{r['photos']:>7}{r['refused']:>9.3f}{r['flagged']:>9.3f}{FLAG_TARGETS[name]:>8.2f}"
                f"  {flag_ok:<8}")
        for m in method_names:
            a = alternatives[m].get(name)
            cell = "-" if a is None else f"{a:.3f}"
            if m == "ood_score":
                cell += " " + ("met" if mark(f"auroc_{name}", a is not None and a >= AUROC_TARGET) else "NOT")
            line += f"{cell:>16}"
        print(line + "  " + ", ".join(f"{k} {v}" for k, v in r["verdicts"].items())
              + (f" ({r['unreadable']} unreadable)" if r["unreadable"] else ""))
    if "ood_score" not in method_names:
        for name in results:
            mark(f"auroc_{name}", False)
    print(f"AUROC target >= {AUROC_TARGET:.2f} for ood_score (in-domain photos positive, every decodable photo "
          f"scored with the refusal check off); msp = max softmax probability, energy = logsumexp of the logits"
          + ("; maha/knn: engine-side candidates (--candidates)" if args.candidates else ""))
    if generated_auroc:
        print("AUROC on the GENERATED negatives (the method was chosen on these; not an independent figure): "
              + ", ".join(f"{m} {'-' if v is None else format(v, '.3f')}" for m, v in generated_auroc.items()))
    if parity is not None:
        print(f"served vs scored ood_score: max difference {parity:.2e}")
    met = [k for k, v in checks.items() if v]
    missed = [k for k, v in checks.items() if not v]
    print(f"targets met: {len(met)} of {len(checks)}" + (f"; not met: {', '.join(missed)}" if missed else ""))
    print(f"served {n_photos} photos twice (verdicts, then scores) in {serve_s:.1f} s")

    latency = None
    if args.latency_vs:
        from leaflens.cpus import usable_cpus  # noqa: PLC0415

        latency = compare_latency({"model": model, "other": args.latency_vs}, usable_cpus())
        for k, v in latency.items():
            print(f"latency {k} ({model if k == 'model' else args.latency_vs}): {v['bytes']:,} bytes, batch-1 p50 "
                  f"{v['b1_p50_ms']:.2f} ms, {v['img_s_batch32']:.0f} img/s at batch 32 ({v['threads']} threads)")
    out: dict[str, Any] = {"mode": mode, "model": str(model), "method": method,
                           "ood_branch": card.ood.branch.to_dict() if card.ood and card.ood.branch else None,
                           "ood_threshold": rounded(card.ood.threshold) if card.ood else None,
                           "in_domain_photos": len(in_paths), "in_domain_not_answered": rounded(not_answered),
                           "in_domain_acc_answered": rounded(acc_answered), "in_domain_acc": rounded(acc)}
    for name in (DEMO_SETS if args.demo else SETS):
        r = results.get(name)
        out[f"ood_flagged_{name}"] = rounded(r["flagged"]) if r else None
        out[f"auroc_{name}"] = alternatives.get("ood_score", {}).get(name)
    out.update({
        "refused": {k: rounded(r["refused"]) for k, r in results.items()},
        "verdicts": {"in_domain": in_dom.counts(), **{k: r["verdicts"] for k, r in results.items()}},
        "set_photos": {k: r["photos"] for k, r in results.items()},
        "alternatives_auroc": {m: v for m, v in alternatives.items() if m != "ood_score"},
        "generated_auroc": generated_auroc or None, "skipped": skipped,
        "served_vs_scored_max_diff": parity, "latency": latency,
        "targets_met": checks, "all_targets_met": bool(checks) and not missed,
        "serve_s": round(serve_s, 1), "wall_s": round(time.perf_counter() - t_all, 1),
    })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
