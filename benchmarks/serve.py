"""Serving speed: sequential batch-1 calls vs the DynamicBatcher, and photo-to-answer latency.

Measures, on an exported leaflens model (or a stand-in of the student's shape when none is given):

(a) sequential batch-1 ``Predictor.predict_arrays`` calls (the reference): every combination of
    intra-op threads (1, all usable CPUs) and thread spinning is tried and the fastest is used as
    the baseline, so the batcher is compared with the best a single caller can do;
(b) the DynamicBatcher under 1, 8, 32 and 128 concurrent client threads, each in a closed loop
    (submit one decoded photo at the stored size, wait for its answer, repeat): throughput and
    p50/p95/p99 latency;
(c) end to end: a 4000x3000 JPEG file (made here with Pillow: shapes, gradients and sensor-like
    noise, about the size of a phone photo) to a ranked answer with ``Predictor.predict_image``,
    next to the same without JPEG draft decoding (full-size decode, then resize) as a reference;
(d) the batching ceiling: the model alone (no batcher, no queue), called by one thread with batches
    of 1, 4, 16 and 64 images on the baseline's settings. No batcher can beat the best of these per
    image, so (b)'s speed-up over (a) is bounded by ``ceiling`` = best batched rate / batch-1 rate:
    large where a call's fixed cost dominates (GPUs, tiny models), near 1 where the convolutions'
    arithmetic already keeps the cores busy at batch 1.

Prints a table, then one JSON line with the figures as the last line of output.

    python benchmarks/serve.py [--model artifacts/export/student.onnx] [--seconds 3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import non_negative_float, positive_float, positive_int, positive_ints  # noqa: E402  (not a package)

from leaflens.apps.batcher import DynamicBatcher  # noqa: E402
from leaflens.apps.model_card import ModelError  # noqa: E402
from leaflens.apps.predictor import Predictor  # noqa: E402
from leaflens.cpus import usable_cpus  # noqa: E402

STANDIN_CLASSES = ["angular_leaf_spot", "bean_rust", "healthy"]


def build_standin(path: Path, size: int = 64, widths: tuple[int, ...] = (32, 64, 128), seed: int = 0) -> Path:
    """An ONNX model of the student's shape (3x3 conv + ReLU + 2x2 max-pool blocks, GAP, Gemm) with
    random He-initialised weights and leaflens metadata: the same work per image as the student, and
    its preprocessing contract (photos decoded to twice the input size, then area-averaged)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes, prev, cin = [], [], "input", 3
    for i, cout in enumerate(widths):
        w = rng.normal(0.0, np.sqrt(2.0 / (9 * cin)), (cout, cin, 3, 3)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"conv{i}.w"),
                  numpy_helper.from_array(rng.normal(0, 0.01, cout).astype(np.float32), f"conv{i}.b")]
        nodes += [
            helper.make_node("Conv", [prev, f"conv{i}.w", f"conv{i}.b"], [f"conv{i}"], kernel_shape=[3, 3],
                             pads=[1, 1, 1, 1]),
            helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"]),
            helper.make_node("MaxPool", [f"relu{i}"], [f"pool{i}"], kernel_shape=[2, 2], strides=[2, 2]),
        ]
        prev, cin = f"pool{i}", cout
    n_cls = len(STANDIN_CLASSES)
    inits += [numpy_helper.from_array(rng.normal(0, 0.1, (n_cls, cin)).astype(np.float32), "fc.w"),
              numpy_helper.from_array(np.zeros(n_cls, np.float32), "fc.b")]
    nodes += [helper.make_node("GlobalAveragePool", [prev], ["gap"]),
              helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
              helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], transB=1)]
    graph = helper.make_graph(
        nodes, "standin_student",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", n_cls])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {
        "leaflens.format": "2", "leaflens.classes": json.dumps(STANDIN_CLASSES),
        "leaflens.stored_size": str(2 * size), "leaflens.input_size": str(size), "leaflens.mean": "[0.5, 0.5, 0.5]",
        "leaflens.std": "[0.25, 0.25, 0.25]",
        "leaflens.layout": "NCHW", "leaflens.resize": "crop", "leaflens.run_id": "standin",
    })
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def make_photo(path: Path, width: int = 4000, height: int = 3000, seed: int = 0, quality: int = 90) -> Path:
    """A phone-like 4000x3000 JPEG: gradient background, leaf-shaped blobs with veins, sensor noise,
    EXIF orientation 6 (portrait shot held sideways). Not trivially compressible (~ several MB)."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(40, 200, (6, 8, 3), dtype=np.uint8)).resize((width, height),
                                                                                  Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(base)
    for _ in range(60):
        cx, cy = rng.integers(0, width), rng.integers(0, height)
        rx, ry = rng.integers(150, 700), rng.integers(80, 350)
        green = tuple(int(v) for v in (rng.integers(20, 110), rng.integers(90, 200), rng.integers(10, 80)))
        draw.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=green)
        for _ in range(8):  # veins and lesions: fine detail the encoder must keep
            x0, y0 = cx + rng.integers(-rx, rx), cy + rng.integers(-ry, ry)
            draw.line([cx, cy, x0, y0], fill=(150, 170, 90), width=int(rng.integers(2, 6)))
            r = int(rng.integers(5, 30))
            draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=(120, 70, 30))
    base = base.filter(ImageFilter.GaussianBlur(1.2))
    arr = np.asarray(base, dtype=np.int16)
    noise = rng.normal(0.0, 7.0, (height, width, 1)) + rng.normal(0.0, 3.0, (height, width, 3))
    arr = np.clip(arr + noise, 0, 255).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(path, "JPEG", quality=quality, exif=exif)
    return path


def pct(latencies_s: list[float]) -> dict[str, float]:
    lat = np.asarray(latencies_s) * 1000.0
    p50, p95, p99 = np.percentile(lat, [50, 95, 99]) if len(lat) else (float("nan"),) * 3
    return {"p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99)}


@dataclass
class Tally:
    """Requests, measured seconds and latencies of one scenario, summed over the rounds."""

    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    batches: int = 0
    batched_items: int = 0
    cpu_s: float = 0.0  # process CPU time (all threads) ...
    wall_s: float = 0.0  # ... over this wall time: cpu_s / wall_s = cores this process really got

    def summary(self) -> dict[str, float]:
        mean_batch = self.batched_items / self.batches if self.batches else 1.0
        return {"img_s": len(self.latencies) / self.seconds, **pct(self.latencies), "mean_batch": mean_batch,
                "cores_used": self.cpu_s / self.wall_s if self.wall_s else float("nan")}


def bench_sequential(predictor: Predictor, images: np.ndarray, seconds: float, tally: Tally, batch: int = 1) -> None:
    """One caller, calls of ``batch`` images back to back: batch 1 is (a); larger batches, the model
    alone without a batcher, are (d). Every image of a call is counted with that call's latency."""
    n = len(images)

    def chunk(i: int) -> np.ndarray:
        return images[i % n][None] if batch == 1 else np.take(images, np.arange(i * batch, (i + 1) * batch) % n, 0)

    for i in range(10):
        predictor.predict_arrays(chunk(i))
    cpu0 = time.process_time()
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < seconds:
        x = chunk(i)
        t = time.perf_counter()
        predictor.predict_arrays(x)
        tally.latencies.extend([time.perf_counter() - t] * batch)
        i += 1
    tally.seconds += time.perf_counter() - start
    tally.cpu_s += time.process_time() - cpu0
    tally.wall_s += time.perf_counter() - start


