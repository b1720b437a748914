"""Inference with an exported leaflens ONNX model: photo in, ranked classes out.

The :class:`Predictor` loads the model once, reads its :class:`~leaflens.apps.model_card.ModelCard` (class
names, preprocessing contract, uncertainty threshold) from the file's metadata, and preprocesses
every photo with that contract (leaflens.data_prep.contract): decoded to the stored size as
`leaflens preprocess` decoded the training photos, area-averaged to the input size and normalised by
the very functions the engine's evaluation used, so serving sees the pixels that were measured.
:meth:`Predictor.decode` gives the stored-size uint8 pixels (what the dataset arrays hold, and what
the batcher carries); :meth:`Predictor.preprocess` does the rest. Softmax is applied here (the
graph ends at the logits). A prediction whose top probability is below the model's threshold is
flagged ``uncertain``: a photo that is not a leaf should not get a confident disease name.

For a server, pair it with the dynamic batcher::

    predictor = Predictor("student.onnx", intra_op_threads=1)
    batcher = DynamicBatcher(predictor.predict_arrays, max_batch_size=16, max_wait_ms=0,
                             num_workers=usable_cpus())
    probs = batcher.submit(predictor.decode(photo_path)).result()
    answer = predictor.rank(probs, top_k=3, source=photo_path)

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
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leaflens.apps.model_card import ModelCard, ModelError
from leaflens.cpus import usable_cpus
from leaflens.data_prep.decode import ImageDecodeError

# What decode_image accepts: a path or the encoded bytes of a photo.
Source = str | os.PathLike | bytes

__all__ = ["PREFERRED_PROVIDERS", "Prediction", "Predictor", "choose_providers"]

# Fastest first. TensorRT and CUDA come with the onnxruntime-gpu wheel; the list is filtered by
# what this onnxruntime build offers, and onnxruntime itself drops a provider whose libraries fail
# to load (the session's get_providers() then tells what really runs).
PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


@dataclass(frozen=True)
class Prediction:
    """The answer for one image: ranked ``(class, probability)`` pairs, or the reason there is none.

    ``uncertain`` is True when the top probability is below the model's threshold. When the image
    could not be decoded, ``top`` is empty and ``error`` says why (the message names the file).
    """

    source: str
    top: tuple[tuple[str, float], ...] = ()
    uncertain: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def label(self) -> str | None:
        """The top class, or None for a failed image."""
        return self.top[0][0] if self.top else None

    @property
    def confidence(self) -> float | None:
        """The top probability, or None for a failed image."""
        return self.top[0][1] if self.top else None

    def as_dict(self) -> dict[str, object]:
        return {"source": self.source, "label": self.label, "confidence": self.confidence,
                "uncertain": self.uncertain, "top": [list(t) for t in self.top], "error": self.error}


def choose_providers(available: Sequence[str], requested: Sequence[str] | None = None) -> list[str]:
    """The execution providers to ask for: ``requested`` (each must be available), else the
    available ones of :data:`PREFERRED_PROVIDERS`, always ending with the CPU fallback."""
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise ValueError(
                f"execution provider(s) {missing} not available in this onnxruntime build "
                f"(available: {list(available)})"
            )
        chosen = list(requested)
    else:
        chosen = [p for p in PREFERRED_PROVIDERS if p in available]
    if "CPUExecutionProvider" not in chosen and "CPUExecutionProvider" in available:
        chosen.append("CPUExecutionProvider")
    return chosen


class Predictor:
    """A loaded leaflens ONNX model plus the preprocessing it was trained with.

    Args:
        model_path: the exported ``.onnx`` file (its metadata must describe it, see ModelCard).
        providers: onnxruntime execution providers in order of preference; default: TensorRT, CUDA
            when this onnxruntime offers them, else CPU. ``self.provider`` is the one really used.
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
        options.log_severity_level = 3  # errors only; provider fallbacks are reported via self.provider
        try:
            wanted = choose_providers(ort.get_available_providers(), providers)
        except ValueError as exc:
            raise ModelError(f"{name}: {exc}") from exc
        try:
            self.session = ort.InferenceSession(name, sess_options=options, providers=wanted)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf/... types
            raise ModelError(f"{name}: onnxruntime cannot load this model: {exc}") from exc
        self.providers: list[str] = list(self.session.get_providers())
        self.provider: str = self.providers[0]
        meta = self.session.get_modelmeta().custom_metadata_map
        self.card = ModelCard.from_metadata(meta, name)
        self._check_signature(name)

    def _check_signature(self, name: str) -> None:
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise ModelError(
                f"{name}: expected one input and one output, found {len(inputs)} and {len(outputs)}"
            )
        inp, out = inputs[0], outputs[0]
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

    def logits_arrays(self, batch: np.ndarray) -> np.ndarray:
        """The model's raw output ``[N, num_classes]`` for a uint8 ``[N, T, T, 3]`` stored-size batch."""
        x = self.preprocess(batch)
        if len(x) == 0:
            return np.zeros((0, self.card.num_classes), dtype=np.float32)
        (logits,) = self.session.run([self.output_name], {self.input_name: x})
        if logits.shape != (len(x), self.card.num_classes):
            raise RuntimeError(
                f"{self.model_path}: output shape {logits.shape}, expected {(len(x), self.card.num_classes)}"
            )
        return logits

    def predict_arrays(self, batch: np.ndarray) -> np.ndarray:
        """Class probabilities ``[N, num_classes]`` (float32, rows sum to 1) for uint8 ``[N, T, T, 3]``.

        Thread-safe (onnxruntime sessions are); this is the ``run_batch`` of a DynamicBatcher.
        """
        logits = self.logits_arrays(batch).astype(np.float32, copy=False)
        z = logits - logits.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        return z

    def rank(self, probs: np.ndarray, top_k: int = 3, source: str = "<array>") -> Prediction:
        """Turn one row of probabilities into a :class:`Prediction` with the top ``top_k`` classes."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        probs = np.asarray(probs, dtype=np.float64).reshape(-1)
        if probs.shape != (self.card.num_classes,):
            raise ValueError(f"expected {self.card.num_classes} probabilities, got shape {probs.shape}")
        order = np.argsort(-probs, kind="stable")[: min(top_k, len(probs))]
        top = tuple((self.card.classes[i], float(probs[i])) for i in order)
        return Prediction(source=source, top=top, uncertain=top[0][1] < self.card.uncertain_threshold)

    # ----------------------------------------------------------------------------- images
    def decode(self, src: Source) -> np.ndarray:
        """One photo (path or encoded bytes) -> uint8 ``[T, T, 3]`` at the stored size, exactly the
        pixels `leaflens preprocess` stored for it (same call: JPEG draft scale and EXIF included).

        Raises :class:`leaflens.data_prep.decode.ImageDecodeError` for unreadable images.
        """
        return self.card.contract.decode(src)

    def predict_image(self, src: Source, top_k: int = 3) -> Prediction:
        """Classify one photo; an unreadable image gives a Prediction with ``error`` set."""
        source = "<bytes>" if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)
        try:
            pixels = self.decode(src)
        except ImageDecodeError as exc:
            return Prediction(source=source, error=str(exc))
        return self.rank(self.predict_arrays(pixels[None])[0], top_k, source)

    def _try_decode(self, path: str) -> np.ndarray | str:
        try:
            return self.decode(path)
        except ImageDecodeError as exc:
            return str(exc)

    def iter_predict_files(
        self, paths: Iterable[str | os.PathLike], top_k: int = 3, batch_size: int = 32,
        decode_workers: int | None = None,
    ) -> Iterator[Prediction]:
        """Classify files in batches, yielding one Prediction per path, in order.

        Decoding runs on a thread pool (Pillow releases the GIL) and the next batch is decoded
        while the current one runs through the model; at most two batches are in memory.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        names = [os.fspath(p) for p in paths]
        chunks = [names[i: i + batch_size] for i in range(0, len(names), batch_size)]
        if not chunks:
            return
        workers = decode_workers or usable_cpus()
        with ThreadPoolExecutor(workers, thread_name_prefix="leaflens-decode") as pool:
            upcoming = [pool.submit(self._try_decode, p) for p in chunks[0]]
            for i, chunk in enumerate(chunks):
                decoded = [f.result() for f in upcoming]
                if i + 1 < len(chunks):
                    upcoming = [pool.submit(self._try_decode, p) for p in chunks[i + 1]]
                images = [d for d in decoded if not isinstance(d, str)]
                probs = iter(self.predict_arrays(np.stack(images)) if images else ())  # one row per image, in order
                for path, d in zip(chunk, decoded):
                    if isinstance(d, str):
                        yield Prediction(source=path, error=d)
                    else:
                        yield self.rank(next(probs), top_k, path)

    def predict_files(
        self, paths: Iterable[str | os.PathLike], top_k: int = 3, batch_size: int = 32
    ) -> list[Prediction]:
        """All of :meth:`iter_predict_files` as a list (same order as ``paths``)."""
        return list(self.iter_predict_files(paths, top_k, batch_size))

    def __repr__(self) -> str:
        return (f"Predictor({str(self.model_path)!r}, provider={self.provider!r}, "
                f"classes={len(self.card.classes)}, stored_size={self.card.stored_size}, "
                f"input_size={self.card.input_size})")
