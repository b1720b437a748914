"""Web app latency for one phone photo (4000x3000 JPEG): server side, with references side by side.

What is timed, each method run in interleaved rounds (so a burst of load on a shared machine hits
all of them alike) and summarised by its median and 95th percentile:

- ``server``: ``DiagnosisService.diagnose([photo])``, the function behind the app's /diagnose
  endpoint: size check, JPEG draft decode, dynamic batcher, model, answer JSON. This is the
  ``server_ms`` the app logs for every request, and the figure with the 60 ms target;
- ``direct``: ``Predictor.predict_image(photo)`` (same decode and model, no batcher, no service);
- ``no draft``: full-size decode of the JPEG, then the same resize and model (what decoding costs
  without the JPEG DCT scaling the app uses);
- ``decode`` and ``model``: the two parts of ``direct`` alone;
- ``http``: the whole round trip through the running Gradio app with ``gradio_client`` (upload of
  the file, queue, JSON back) from this same machine; ``--no-http`` skips it.

Without ``--model`` a stand-in of the student's shape (4 conv blocks 32-64-128-256, 64x64 input,
8 classes, random weights) is built, so the figures hold for the real model's amount of work.
Prints a table, then one JSON line with the figures as the last line of output.

    python benchmarks/app_latency.py [--model artifacts/export/student.onnx] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402  (benchmarks/ is not a package)

from leaflens.apps.model_card import ModelError  # noqa: E402
from leaflens.apps.predictor import Predictor  # noqa: E402
from leaflens.apps.service import DiagnosisService  # noqa: E402
from leaflens.cpus import usable_cpus  # noqa: E402
from leaflens.data_prep.decode import RESAMPLE  # noqa: E402

TARGET_MS = 60.0


def build_standin(path: Path, size: int = 64, widths: tuple[int, ...] = (32, 64, 128, 256),
                  num_classes: int = 8, seed: int = 0) -> Path:
    """ONNX model of the student's shape (conv3x3+ReLU+maxpool2 blocks, GAP, Gemm), leaflens metadata."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes, prev, cin = [], [], "input", 3
    for i, w in enumerate(widths):
        weight = rng.normal(0, np.sqrt(2.0 / (9 * cin)), (w, cin, 3, 3)).astype(np.float32)
        inits += [numpy_helper.from_array(weight, f"w{i}"), numpy_helper.from_array(np.zeros(w, np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
                  helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2])]
        prev, cin = f"p{i}", w
    inits += [numpy_helper.from_array(rng.normal(0, 0.05, (num_classes, cin)).astype(np.float32), "fc_w"),
              numpy_helper.from_array(np.zeros(num_classes, np.float32), "fc_b")]
    nodes += [helper.make_node("GlobalAveragePool", [prev], ["g"]),
              helper.make_node("Flatten", ["g"], ["f"], axis=1),
              helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1)]
    graph = helper.make_graph(
        nodes, "standin_student",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", num_classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {
        "leaflens.format": "1", "leaflens.classes": json.dumps([f"class_{i}" for i in range(num_classes)]),
        "leaflens.input_size": str(size), "leaflens.mean": "[0.5, 0.5, 0.5]", "leaflens.std": "[0.25, 0.25, 0.25]",
        "leaflens.layout": "NCHW", "leaflens.resize": "crop"})
    onnx.save(model, str(path))
    return path