def bench_batched(predictor: Predictor, images: np.ndarray, reference: np.ndarray, clients: int,
                  seconds: float, tally: Tally, max_batch_size: int, max_wait_ms: float, workers: int) -> None:
    """``clients`` threads in a closed loop through one DynamicBatcher, after 0.2 s of warm-up.

    Throughput counts the requests started inside the measured window; every 25th answer of each
    client is checked against the reference probabilities of its own image (no swapped results).
    """
    batcher = DynamicBatcher(predictor.predict_arrays, max_batch_size=max_batch_size,
                             max_wait_ms=max_wait_ms, max_queue=4 * max(clients, max_batch_size),
                             num_workers=workers)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    t_start, t_stop = t0 + 0.2, t0 + 0.2 + seconds
    per_client: list[list[float]] = [[] for _ in range(clients)]
    wrong: list[int] = []

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        lat = per_client[k]
        n = 0
        while True:
            j = int(rng.integers(len(images)))
            t = time.perf_counter()
            if t >= t_stop:
                return
            probs = batcher.submit(images[j]).result()
            done = time.perf_counter()
            if t >= t_start:
                lat.append(done - t)
            n += 1
            if n % 25 == 1 and not np.allclose(probs, reference[j], atol=1e-4):
                wrong.append(j)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    batcher.close()
    tally.cpu_s += time.process_time() - cpu0
    tally.wall_s += time.perf_counter() - t0
    if wrong:
        raise RuntimeError(f"batcher returned wrong probabilities for images {wrong[:5]}")
    stats = batcher.stats()
    tally.seconds += seconds
    tally.latencies.extend(x for c in per_client for x in c)
    tally.batches += stats.batches
    tally.batched_items += stats.batched_items


