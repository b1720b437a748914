"""`leaflens serve`: the local web app (Gradio) over an exported model.

    leaflens serve --model artifacts/export/student.onnx [--run artifacts/student]
                   [--classes-notes FILE] [--host 127.0.0.1] [--port 7860] [--share]
                   [--lang en|zh] [--max-upload-mb 20]

Binds 127.0.0.1 unless ``--host`` says otherwise; ``--share`` (a public Gradio link) is off unless
asked. The run folder, dataset (for example photos) and class notes are found from the export's own
records when not given (see leaflens.apps.model_info). One log line per request gives the server-side
latency. Exit code 2 on a usage or model error.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys

from leaflens.apps.providers import add_provider_argument, requested_providers

__all__ = ["add_parser", "build", "prepare", "run"]

log = logging.getLogger("leaflens.serve")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="start the local web app",
        description="Start the leaflens web page: drop leaf photos, get ranked diagnoses (English/中文). "
                    "Also an API endpoint /diagnose for gradio_client scripts.",
    )
    p.add_argument("--model", default="artifacts/export/student.onnx",
                   help="exported model (.onnx with leaflens metadata; default %(default)s)")
    p.add_argument("--run", default=None,
                   help="training run folder (report.json, curves.png, confusion.png) for the Model tab; "
                        "default: the run named in the export's parity.json")
    p.add_argument("--dataset", default=None,
                   help="dataset folder the model was trained on, for example photos and class notes; "
                        "default: the one named in the export's or run's report")
    p.add_argument("--classes-notes", default=None,
                   help="classes.toml or .json with display names, descriptions, advice (en/zh); default: "
                        "classes.toml/json next to the model, in the run or in the dataset folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this computer only)")
    p.add_argument("--port", type=int, default=7860, help="port (default %(default)s)")
    p.add_argument("--share", action="store_true", help="also create a public gradio.live link (off by default)")
    p.add_argument("--lang", choices=["en", "zh"], default="en", help="interface language at start (default en)")
    p.add_argument("--max-upload-mb", type=float, default=20.0, help="largest photo accepted, in MB (default 20)")
    p.add_argument("--max-photos", type=int, default=16, help="most photos judged together (default 16)")
    p.add_argument("--top-k", type=int, default=3, help="classes shown per answer (default 3)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests handled at once (default: 2 x usable CPUs, at least 4)")
    p.add_argument("--queue-size", type=int, default=64, help="requests waiting beyond that (default 64)")
    p.add_argument("--max-batch-size", type=int, default=32, help="photos per model call (default 32)")
    p.add_argument("--max-wait-ms", type=float, default=2.0,
                   help="how long a photo may wait for others to share its model call (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="onnxruntime intra-op threads (default: the CPUs this process may use)")
    add_provider_argument(p)
    p.add_argument("--no-examples", action="store_true", help="do not show example photos")
    p.add_argument("--examples-cache", default=None,
                   help="folder for the example PNGs (default ~/.cache/leaflens/examples)")
    p.set_defaults(func=run)
    return p


class UsageError(ValueError):
    """A command-line value that cannot work."""


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be 1..65535, got {args.port}")
    for name in ("max_upload_mb", "max_photos", "top_k", "queue_size", "max_batch_size"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.max_wait_ms < 0:
        raise UsageError(f"--max-wait-ms must be >= 0, got {args.max_wait_ms}")


def prepare(args: argparse.Namespace):
    """(service, config) from parsed arguments, without importing Gradio.

    Raises UsageError, ModelError, NotesError or FileNotFoundError with a message naming the
    option or file.
    """
    from leaflens.apps.examples import default_cache_dir, write_examples
    from leaflens.apps.model_info import discover
    from leaflens.apps.notes import ClassNotes, load_notes
    from leaflens.apps.predictor import Predictor
    from leaflens.apps.service import DiagnosisService, ServiceOptions
    from leaflens.apps.web_config import AppConfig
    from leaflens.cpus import usable_cpus

    _check(args)
    predictor = Predictor(args.model, intra_op_threads=args.threads,
                          providers=requested_providers(getattr(args, "provider", "auto")))
    ctx = discover(args.model, args.run, args.dataset, args.classes_notes)
    notes = load_notes(ctx.notes_path) if ctx.notes_path is not None else ClassNotes()
    for warning in ctx.warnings:
        log.warning("%s", warning)
    unknown = notes.unknown_classes(predictor.classes)
    if unknown:
        log.warning("class notes %s describe classes the model does not have: %s", notes.source, unknown)
    examples = []
    if not args.no_examples and ctx.dataset_root is not None:
        examples = write_examples(ctx.dataset_root, args.examples_cache or default_cache_dir(), predictor.classes)
    options = ServiceOptions(max_upload_mb=args.max_upload_mb, max_photos=args.max_photos, top_k=args.top_k,
                             max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms)
    service = DiagnosisService(predictor, notes, options)
    concurrency = args.concurrency or max(4, 2 * usable_cpus())
    config = AppConfig(context=ctx, examples=examples, lang=args.lang, concurrency=concurrency,
                       queue_size=args.queue_size)
    return service, config


def build(args: argparse.Namespace):
    """(service, demo, config): :func:`prepare`, then the Gradio app (not yet launched)."""
    from leaflens.apps.web import build_app

    service, config = prepare(args)
    try:
        return service, build_app(service, config), config
    except BaseException:
        service.close()
        raise


def run(args: argparse.Namespace) -> int:
    prog = "leaflens serve"
    if not logging.getLogger("leaflens").handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger("leaflens").addHandler(handler)
        logging.getLogger("leaflens").setLevel(logging.INFO)
    if importlib.util.find_spec("gradio") is None:
        print(f"{prog}: error: gradio is not installed; pip install 'leaflens[serve-cpu]'", file=sys.stderr)
        return 2
    from leaflens.apps.model_card import ModelError
    from leaflens.apps.notes import NotesError

    try:
        service, config = prepare(args)
    except (UsageError, ModelError, NotesError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from leaflens.apps.web import build_app, launch

    try:
        demo = build_app(service, config)
    except BaseException:
        service.close()
        raise
    p = service.predictor
    log.info("%s", p.provider_line)
    log.info("model %s: %d classes, %dx%d input; notes: %s; examples: %d; run: %s",
             p.model_path, len(p.classes), p.card.input_size, p.card.input_size,
             service.notes.source or "none", len(config.examples), config.context.run_dir or "none")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: other computers on the network can use this app", args.host)
    try:
        launch(demo, service, config, host=args.host, port=args.port, share=args.share, block=True)
    except OSError as exc:  # port in use, address not available
        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    finally:
        service.close()
    return 0