def phone_photo(path: Path, size: tuple[int, int] = (4000, 3000), seed: int = 0) -> Path:
    """A 4000x3000 JPEG with the texture of a phone photo (gradient, shapes, blur, sensor noise)."""
    rng = np.random.default_rng(seed)
    w, h = size
    small = Image.new("RGB", (w // 8, h // 8))
    draw = ImageDraw.Draw(small)
    for y in range(h // 8):
        draw.line([(0, y), (w // 8, y)], fill=(40 + y * 80 // (h // 8), 110, 60))
    for _ in range(60):
        x, y, r = rng.integers(0, w // 8), rng.integers(0, h // 8), rng.integers(5, 60)
        draw.ellipse([x - r, y - r // 2, x + r, y + r // 2], fill=tuple(int(v) for v in rng.integers(20, 230, 3)))
    big = np.asarray(small.resize(size, Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(2)), np.int16)
    noisy = np.clip(big + rng.normal(0, 6, big.shape), 0, 255).astype(np.uint8)
    Image.fromarray(noisy).save(path, quality=90)
    return path


def no_draft_predict(predictor: Predictor, path: Path) -> np.ndarray:
    """Full-size decode (no JPEG draft), same centre crop and area resize, same model."""
    s = predictor.stored_size
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        side = min(w, h)
        box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
        pixels = np.asarray(im.resize((s, s), RESAMPLE, box=box))
    return predictor.predict_arrays(pixels[None])


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="exported model (default: a stand-in of the student's shape)")
    ap.add_argument("--repeats", type=positive_int, default=30, help="timed rounds per method (default 30)")
    ap.add_argument("--no-http", action="store_true", help="skip the round trip through a running Gradio app")
    args = ap.parse_args(argv)
    logging.getLogger("leaflens").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="leaflens-app-bench-") as tmp_s:
        tmp = Path(tmp_s)
        os.environ["GRADIO_TEMP_DIR"] = str(tmp / "gradio")  # Gradio's upload cache goes with the folder
        model = Path(args.model) if args.model else build_standin(tmp / "standin.onnx")
        photo = phone_photo(tmp / "phone_4000x3000.jpg")
        predictor = Predictor(model)
        service = DiagnosisService(predictor)
        one = predictor.decode(photo)[None]
        methods = {
            "server": lambda: service.diagnose([photo]),
            "direct": lambda: predictor.predict_image(photo),
            "no draft": lambda: no_draft_predict(predictor, photo),
            "decode": lambda: predictor.decode(photo),
            "model": lambda: predictor.predict_arrays(one),
        }
        demo = client = None
        if not args.no_http:
            from gradio_client import Client, handle_file

            from leaflens.apps.screenshot import free_port
            from leaflens.apps.web import build_app, launch
            from leaflens.apps.web_config import AppConfig

            port = free_port()
            config = AppConfig()
            demo = build_app(service, config)
            launch(demo, service, config, port=port, block=False, quiet=True)
            client = Client(f"http://127.0.0.1:{port}/", verbose=False)
            methods["http"] = lambda: client.predict([handle_file(str(photo))], api_name="/diagnose")
        try:
            for fn in methods.values():  # warm up: first runs pay for allocations and thread start
                for _ in range(3):
                    fn()
            times: dict[str, list[float]] = {k: [] for k in methods}
            load_before = os.getloadavg()[0]
            for _ in range(args.repeats):
                for name, fn in methods.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1000.0)
            load_after = os.getloadavg()[0]
            server_logged = service.diagnose([photo])["server_ms"]
        finally:
            if demo is not None:
                demo.close()
            service.close()

        with Image.open(photo) as im:
            photo_size = im.size
        photo_bytes = photo.stat().st_size
        print(f"Latency per photo: {photo_size[0]}x{photo_size[1]} JPEG ({photo_bytes / 1e6:.1f} MB), model "
              f"{model.name} ({predictor.card.input_size}x{predictor.card.input_size} input) on "
              f"{predictor.provider}, {predictor.intra_op_threads} onnxruntime threads, {usable_cpus()} usable CPUs, "
              f"{args.repeats} interleaved rounds, load average {load_before:.1f} -> {load_after:.1f}")
        print(f"{'method':<10} {'p50 ms':>8} {'p95 ms':>8} {'min ms':>8}  what")
        what = {"server": "app /diagnose function (the logged server_ms): checks, draft decode, batcher, model",
                "direct": "Predictor.predict_image: same decode and model, no service or batcher",
                "no draft": "reference: full 12 MP decode, then the same resize and model",
                "decode": "draft decode + crop + resize only", "model": "onnxruntime on one 64x64 image only",
                "http": "gradio_client round trip: upload, queue, JSON back (same machine)"}
        for name, values in times.items():
            print(f"{name:<10} {percentile(values, 50):8.1f} {percentile(values, 95):8.1f} {min(values):8.1f}  "
                  f"{what[name]}")
        p50 = percentile(times["server"], 50)
        print(f"server p50 {p50:.1f} ms vs target {TARGET_MS:.0f} ms: {'met' if p50 < TARGET_MS else 'NOT met'}; "
              f"JPEG draft decoding saves {percentile(times['no draft'], 50) - percentile(times['direct'], 50):.0f} "
              f"ms per photo")
        figures = {
            "photo": {"width": photo_size[0], "height": photo_size[1], "bytes": photo_bytes},
            "model": model.name, "input_size": predictor.card.input_size, "provider": predictor.provider,
            "repeats": args.repeats, "usable_cpus": usable_cpus(),
            "load_average": [round(load_before, 2), round(load_after, 2)],
            **{f"{name.replace(' ', '_')}_p50_ms": round(percentile(v, 50), 2) for name, v in times.items()},
            **{f"{name.replace(' ', '_')}_p95_ms": round(percentile(v, 95), 2) for name, v in times.items()},
            "server_logged_ms_last": server_logged, "target_ms": TARGET_MS, "meets_target": p50 < TARGET_MS,
        }
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ModelError, OSError) as exc:  # a missing or unreadable model or folder: one line, no traceback
        sys.exit(f"app_latency.py: {exc}")
