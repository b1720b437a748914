"""Inference with an exported leaflens ONNX model: photo in, ranked classes out.

The :class:`Predictor` loads the model once, reads its :class:`~leaflens.apps.model_card.ModelCard` (class
names, preprocessing contract, uncertainty threshold) from the file's metadata, and preprocesses
every photo with that contract (leaflens.data_prep.contract): decoded to the stored size as
`leaflens preprocess` decoded the training photos, area-averaged to the input size and normalised by
the very functions the engine's evaluation used, so serving sees the pixels that were measured.
:meth:`Predictor.decode` gives the stored-size uint8 pixels (what the dataset arrays hold, and what
the batcher carries); :meth:`Predictor.preprocess` does the rest. Softmax is applied here (the
graph ends at the logits). Every answer carries one verdict:

- ``refused``: the photo was not shown to the model: smaller than :data:`MIN_SIDE` px on a side,
  near-uniform, or too flat to judge (leaflens.data_prep.quality);
- ``out_of_domain``: the model's ``ood_score`` output (leaflens.pipeline.ood) is above the threshold in
  its metadata: this does not look like the photos it was trained on, so no class is named;
- ``ambiguous``: a known kind of photo, but the top probability is below the model's threshold, or the
  second class is nearly as likely (:data:`leaflens.apps.model_card.TIE_RATIO`): the top two classes are
  named, neither is claimed;
- ``diagnosis``: the top class.

A model exported before the out-of-domain output existed (format <= 2) gets no ``out_of_domain``
verdict; :attr:`Predictor.has_ood` says which kind is loaded.

For a server, pair it with the dynamic batcher::

    predictor = Predictor("student.onnx", intra_op_threads=1)
    batcher = DynamicBatcher(predictor.score_arrays, max_batch_size=16, max_wait_ms=0,
                             num_workers=usable_cpus())
    scores = batcher.submit(predictor.decode(photo_path)).result()  # refuses a degenerate photo first
    answer = predictor.judge(scores, top_k=3, source=photo_path)  # out_of_domain, ambiguous or diagnosis

On a CPU these are the settings benchmarks/serve.py uses: a small CNN costs about the same CPU
time per image at batch 1 as at batch 32, so the batcher's gain there is concurrency (one
single-threaded batch per core, no intra-op synchronisation) rather than bigger matrix products,
and waiting for a batch to fill only adds latency; batches still form under load while the
workers are busy. On a GPU, one worker with larger batches and a few milliseconds of wait is the
better starting point.

This module must not import the engine: serving needs only onnxruntime, NumPy and data_prep.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leaflens.apps.model_card import ModelCard, ModelError, unsure
from leaflens.apps.providers import CPU, CUDA, TENSORRT, Probe, ProviderChoice, probe, provider_name
from leaflens.cpus import usable_cpus
from leaflens.data_prep.decode import ImageDecodeError
from leaflens.data_prep.quality import MIN_SIDE, PhotoRefused, check_colour, check_photo

# What decode_image accepts: a path or the encoded bytes of a photo.
Source = str | os.PathLike | bytes

__all__ = ["MIN_SIDE", "OOD_OUTPUT", "PREFERRED_PROVIDERS", "VERDICTS", "Prediction", "Predictor",
           "choose_providers"]

# The verdicts, in the order the checks run; "error": the file could not be read at all.
VERDICTS = ("refused", "out_of_domain", "ambiguous", "diagnosis", "error")
OOD_OUTPUT = "ood_score"  # the graph output leaflens.pipeline.ood adds

# The default order when no provider is asked for. CUDA comes with the onnxruntime-gpu wheel and is used
# only when a quiet probe says it starts here (leaflens.apps.providers). TensorRT is never a default: it
# needs NVIDIA's TensorRT libraries, which no extra installs, and builds an engine per model at start;
# ask for it (`--provider tensorrt`, or providers=["tensorrt"]).
PREFERRED_PROVIDERS = (CUDA, CPU)


@dataclass(frozen=True)
class Prediction:
    """The answer for one image: its ``verdict`` (one of :data:`VERDICTS`), the ranked ``(class,
    probability)`` pairs and the out-of-domain score, or the reason there is none.

    For ``refused`` and ``error`` ``top`` is empty, ``reason`` is the short code ("uniform",
    "too_small", "truncated", ...) and ``error`` the message naming the file. ``ood_score`` is None
    for a model without the out-of-domain output.
    """

    source: str
    top: tuple[tuple[str, float], ...] = ()
    verdict: str = "diagnosis"
    ood_score: float | None = None
    error: str | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    @property
    def ok(self) -> bool:
        """The model looked at the photo (any verdict but ``refused`` and ``error``)."""
        return self.error is None

    @property
    def uncertain(self) -> bool:
        """No diagnosis is claimed although the model ran (``ambiguous`` or ``out_of_domain``)."""
        return self.verdict in ("ambiguous", "out_of_domain")

    @property
    def label(self) -> str | None:
        """The top class, or None for a failed image."""
        return self.top[0][0] if self.top else None

    @property
    def confidence(self) -> float | None:
        """The top probability, or None for a failed image."""
        return self.top[0][1] if self.top else None


def choose_providers(available: Sequence[str], requested: Sequence[str] | None = None,
                     works: Callable[[str], Probe] = probe) -> ProviderChoice:
    """The execution providers to ask onnxruntime for, chosen by what starts here.

    ``available``: what this onnxruntime build offers (``get_available_providers()``). ``requested``: names
    in order of preference, ``cpu``/``cuda``/``tensorrt`` or onnxruntime's own; TensorRT brings CUDA after
    it (for the nodes TensorRT leaves). Default: :data:`PREFERRED_PROVIDERS` that this build has (CUDA
    with onnxruntime-gpu, never TensorRT). A wanted provider is kept only when it is in ``available`` and
    ``works(provider)`` (the quiet probe, once per process) says it starts; the others are listed in
    ``failed`` with the reason. The CPU provider always ends the list. Raises ValueError for a name that is
    no provider.
    """
    names = [provider_name(r) for r in requested] if requested else [p for p in PREFERRED_PROVIDERS if p in available]
    if TENSORRT in names and CUDA not in names:
        names.insert(names.index(TENSORRT) + 1, CUDA)
    chosen: list[str] = []
    failed: list[tuple[str, str]] = []
    for name in dict.fromkeys(names):
        if name == CPU:
            continue
        if name not in available:
            failed.append((name, f"this onnxruntime has no {name} (a GPU needs onnxruntime-gpu: "
                                 "`leaflens doctor` says which extra to install)"))
            continue
        result = works(name)
        if result.ok:
            chosen.append(name)
        else:
            failed.append((name, result.reason))
    return ProviderChoice(providers=(*chosen, CPU), failed=tuple(failed))


# What a file that onnxruntime refuses probably is, by its first bytes, and what to pass instead.
_NOT_ONNX = (
    (b"PK\x03\x04", "a training checkpoint or other zip/.npz archive, not an exported model: `leaflens export "
                     "--run RUN` writes the .onnx file that --model takes"),
    (b"\x93NUMPY", "a NumPy array (.npy), not an exported model: `leaflens export --run RUN` writes the .onnx file "
                   "that --model takes"),
    (b"\xff\xd8\xff", "a JPEG photo, not a model: photos go after the command's options, --model takes the "
                       "exported .onnx file"),
    (b"\x89PNG", "a PNG image, not a model: photos go after the command's options, --model takes the exported "
                 ".onnx file"),
)


def not_an_onnx_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is plainly not an ONNX model (a checkpoint, an array, a photo), or None when its first bytes
    do not say: onnxruntime's own "Protobuf parsing failed" names none of these."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if not head:
        return "an empty file, not a model (an interrupted copy or export?)"
    for magic, what in _NOT_ONNX:
        if head.startswith(magic):
            return f"this is {what}"
    return None


class Predictor:
    """A loaded leaflens ONNX model plus the preprocessing it was trained with.

    Args:
        model_path: the exported ``.onnx`` file (its metadata must describe it, see ModelCard).
        providers: execution providers in order of preference (``cpu``, ``cuda``, ``tensorrt`` or
            onnxruntime's names); default: CUDA when this onnxruntime has it and a quiet probe says it starts
            here, else CPU (see :func:`choose_providers`). ``self.provider`` is the one really used, and
            ``self.provider_line`` the one line to show: it and, when a wanted GPU provider could not start, why.
        intra_op_threads: threads onnxruntime uses inside one call; default: the CPUs this process
            may use (affinity and container quota), not the host's core count.
        allow_spinning: let onnxruntime's idle threads spin-wait. Off by default: spinning buys a
            few microseconds per call but steals the CPU that decoding and other requests need.

    Raises :class:`ModelError` (message names the file) when the file is missing, not ONNX, lacks
    required metadata, or its input/output do not match the metadata.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        providers: Sequence[str] | None = None,
        intra_op_threads: int | None = None,
        allow_spinning: bool = False,
    ) -> None:
        import onnxruntime as ort  # imported here so `leaflens --help` never pays for it

        self.model_path = Path(model_path)
        name = str(self.model_path)
        if not self.model_path.is_file():
            raise ModelError(f"{name}: model file not found")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.intra_op_threads = int(intra_op_threads) if intra_op_threads else usable_cpus()
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        options.log_severity_level = 3  # errors only; provider fallbacks are reported via self.provider_line
        try:  # GPU providers that cannot start here are left out before onnxruntime tries (and complains)
            self.provider_choice = choose_providers(ort.get_available_providers(), providers)
        except ValueError as exc:
            raise ModelError(f"{name}: {exc}") from exc
        try:
            self.session = ort.InferenceSession(name, sess_options=options,
                                                providers=list(self.provider_choice.providers))
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf/... types
            kind = not_an_onnx_file(self.model_path)
            if kind:
                raise ModelError(f"{name}: {kind}") from exc
            raise ModelError(f"{name}: onnxruntime cannot load this model: {exc}") from exc
        self.providers: list[str] = list(self.session.get_providers())
        self.provider: str = self.providers[0]
        self.provider_line: str = self.provider_choice.line(self.provider)
        meta = self.session.get_modelmeta().custom_metadata_map
        self.card = ModelCard.from_metadata(meta, name)
        self._check_signature(name)

    def _check_signature(self, name: str) -> None:
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) not in (1, 2):
            raise ModelError(
                f"{name}: expected one input and one or two outputs (logits, {OOD_OUTPUT}), found "
                f"{len(inputs)} and {len(outputs)}"
            )
        inp, out = inputs[0], outputs[0]
        self.ood_name: str | None = None
        if len(outputs) == 2:
            extra = outputs[1]
            if extra.name != OOD_OUTPUT or extra.type != "tensor(float)" or len(extra.shape) != 1:
                raise ModelError(f"{name}: second output is '{extra.name}' {extra.type} {list(extra.shape)}, "
                                 f"expected '{OOD_OUTPUT}' tensor(float) [N]")
            if self.card.ood is None:
                raise ModelError(f"{name}: has the '{OOD_OUTPUT}' output but no metadata 'leaflens.ood' "
                                 "saying how to judge it (export it with `leaflens export`)")
            self.ood_name = extra.name
        elif self.card.ood is not None:
            raise ModelError(f"{name}: metadata 'leaflens.ood' describes an out-of-domain score but the graph "
                             f"has no '{OOD_OUTPUT}' output")
        size, n_cls = self.card.input_size, self.card.num_classes
        for arg, what in ((inp, "input"), (out, "output")):
            if arg.type != "tensor(float)":
                raise ModelError(f"{name}: {what} '{arg.name}' has type {arg.type}, expected tensor(float)")
        in_shape, out_shape = list(inp.shape), list(out.shape)
        expect_in = [None, 3, size, size]
        if len(in_shape) != 4 or any(isinstance(d, int) and e is not None and d != e
                                     for d, e in zip(in_shape, expect_in)):
            raise ModelError(
                f"{name}: input '{inp.name}' has shape {in_shape}, expected [N, 3, {size}, {size}] "
                f"(metadata 'leaflens.input_size' = {size})"
            )
        if len(out_shape) != 2 or (isinstance(out_shape[1], int) and out_shape[1] != n_cls):
            raise ModelError(
                f"{name}: output '{out.name}' has shape {out_shape}, expected [N, {n_cls}] "
                f"({n_cls} names in metadata 'leaflens.classes')"
            )
        self.input_name, self.output_name = inp.name, out.name

    # ----------------------------------------------------------------------------- arrays
    @property
    def classes(self) -> tuple[str, ...]:
        return self.card.classes

    @property
    def stored_size(self) -> int:
        """The side of the uint8 squares :meth:`decode` returns and the ``*_arrays`` methods take."""
        return self.card.stored_size

    def preprocess(self, batch: np.ndarray) -> np.ndarray:
        """uint8 ``[N, T, T, 3]`` RGB at the stored size T (as :meth:`decode` returns, or rows of the
        dataset arrays) -> float32 ``[N, 3, S, S]`` at the input size S, normalised as in training."""
        return np.ascontiguousarray(self.card.contract.prepare(batch).transpose(0, 3, 1, 2))

    @property
    def has_ood(self) -> bool:
        """Whether this model carries the out-of-domain score (format 3 exports do)."""
        return self.ood_name is not None

    @property
    def scores_dtype(self) -> np.dtype:
        """Rows of :meth:`score_arrays`: the class probabilities and the out-of-domain score."""
        return np.dtype([("probs", np.float32, (self.card.num_classes,)), ("ood_score", np.float32)])

    def _run(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        x = self.preprocess(batch)
        n, k = len(x), self.card.num_classes
        if n == 0:
            return np.zeros((0, k), np.float32), (np.zeros(0, np.float32) if self.has_ood else None)
        names = [self.output_name] + ([self.ood_name] if self.ood_name else [])
        outs = self.session.run(names, {self.input_name: x})
        if outs[0].shape != (n, k) or (len(outs) == 2 and outs[1].shape != (n,)):
            raise RuntimeError(f"{self.model_path}: output shapes {[o.shape for o in outs]}, expected "
                               f"{[(n, k), (n,)][:len(outs)]}")
        return outs[0], (outs[1] if len(outs) == 2 else None)

    def logits_arrays(self, batch: np.ndarray) -> np.ndarray:
        """The model's raw logits ``[N, num_classes]`` for a uint8 ``[N, T, T, 3]`` stored-size batch."""
        return self._run(batch)[0]

    @staticmethod
    def _softmax(logits: np.ndarray) -> np.ndarray:
        z = logits.astype(np.float32, copy=True)
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        return z

    def predict_arrays(self, batch: np.ndarray) -> np.ndarray:
        """Class probabilities ``[N, num_classes]`` (float32, rows sum to 1) for uint8 ``[N, T, T, 3]``.

        Thread-safe (onnxruntime sessions are). For answers with verdicts use :meth:`score_arrays`.
        """
        return self._softmax(self._run(batch)[0])

    def score_arrays(self, batch: np.ndarray) -> np.ndarray:
        """One row of :attr:`scores_dtype` per image (probabilities and out-of-domain score, NaN when the
        model has none) for uint8 ``[N, T, T, 3]``: the ``run_batch`` of a DynamicBatcher, thread-safe."""
        logits, ood = self._run(batch)
        rows = np.empty(len(logits), self.scores_dtype)
        rows["probs"] = self._softmax(logits)
        rows["ood_score"] = np.nan if ood is None else ood
        return rows

    def judge(self, scores: np.ndarray, top_k: int = 3, source: str = "<array>") -> Prediction:
        """The :class:`Prediction` for one row of :meth:`score_arrays` (or a plain row of probabilities):
        ``out_of_domain`` above the model's threshold, else ``ambiguous`` below the top-probability
        threshold or in a near tie (:func:`leaflens.apps.model_card.unsure`), else ``diagnosis``."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        scores = np.asarray(scores)
        if scores.dtype.names:
            probs, ood = scores["probs"], float(scores["ood_score"])
        else:
            probs, ood = scores, float("nan")
        probs = np.asarray(probs, dtype=np.float64).reshape(-1)
        if probs.shape != (self.card.num_classes,):
            raise ValueError(f"expected {self.card.num_classes} probabilities, got shape {probs.shape}")
        order = np.argsort(-probs, kind="stable")[: min(top_k, len(probs))]
        top = tuple((self.card.classes[i], float(probs[i])) for i in order)
        ood_score = None if np.isnan(ood) else ood
        if self.card.ood is not None and (ood_score is None or ood_score > self.card.ood.threshold):
            verdict = "out_of_domain"  # (a NaN score from a broken graph is out of domain too)
        elif unsure(probs, self.card.uncertain_threshold):
            verdict = "ambiguous"
        else:
            verdict = "diagnosis"
        return Prediction(source=source, top=top, verdict=verdict, ood_score=ood_score)

    def rank(self, probs: np.ndarray, top_k: int = 3, source: str = "<array>") -> Prediction:
        """:meth:`judge` for a row of probabilities alone, for a model without the out-of-domain output."""
        if self.has_ood:
            raise ValueError(f"{self.model_path} has an out-of-domain score: judge rows of score_arrays()")
        return self.judge(np.asarray(probs), top_k, source)

    # ----------------------------------------------------------------------------- images
    def decode(self, src: Source, refuse: bool = True) -> np.ndarray:
        """One photo (path or encoded bytes) -> uint8 ``[T, T, 3]`` at the stored size, exactly the
        pixels `leaflens preprocess` stored for it (same call: JPEG draft scale and EXIF included).

        Raises :class:`leaflens.data_prep.decode.ImageDecodeError` for unreadable images and, unless
        ``refuse`` is False, its subclass :class:`leaflens.data_prep.quality.PhotoRefused` for a photo
        smaller than :data:`MIN_SIDE` px on a side, near-uniform or too flat to judge, or without colour
        where the model learnt from colour photos only (``card.refuses_grey``).
        """
        try:
            pixels = self.card.contract.decode(src, min_side=MIN_SIDE if refuse else 0)
        except ImageDecodeError as exc:
            if exc.reason == "too_small":  # readable, but too small to judge: a refusal, not a broken file
                raise PhotoRefused(exc.reason, exc.source, exc.detail) from exc
            raise
        if refuse:
            name = "<bytes>" if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)
            check_photo(pixels, name)
            if self.card.refuses_grey:
                check_colour(pixels, name)
        return pixels

    @staticmethod
    def failed(source: str, exc: ImageDecodeError) -> Prediction:
        """The Prediction of a photo the model never saw: ``refused`` or ``error``, with the reason."""
        return Prediction(source=source, verdict="refused" if isinstance(exc, PhotoRefused) else "error",
                          error=str(exc), reason=exc.reason)

    def predict_image(self, src: Source, top_k: int = 3) -> Prediction:
        """Classify one photo; an unreadable or refused image gives a Prediction with ``error`` set."""
        source = "<bytes>" if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)
        try:
            pixels = self.decode(src)
        except ImageDecodeError as exc:
            return self.failed(source, exc)
        return self.judge(self.score_arrays(pixels[None])[0], top_k, source)

    def _try_decode(self, path: str, refuse: bool = True) -> np.ndarray | ImageDecodeError:
        try:
            return self.decode(path, refuse)
        except ImageDecodeError as exc:
            return exc

    def iter_predict_files(
        self, paths: Iterable[str | os.PathLike], top_k: int = 3, batch_size: int = 32,
        decode_workers: int | None = None, refuse: bool = True,
    ) -> Iterator[Prediction]:
        """Classify files in batches, yielding one Prediction per path, in order.

        Decoding runs on a thread pool (Pillow releases the GIL) and the next batch is decoded
        while the current one runs through the model; at most two batches are in memory.
        ``refuse=False`` shows every readable photo to the model (evaluation of the model alone).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        names = [os.fspath(p) for p in paths]
        chunks = [names[i: i + batch_size] for i in range(0, len(names), batch_size)]
        if not chunks:
            return
        workers = decode_workers or usable_cpus()
        with ThreadPoolExecutor(workers, thread_name_prefix="leaflens-decode") as pool:
            upcoming = [pool.submit(self._try_decode, p, refuse) for p in chunks[0]]
            for i, chunk in enumerate(chunks):
                decoded = [f.result() for f in upcoming]
                if i + 1 < len(chunks):
                    upcoming = [pool.submit(self._try_decode, p, refuse) for p in chunks[i + 1]]
                images = [d for d in decoded if isinstance(d, np.ndarray)]
                rows = iter(self.score_arrays(np.stack(images)) if images else ())  # one row per image, in order
                for path, d in zip(chunk, decoded):
                    if isinstance(d, ImageDecodeError):
                        yield self.failed(path, d)
                    else:
                        yield self.judge(next(rows), top_k, path)

    def predict_files(
        self, paths: Iterable[str | os.PathLike], top_k: int = 3, batch_size: int = 32, refuse: bool = True,
    ) -> list[Prediction]:
        """All of :meth:`iter_predict_files` as a list (same order as ``paths``)."""
        return list(self.iter_predict_files(paths, top_k, batch_size, refuse=refuse))

    def __repr__(self) -> str:
        return (f"Predictor({str(self.model_path)!r}, provider={self.provider!r}, "
                f"classes={len(self.card.classes)}, stored_size={self.card.stored_size}, "
                f"input_size={self.card.input_size})")
