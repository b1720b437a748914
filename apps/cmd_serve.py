"""`leaflens serve`: the local web app (Gradio) over an exported model.

    leaflens serve --model artifacts/export/student.onnx [--run artifacts/student]
                   [--classes-notes FILE] [--host 127.0.0.1] [--port 7860] [--share]
                   [--lang en|zh] [--max-upload-mb 20]
                   [--uploads-dir DIR] [--keep-uploads-minutes 0] [--uploads-max-mb 1024]
                   [--corrections artifacts/corrections [--corrections-max-mb 500] | --no-corrections]

Binds 127.0.0.1 unless ``--host`` says otherwise; ``--share`` (a public Gradio link) is off unless
asked. The run folder, dataset (for example photos) and class notes are found from the export's own
records when not given (see leaflens.apps.model_info). One log line per request gives the server-side
latency. Exit code 2 on a usage or model error.

Uploaded photos go to a folder of the server's own (``GRADIO_TEMP_DIR`` is set to ``--uploads-dir``, by
default ``<system temp>/leaflens-uploads-<port>``) and are deleted once answered, after
``--keep-uploads-minutes`` (default 30 with corrections on, else 0: within half a minute); see leaflens.apps.uploads.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import sys
import tempfile
from pathlib import Path

from leaflens.apps.model_arg import add_model_argument, missing_model
from leaflens.apps.providers import add_provider_argument, requested_providers, unmet_request
from leaflens.extras import install_command

__all__ = ["add_parser", "build", "prepare", "run"]

log = logging.getLogger("leaflens.serve")



# How long an answered photo stays by default while corrections are on (a person reads the answer, then may
# press 'Wrong?'); with --no-corrections it goes within half a minute.
CORRECTION_WINDOW_MINUTES = 30.0

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="start the local web app",
        description="Start the leaflens web page: drop leaf photos, get ranked diagnoses (English/中文). "
                    "Also an API endpoint /diagnose for gradio_client scripts.",
    )
    add_model_argument(p)
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
    p.add_argument("--lang", choices=["en", "zh"], default="en",
                   help="interface language when the page's address (?lang=), the browser's remembered choice and "
                        "its own language name neither English nor Chinese (default en)")
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
    p.add_argument("--uploads-dir", default=None, metavar="DIR",
                   help="where uploaded photos are kept until they are deleted (default: "
                        "<system temp>/leaflens-uploads-<port>; a new or empty folder, or one leaflens made)")
    p.add_argument("--keep-uploads-minutes", type=float, default=None, metavar="N",
                   help="keep each uploaded photo N minutes after its answer (default: 30 while corrections are "
                        "on, so 'Wrong?' can still save the photo; 0 with --no-corrections: deleted within half "
                        "a minute, the time the page needs to show it)")
    p.add_argument("--uploads-max-mb", type=float, default=1024.0,
                   help="cap on the upload folder: beyond it the oldest photos are deleted first (default 1024)")
    p.add_argument("--corrections", default="artifacts/corrections", metavar="DIR",
                   help="where 'Wrong? The right answer is ...' saves the corrected photos, in class folders "
                        "`leaflens preprocess --also DIR` reads, with corrections.jsonl (default %(default)s; "
                        "created on the first correction; a folder holding other files is refused)")
    p.add_argument("--corrections-max-mb", type=float, default=500.0,
                   help="cap on the corrections folder; when full the page says so and saves nothing "
                        "(default %(default)s)")
    p.add_argument("--no-corrections", action="store_true",
                   help="no correction control on the page and no /correct API endpoint")
    p.set_defaults(func=run)
    return p


class UsageError(ValueError):
    """A command-line value that cannot work."""


def _check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise UsageError(f"--port must be 1..65535, got {port}")


def _check(args: argparse.Namespace) -> None:
    _check_port(args.port)
    for name in ("max_upload_mb", "max_wait_ms", "keep_uploads_minutes", "uploads_max_mb", "corrections_max_mb"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):  # nan passes every comparison; inf breaks timers
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for name in ("uploads_dir", "corrections", "examples_cache"):
        value = getattr(args, name)
        if value is not None and not str(value).strip():  # an unset shell variable: not the current folder
            raise UsageError(f"--{name.replace('_', '-')} is empty; give a folder")
    for name in ("max_upload_mb", "max_photos", "top_k", "queue_size", "max_batch_size"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.max_wait_ms < 0:
        raise UsageError(f"--max-wait-ms must be >= 0, got {args.max_wait_ms}")
    if args.keep_uploads_minutes is None:  # a correction needs the photo: keep it while a person may still use it
        args.keep_uploads_minutes = 0.0 if args.no_corrections else CORRECTION_WINDOW_MINUTES
    if not args.keep_uploads_minutes >= 0:
        raise UsageError(f"--keep-uploads-minutes must be >= 0, got {args.keep_uploads_minutes}")
    if not args.uploads_max_mb > 0:
        raise UsageError(f"--uploads-max-mb must be > 0, got {args.uploads_max_mb}")
    if not args.corrections_max_mb >= 0.001:  # under a kilobyte no photo fits and the sizes read as 0.000 KB
        raise UsageError(f"--corrections-max-mb must be at least 0.001 (a kilobyte), got {args.corrections_max_mb}")
    if not args.no_corrections:
        _check_corrections_folder(args)
    if (missing := missing_model(args.model)) is not None:
        raise UsageError(missing)


def check_listen(host: str, port: int) -> bool:
    """Refuse, before anything is prepared, an address this server cannot listen on (one line naming the
    option: unknown host, IPv6, port taken); returns whether only this computer can reach it (loopback)."""
    import errno
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"--host {host}: not an address or name this computer knows ({exc}); use 127.0.0.1 "
                         "(this computer only) or 0.0.0.0 (every network it is on)") from None
    family, _, _, _, address = infos[0]
    if family != socket.AF_INET:  # Gradio builds its own URL from the host and fails on an IPv6 one
        raise UsageError(f"--host {host}: IPv6 addresses cannot be served (the web framework cannot); use "
                         "127.0.0.1 (this computer only) or 0.0.0.0")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if os.name != "nt":  # as the web server binds: connections of a stopped server still closing (TIME_WAIT)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # do not hold the port; a listener does
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"--port {port}: already in use on {host} (another server?); give another "
                                 "--port, or stop the program that uses it") from None
            raise UsageError(f"--host {host}: cannot listen there ({exc.strerror or exc}); use 127.0.0.1 or "
                             "an address of this computer") from None
    return ipaddress.ip_address(address[0]).is_loopback


def _check_corrections_folder(args: argparse.Namespace) -> None:
    """The corrections folder must be one this server can create and write, apart from the upload folder
    (uploads inside it would become a class folder of the next `leaflens preprocess --also`)."""
    from leaflens.apps.corrections import LOCK_NAME, LOG_NAME  # noqa: PLC0415

    folder = Path(args.corrections)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--corrections {folder}: exists and is not a folder")
    # photos saved into someone else's folder (the training photos themselves, say) would skip the rules that
    # `preprocess --also` keeps for corrections: a folder no server started (no log, and no lock: a first save
    # that failed leaves a class folder and the lock only) is refused, as --out folders are
    try:  # a folder that cannot be entered raises here too (exists() included)
        started = not folder.is_dir() or (folder / LOG_NAME).exists() or (folder / LOCK_NAME).exists()
        others = [] if started else [n for n in os.listdir(folder) if not n.startswith(".")]
    except OSError as exc:
        raise UsageError(f"--corrections {folder}: cannot be read ({exc.strerror or exc}); give another folder, "
                         "or --no-corrections") from None
    if others:
        raise UsageError(f"--corrections {folder}: not empty and not a corrections folder (no {LOG_NAME} in it); "
                         "give a new or empty folder (the server makes its class folders and the log itself)")
    here = folder
    while not here.exists() and here != here.parent:
        here = here.parent
    try:  # a real try, as root passes os.access() where mkdir fails (/proc); nothing is left behind
        os.rmdir(tempfile.mkdtemp(prefix=".leaflens-probe-", dir=here))
    except OSError as exc:
        raise UsageError(f"--corrections {folder}: cannot be created or written ({here}: {exc.strerror or exc}); "
                         "give another folder, or --no-corrections") from None
    if args.uploads_dir is not None:
        a, b = Path(os.path.abspath(args.uploads_dir)), Path(os.path.abspath(folder))
        if a == b or b in a.parents or a in b.parents:
            raise UsageError(f"--uploads-dir {args.uploads_dir} and --corrections {folder} overlap; give them "
                             "separate folders (uploads in the corrections folder would become a class of the "
                             "next training run)")


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
    choice = getattr(args, "provider", "auto")
    predictor = Predictor(args.model, intra_op_threads=args.threads, providers=requested_providers(choice))
    if (unmet := unmet_request(choice, predictor.provider, predictor.provider_line)) is not None:
        raise UsageError(unmet)
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
    service = DiagnosisService(predictor, notes, options, uploads=upload_folder(args))
    gradio_limits()
    concurrency = args.concurrency or max(4, 2 * usable_cpus())
    corrections = None
    if not args.no_corrections:
        from leaflens.apps.corrections import CorrectionStore

        corrections = CorrectionStore(args.corrections, predictor.classes, model_path=args.model,
                                      run_id=predictor.card.run_id, max_mb=args.corrections_max_mb)
    config = AppConfig(context=ctx, examples=examples, lang=args.lang, concurrency=concurrency,
                       queue_size=args.queue_size, corrections=corrections)
    return service, config


def upload_folder(args: argparse.Namespace):
    """The server's own upload folder, ready (leftovers of an earlier server deleted), with ``GRADIO_TEMP_DIR``
    pointing at it for the Gradio app built next. Raises UsageError naming the folder."""
    from leaflens.apps.uploads import UploadFolder, UploadFolderError, UploadFolderInUse, UploadPolicy, default_folder

    policy = UploadPolicy(keep_s=60.0 * args.keep_uploads_minutes, max_mb=args.uploads_max_mb)
    uploads = UploadFolder(args.uploads_dir or default_folder(args.port), policy)
    try:
        uploads.prepare()
    except UploadFolderInUse as exc:
        if args.uploads_dir is not None:
            raise UsageError(f"--uploads-dir: {exc}") from exc
        # the default folder of this port is another running process's (a server or a test on the same port)
        uploads = UploadFolder(tempfile.mkdtemp(prefix=f"{default_folder(args.port).name}-"), policy,
                               made_for_it=True)  # removed again when the server stops
        uploads.prepare()
    except UploadFolderError as exc:
        raise UsageError(f"--uploads-dir: {exc}") from exc
    if os.environ.get("GRADIO_TEMP_DIR") not in (None, str(uploads.root)):
        log.info("GRADIO_TEMP_DIR %s is replaced by the upload folder %s", os.environ["GRADIO_TEMP_DIR"], uploads.root)
    os.environ["GRADIO_TEMP_DIR"] = str(uploads.root)
    return uploads


def gradio_limits() -> None:
    """Gradio settings a long-running server needs, unless the environment sets them: Gradio 6 keeps the
    last 10,000 events for its monitoring page and, after every event, summarises all of them in a pandas
    table (7 ms of CPU at 10,000 on one core, and 5 MB): 1,000 events, summarised every 1,000."""
    os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", "1000")
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "1000")


def sweep_uploads(service, demo) -> None:
    """Start deleting answered uploads (the files the page was just built with stay). A deleted file also
    leaves Gradio's own lists of the files it wrote, which would otherwise grow by a path per upload."""
    from leaflens.apps.web_uploads import no_empty_temp_files

    uploads = service.uploads
    if uploads is None:
        return
    no_empty_temp_files(demo)  # Gradio 6.31 would leave an empty temporary file per photo
    sets = getattr(demo, "temp_file_sets", None)  # Gradio 6: [upload_file_set, each block's temp_files]
    if isinstance(sets, list):
        def forget(path: str) -> None:
            for s in sets:
                s.discard(path)

        uploads.on_delete = forget
    uploads.start()
    pol = uploads.policy
    log.info("uploads: %s, deleted %s after their answer, never-diagnosed ones after %g min, capped at %g MB",
             uploads.root, f"{pol.after_answer_s / 60:g} min" if pol.keep_s > pol.grace_s else
             f"{pol.grace_s:g} s", max(pol.unanswered_s, pol.keep_s) / 60, pol.max_mb)


