"""The web app's engine room: uploaded files in, the JSON answer of :func:`leaflens.apps.diagnosis.summarise` out.

:class:`DiagnosisService` owns one :class:`~leaflens.apps.predictor.Predictor` and one
:class:`~leaflens.apps.batcher.DynamicBatcher` whose ``run_batch`` is :meth:`Predictor.score_arrays`
(probabilities and out-of-domain score per photo). Gradio runs each request in its own thread (up to the
event's concurrency limit); every request decodes its photos (in parallel when there are several,
Pillow releases the GIL) and submits each decoded photo to the shared batcher, so photos from
concurrent requests meet in one model call. Each photo's verdict is the Predictor's own
(:meth:`Predictor.judge` on its row): the page, the API and `leaflens predict` cannot disagree about it.
Nothing here imports Gradio, so the same object serves the page, the API, tests and the latency benchmark.

Every file either gets the model's answer or a reason it has none: refused before the model (too small,
one flat colour, too blurred: leaflens.data_prep.quality) or not usable at all (too big, not an image,
truncated, HEIC without pillow-heif, server busy, ...); an unexpected exception is logged with its
traceback and becomes the reason "internal" for that file only. One log line per request records the
verdicts and the server-side latency (``leaflens.serve`` logger).

With an :class:`~leaflens.apps.uploads.UploadFolder` (`leaflens serve` always gives one), the files of a
request that lie in that folder are held while it reads them and handed to the folder once answered, which
deletes them after the retention; a photo of that folder that is already gone gets the reason "gone" (send
it again), not "unreadable".
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from leaflens.apps.answered import AnsweredPhotos
from leaflens.apps.batcher import BatcherBusy, BatcherClosed, DynamicBatcher
from leaflens.apps.diagnosis import REFUSAL_REASONS, PhotoOutcome, photo_names, summarise
from leaflens.apps.notes import ClassNotes
from leaflens.apps.predictor import Predictor
from leaflens.apps.uploads import UploadFolder
from leaflens.cpus import usable_cpus
from leaflens.data_prep.arrays import sha256_file
from leaflens.data_prep.decode import ImageDecodeError
from leaflens.data_prep.quality import PhotoRefused

__all__ = ["MB", "DiagnosisService", "ServiceOptions"]

MB = 1024 * 1024
log = logging.getLogger("leaflens.serve")


@dataclass(frozen=True)
class ServiceOptions:
    """Limits and batching of the service (the CLI exposes the ones people tune)."""

    max_upload_mb: float = 20.0  # per file; Gradio enforces it at upload too
    max_photos: int = 16  # per request; more are ignored with a message
    top_k: int = 3
    max_batch_size: int = 32
    max_wait_ms: float = 2.0  # how long a photo may wait for others to share its model call
    batch_workers: int = 1
    max_queue: int = 256  # decoded photos waiting for the model; beyond it: "busy"
    request_timeout_s: float = 30.0
    decode_workers: int | None = None  # default: the CPUs this process may use


class DiagnosisService:
    """Diagnose uploaded photo files with a model behind a dynamic batcher (thread-safe)."""

    def __init__(self, predictor: Predictor, notes: ClassNotes | None = None,
                 options: ServiceOptions | None = None, uploads: UploadFolder | None = None) -> None:
        self.predictor = predictor
        self.uploads = uploads  # None: the caller's files are left alone (tests, `leaflens predict`)
        self.notes = notes or ClassNotes()
        self.options = opts = options or ServiceOptions()
        if opts.max_upload_mb <= 0 or opts.max_photos < 1 or opts.top_k < 1:
            raise ValueError(f"need max_upload_mb > 0, max_photos >= 1 and top_k >= 1, got {opts}")
        self.max_upload_bytes = int(opts.max_upload_mb * MB)
        self.batcher = DynamicBatcher(predictor.score_arrays, max_batch_size=opts.max_batch_size,
                                      max_wait_ms=opts.max_wait_ms, max_queue=opts.max_queue,
                                      timeout_s=opts.request_timeout_s, num_workers=opts.batch_workers,
                                      name="leaflens-serve")
        self._pool = ThreadPoolExecutor(opts.decode_workers or usable_cpus(), thread_name_prefix="leaflens-decode")
        self.answered = AnsweredPhotos()  # what a correction is checked against (leaflens.apps.answered)

    # ----------------------------------------------------------------------------- one file
    def _start(self, path: str, name: str) -> tuple[str | None, PhotoOutcome | Future]:
        """Hash, check and decode one file, then hand it to the batcher: the bytes' ``sha256:<hex>`` (None
        when unread) and a future, or a failed outcome (``refused`` for a photo the quality checks turned
        away, else ``error``)."""
        digest = None
        try:
            if os.path.getsize(path) <= self.max_upload_bytes:
                digest = sha256_file(path)
        except OSError:
            pass  # _decode meets the same failure and names it
        return digest, self._decode(path, name)

    def _decode(self, path: str, name: str) -> PhotoOutcome | Future:
        try:
            size = os.path.getsize(path)
            if size > self.max_upload_bytes:
                return PhotoOutcome(name, reason="file_too_big", detail=f"{size} bytes",
                                    values={"size": round(size / MB, 1), "limit": self.options.max_upload_mb})
            pixels = self.predictor.decode(path)
            return self.batcher.submit(pixels)
        except ImageDecodeError as exc:
            refused = isinstance(exc, PhotoRefused) or exc.reason in REFUSAL_REASONS
            return PhotoOutcome(name, reason=exc.reason, detail=exc.detail, verdict="refused" if refused else "error")
        except OSError as exc:
            gone = isinstance(exc, FileNotFoundError) and self.uploads is not None and self.uploads.owns(path)
            return PhotoOutcome(name, reason="gone" if gone else "unreadable", detail=exc.strerror or str(exc))
        except (BatcherBusy, BatcherClosed) as exc:
            return PhotoOutcome(name, reason="busy", detail=str(exc))
        except Exception as exc:  # a bug or an exotic file must cost one photo, not the page
            log.exception("unexpected failure reading %s", name)
            return PhotoOutcome(name, reason="internal", detail=f"{type(exc).__name__}: {exc}")

    def _finish(self, name: str, begun: tuple[str | None, PhotoOutcome | Future]) -> PhotoOutcome:
        """Wait for the photo's row of :meth:`Predictor.score_arrays` and judge it as the Predictor does."""
        digest, started = begun
        if isinstance(started, PhotoOutcome):
            started.sha256 = digest
            return started
        try:
            row = np.asarray(started.result())
            judged = self.predictor.judge(row, top_k=1, source=name)
            return PhotoOutcome(name, probs=row["probs"], verdict=judged.verdict, ood_score=judged.ood_score,
                                sha256=digest)
        except (TimeoutError, BatcherBusy, BatcherClosed) as exc:
            return PhotoOutcome(name, reason="busy", detail=str(exc))
        except Exception as exc:
            log.exception("model failed on %s", name)
            return PhotoOutcome(name, reason="internal", detail=f"{type(exc).__name__}: {exc}")

    # ----------------------------------------------------------------------------- a request
    def diagnose(self, files: Sequence[str | os.PathLike] | None) -> dict[str, Any]:
        """Diagnose ``files`` (paths; their base names are shown) and return the JSON answer.

        At most ``max_photos`` files are used; the answer's ``given`` says how many came. Adds
        ``server_ms`` (wall time of this call) and ``model`` (the model file's name). Files in the upload
        folder are handed to it once answered (all of them, the ones beyond ``max_photos`` too).
        """
        t0 = time.perf_counter()
        paths = [os.fspath(f) for f in (files or [])]
        used = paths[: self.options.max_photos]
        names = photo_names(used)
        with self.uploads.holding(used) if self.uploads is not None else nullcontext():
            if len(used) == 1:
                started = [self._start(used[0], names[0])]
            else:
                started = list(self._pool.map(self._start, used, names))
            outcomes = [self._finish(n, s) for n, s in zip(names, started)]
        if self.uploads is not None:
            self.uploads.answered(paths)
        card = self.predictor.card
        result = summarise(outcomes, self.predictor.classes, card.uncertain_threshold, top_k=self.options.top_k,
                           given=len(paths), notes=self.notes,
                           ood_threshold=card.ood.threshold if card.ood is not None else None)
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        self.answered.record([o.sha256 for o in outcomes], result)
        if len(paths) > len(used):
            result["not_used"] = photo_names(paths)[len(used):]  # the page names them, as it names the used ones
        result["server_ms"] = round(elapsed_ms, 2)
        result["model"] = self.predictor.model_path.name
        ok = sum(o.ok for o in outcomes)
        answer = result["answer"]
        counts = Counter(p["verdict"] for p in result["photos"])
        log.info("diagnose photos=%d ok=%d failed=%d verdicts=%s answer=%s%s server_ms=%.1f per_photo_ms=%.1f",
                 len(used), ok, len(used) - ok, ",".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-",
                 result["verdict"] or "-", f" {answer['label']}" if answer and answer["label"] else "", elapsed_ms,
                 elapsed_ms / max(1, len(used)))
        return result

    def close(self) -> None:
        """Answer what is queued, then stop the batcher and the decode threads; the upload folder's sweep
        stops and what it holds is deleted."""
        self.batcher.close(drain=True, timeout_s=10)
        self._pool.shutdown(wait=True)
        if self.uploads is not None:
            self.uploads.close()

    def __enter__(self) -> DiagnosisService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