def bench_e2e(predictor: Predictor, photo: Path, runs: int) -> dict[str, float]:
    """Photo file -> ranked answer (read, EXIF, draft decode, resize, normalise, model, softmax, rank).

    Also reports the calling thread's CPU time (with one intra-op thread all the work runs on it):
    what the wall time would be on an otherwise idle CPU.
    """
    predictor.predict_image(photo)
    lat, cpu = [], []
    for _ in range(runs):
        c, t = time.thread_time(), time.perf_counter()
        answer = predictor.predict_image(photo, top_k=3)
        lat.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        assert answer.ok, answer.error
    return {**pct(lat), "cpu_p50_ms": float(np.median(cpu) * 1000.0)}


def bench_e2e_full_decode(predictor: Predictor, photo: Path, runs: int) -> dict[str, float]:
    """Reference: the same without JPEG draft mode (decode all 12 MP, then resize and crop)."""
    size = predictor.stored_size
    lat = []
    for _ in range(runs):
        t = time.perf_counter()
        with Image.open(io.BytesIO(photo.read_bytes())) as im:
            im = im.convert("RGB")
            w, h = im.size
            side = min(w, h)
            box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
            pixels = np.asarray(im.resize((size, size), Image.Resampling.BOX, box=box), dtype=np.uint8)
        predictor.judge(predictor.score_arrays(pixels[None])[0], 3, str(photo))
        lat.append(time.perf_counter() - t)
    return pct(lat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="exported .onnx (default: build a stand-in of the student)")
    ap.add_argument("--seconds", type=positive_float, default=3.0, help="measured seconds per throughput scenario")
    ap.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds the seconds are split into")
    ap.add_argument("--clients", type=positive_ints, default="1,8,32,128",
                    help="concurrent client counts for (b), comma-separated (empty: no (b))")
    ap.add_argument("--max-batch-size", type=positive_int, default=16)
    ap.add_argument("--max-wait-ms", type=non_negative_float, default=0.0)
    ap.add_argument("--workers", type=positive_int, default=None, help="batcher worker threads (default: usable CPUs)")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="intra-op threads for (b) and (c) (default: usable CPUs / workers)")
    ap.add_argument("--spin", action="store_true", help="let onnxruntime threads spin in (b) and (c)")
    ap.add_argument("--e2e-runs", type=positive_int, default=40)
    ap.add_argument("--model-batches", type=positive_ints, default="1,4,16,64",
                    help="batch sizes for the batching ceiling (d), comma-separated (empty: no (d))")
    args = ap.parse_args(argv)
    clients, model_batches = args.clients, args.model_batches

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="leaflens-serve-") as tmp:
        tmpdir = Path(tmp)
        standin = args.model is None
        model = build_standin(tmpdir / "standin.onnx") if standin else Path(args.model)
        photo = make_photo(tmpdir / "photo_4000x3000.jpg")
        photo_mb = photo.stat().st_size / 1e6
        cpus = usable_cpus()
        workers = args.workers or cpus
        threads = args.threads or max(1, cpus // workers)
        predictor = Predictor(model, intra_op_threads=threads, allow_spinning=args.spin)
        size = predictor.stored_size  # the arrays carry decoded photos; the Predictor goes to the input size
        images = np.random.default_rng(0).integers(0, 256, (256, size, size, 3), dtype=np.uint8)

        reference = predictor.predict_arrays(images)
        # Sequential candidates: every thread count x spinning; the fastest is the baseline.
        seq_predictors = {(thr, spin): Predictor(model, intra_op_threads=thr, allow_spinning=spin)
                          for thr in sorted({1, cpus}) for spin in (False, True)}
        seq_tallies = {cfg: Tally() for cfg in seq_predictors}
        batch_tallies = {c: Tally() for c in clients}
        ceiling_tallies = {b: Tally() for b in model_batches}
        # Interleaved rounds: a load spike from other processes hits every scenario alike.
        slice_s = args.seconds / args.rounds
        for _ in range(args.rounds):
            for cfg, p in seq_predictors.items():
                bench_sequential(p, images, slice_s, seq_tallies[cfg])
            for c in clients:
                bench_batched(predictor, images, reference, c, slice_s, batch_tallies[c],
                              args.max_batch_size, args.max_wait_ms, workers)
        seq_runs = {cfg: t.summary() for cfg, t in seq_tallies.items()}
        best_cfg = max(seq_runs, key=lambda k: seq_runs[k]["img_s"])
        seq = seq_runs[best_cfg]
        # (d) on the baseline's settings, known only once the rounds above are done
        for _ in range(args.rounds):
            for b in model_batches:
                bench_sequential(seq_predictors[best_cfg], images, slice_s, ceiling_tallies[b], batch=b)
        batched = {c: t.summary() for c, t in batch_tallies.items()}
        ceiling = {b: t.summary() for b, t in ceiling_tallies.items()}
        e2e = bench_e2e(predictor, photo, args.e2e_runs)
        full = bench_e2e_full_decode(predictor, photo, max(3, args.e2e_runs // 8))

    side = predictor.card.input_size
    name = (f"stand-in student ({side}x{side} from {size}x{size} photos, conv 32-64-128, random weights)"
            if standin else str(model))
    print(f"model: {name}; provider {predictor.provider}; {cpus} usable CPUs; 1-min load average "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after (other processes share the CPUs)")
    print(f"batcher: max_batch_size={args.max_batch_size} max_wait_ms={args.max_wait_ms} "
          f"workers={workers} intra_op_threads={threads} spinning={'on' if args.spin else 'off'}")
    print(f"{'scenario':<52}{'img/s':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'batch':>7}{'cores':>7}")
    for (thr, spin), r in seq_runs.items():
        tag = " <- baseline" if (thr, spin) == best_cfg else ""
        label = f"(a) sequential batch-1, {thr} thr, spin {'on' if spin else 'off'}{tag}"
        print(f"{label:<52}{r['img_s']:>9.0f}{r['p50_ms']:>9.2f}{r['p95_ms']:>9.2f}{r['p99_ms']:>9.2f}{1:>7}"
              f"{r['cores_used']:>7.2f}")
    for c, r in batched.items():
        label = f"(b) DynamicBatcher, {c} clients"
        print(f"{label:<52}{r['img_s']:>9.0f}{r['p50_ms']:>9.2f}{r['p95_ms']:>9.2f}{r['p99_ms']:>9.2f}"
              f"{r['mean_batch']:>7.1f}{r['cores_used']:>7.2f}")
    for b, r in ceiling.items():
        label = f"(d) model alone, batch {b}, {best_cfg[0]} thr, spin {'on' if best_cfg[1] else 'off'}"
        print(f"{label:<52}{r['img_s']:>9.0f}{'':>27}{b:>7}{r['cores_used']:>7.2f}")
    print(f"{'':<52}cores = CPU time / wall time of this process ({cpus:.2f} = all usable CPUs)")
    print(f"{f'(c) e2e {photo_mb:.1f} MB 4000x3000 JPEG, draft':<52}{'':>9}{e2e['p50_ms']:>9.2f}"
          f"{e2e['p95_ms']:>9.2f}{e2e['p99_ms']:>9.2f}   (CPU time p50 {e2e['cpu_p50_ms']:.1f} ms)")
    print(f"{'    reference: full-size decode, no draft':<52}{'':>9}{full['p50_ms']:>9.2f}"
          f"{full['p95_ms']:>9.2f}{full['p99_ms']:>9.2f}")
    speedup = batched[32]["img_s"] / seq["img_s"] if 32 in batched else float("nan")
    if 32 in batched:
        ok = speedup >= 1.5 and batched[32]["p99_ms"] < 50
        print(f"targets: batched@32 {speedup:.2f}x sequential (>= 1.5x) with p99 "
              f"{batched[32]['p99_ms']:.1f} ms "
              f"(< 50 ms): {'met' if ok else 'NOT met'}; e2e p50 {e2e['p50_ms']:.1f} ms (< 40 ms): "
              f"{'met' if e2e['p50_ms'] < 40 else 'NOT met'}")

    ceiling_x = (max(r["img_s"] for r in ceiling.values()) / ceiling[1]["img_s"]
                 if ceiling and 1 in ceiling else float("nan"))
    if ceiling:
        print(f"batching ceiling: the model alone runs at most {ceiling_x:.2f}x faster per image in batches than "
              f"one at a time on this machine, which bounds what any batcher can gain over (a)")
    got = max(r["cores_used"] for r in batched.values()) if batched else float(cpus)
    if got < 0.8 * cpus:
        print(f"WARNING: other processes shared the CPUs: the batcher got at most {got:.2f} of {cpus} cores, "
              "so these are not the figures of an idle machine (see img_per_cpu_s in the JSON)")

    figures: dict[str, object] = {
        "model": "standin" if standin else str(model), "provider": predictor.provider, "cpus": cpus,
        "intra_op_threads": threads, "workers": workers, "spinning": args.spin,
        "max_batch_size": args.max_batch_size, "max_wait_ms": args.max_wait_ms,
        "seq_img_s": round(seq["img_s"], 1),
        "seq_p50_ms": round(seq["p50_ms"], 3), "seq_p99_ms": round(seq["p99_ms"], 3),
        "seq_baseline_threads": best_cfg[0], "seq_baseline_spinning": best_cfg[1],
    }
    for c, r in batched.items():
        figures[f"batched_img_s_{c}"] = round(r["img_s"], 1)
        for k in ("p50_ms", "p95_ms", "p99_ms"):
            figures[f"batched_{k}_{c}"] = round(r[k], 3)
        figures[f"batched_mean_batch_{c}"] = round(r["mean_batch"], 2)
    figures["speedup_32"] = round(speedup, 3) if speedup == speedup else None  # no 32-client run: null, not NaN
    figures["seq_cores_used"] = round(seq["cores_used"], 2)
    # Images per CPU-second: how efficiently the CPU time obtained was used (load-independent).
    figures["seq_img_per_cpu_s"] = round(seq["img_s"] / seq["cores_used"], 1)
    figures.update({f"batched_img_per_cpu_s_{c}": round(r["img_s"] / r["cores_used"], 1)
                    for c, r in batched.items()})
    figures.update({f"batched_cores_used_{c}": round(r["cores_used"], 2) for c, r in batched.items()})
    figures.update({f"e2e_{k}": round(v, 3) for k, v in e2e.items()})
    figures["e2e_full_decode_p50_ms"] = round(full["p50_ms"], 3)
    figures["photo_mb"] = round(photo_mb, 2)
    figures.update({f"model_img_s_b{b}": round(r["img_s"], 1) for b, r in ceiling.items()})
    figures["batching_ceiling"] = round(ceiling_x, 3) if ceiling_x == ceiling_x else None
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ModelError, OSError) as exc:  # a missing or unreadable model or folder: one line, no traceback
        sys.exit(f"serve.py: {exc}")