def build(args: argparse.Namespace):
    """(service, demo, config): :func:`prepare`, then the Gradio app (not yet launched), its uploads swept."""
    service, config = prepare(args)
    return service, _app(service, config), config


def _app(service, config):
    """The Gradio app over a prepared service, its uploads swept; the service is closed if the app fails."""
    from leaflens.apps.web import build_app

    try:
        demo = build_app(service, config)
    except BaseException:
        service.close()
        raise
    sweep_uploads(service, demo)
    return demo


def run(args: argparse.Namespace) -> int:
    prog = "leaflens serve"
    if not logging.getLogger("leaflens").handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger("leaflens").addHandler(handler)
        logging.getLogger("leaflens").setLevel(logging.INFO)
    if importlib.util.find_spec("gradio") is None:
        print(f"{prog}: error: gradio is not installed; {install_command('serve')}", file=sys.stderr)
        return 2
    from leaflens.apps.model_card import ModelError
    from leaflens.apps.notes import NotesError

    try:
        _check_port(args.port)  # before the address is resolved with it (a bad port read as a bad --host)
        local = check_listen(args.host, args.port)
        service, config = prepare(args)
    except (UsageError, ModelError, NotesError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from leaflens.apps.web import launch

    demo = _app(service, config)
    from leaflens.pipeline.cli.runtime import stop_on_sigterm

    stop_on_sigterm()  # the service closes and the upload folder is emptied
    p = service.predictor
    log.info("%s", p.provider_line)
    log.info("model %s: %d classes, %dx%d input; notes: %s; examples: %d; run: %s",
             p.model_path, len(p.classes), p.card.input_size, p.card.input_size,
             service.notes.source or "none", len(config.examples), config.context.run_dir or "none")
    if not local:
        log.warning("listening on %s: other computers on the network can use this app", args.host)
    try:
        # quiet: Gradio's own lines say "set share=True in launch()", code a command-line user cannot edit
        launch(demo, service, config, host=args.host, port=args.port, share=args.share, block=False, quiet=True)
        print(f"Running on {demo.local_url} (Ctrl-C stops the server)"
              + (f"; public link: {demo.share_url}" if args.share and demo.share_url else
                 "" if args.share else "; --share for a temporary public link"), flush=True)
        demo.block_thread()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before Gradio's own wait could take it: a normal stop
        demo.close()
    except OSError as exc:  # taken in the moment since check_listen, or an address Gradio cannot use
        print(f"{prog}: error: cannot listen on {args.host}:{args.port} ({str(exc).split('. ')[0]}); give "
              "another --port, or stop the program that uses it", file=sys.stderr)
        return 2
    finally:
        service.close()
    return 0
