"""Batches on the training device: the host DataLoader's batches, uploaded asynchronously to the GPU.

``DeviceLoader(loader, device)`` wraps an ``leaflens.engine.data.DataLoader`` (or any iterable of tuples of
host arrays). On the CPU it passes every batch through untouched: the CPU path is exactly what it
was. On CUDA, while the GPU computes on batch ``b``, batch ``b + 1`` is already on its way:

1. the host batch is copied into a page-locked (pinned) host buffer, which a DMA engine can read
   while the CPU and the GPU's compute units do other work (a pageable buffer would be staged
   through a hidden pinned buffer synchronously);
2. ``ndarray.set(pinned, stream=copy_stream)`` enqueues the upload on a separate copy stream, into
   one of two device buffers (double buffering: the upload of ``b + 1`` fills one while compute
   reads the other), and an event ("ready") is recorded on the copy stream behind it;
3. the compute stream (the current stream when the batch is handed out) waits on "ready" before any
   work that uses the batch: the wait happens on the GPU, the host never blocks;
4. when the consumer asks for the next batch, all the work it enqueued for this one has been
   submitted, so an event ("free") recorded on the compute stream at that moment marks when the
   buffer may be overwritten; the copy stream waits on it before uploading into that buffer again.
   The pinned buffer is refilled only after the host has waited for its previous upload ("ready").
   A device buffer newly taken from the (compute stream's) memory pool may be memory that queued
   compute work still reads, so the copy stream also waits for the compute stream as it was right
   after the allocation.

A batch handed out on CUDA lives in a reused buffer: work enqueued on it before the consumer asks
for the next batch is safe (the GPU finishes it before the buffer is refilled); to use a batch after
that, copy it (``.copy()``) first. A batch's ``indices`` (a :class:`leaflens.engine.data.Batch` field, or
the same-named field of any named tuple) stay on the host: they are for looking up host-side data.

``len()``, ``state_dict()``, ``load_state_dict()``, ``set_epoch()``, ``epoch_order()``, ``batch_size``
and every other attribute pass through to the wrapped loader, so exact resume works as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar, cast

import numpy as np

from leaflens.engine.backend import cupy_module

__all__ = ["DeviceLoader", "gpu_usable", "resolve_device"]

_Batch = TypeVar("_Batch", bound=tuple[Any, ...])  # a plain or named tuple: upload hands back the same type


def gpu_usable() -> tuple[bool, str]:
    """(usable, why): CuPy imports, a CUDA device answers and the kernels' probe agrees (never raises).

    The probe honours ``LEAFLENS_DISABLE_GPU=1``, so a GPU machine can be made to train on the CPU.
    """
    from leaflens.kernels import _cuda  # noqa: PLC0415  (no CuPy import unless a GPU is asked about)

    ok, why = _cuda.gpu_probe()
    if ok and cupy_module() is None:
        return False, "CuPy imports but leaflens.engine.backend finds no CUDA device"
    return ok, why


def resolve_device(setting: str = "auto") -> str:
    """"cpu" or "cuda" from a ``train.device`` setting: "auto" (CUDA when usable), "cpu", or "cuda"."""
    setting = str(setting).lower()
    if setting == "cpu":
        return "cpu"
    if setting in ("cuda", "gpu", "auto"):
        ok, why = gpu_usable()
        if ok:
            return "cuda"
        if setting == "auto":
            return "cpu"
        raise RuntimeError(f"device 'cuda' requested but no usable CUDA GPU: {why} (see `leaflens doctor`)")
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {setting!r}")


class DeviceLoader:
    """Yield the wrapped loader's batches on ``device`` ("cpu": unchanged; "cuda": async, double-buffered).

    ``cupy`` may be given to use another module with CuPy's interface (tests drive the CUDA protocol
    with a stand-in that records every stream operation).
    """

    def __init__(self, loader: Iterable[Any], device: str = "cpu", cupy: Any = None) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"DeviceLoader: device must be 'cpu' or 'cuda', got {device!r}")
        self.loader = loader
        self.device = device
        self._cp = cupy
        self._copy_stream: Any = None
        self._slots: list[_Slot] = []

    # -- passthrough ---------------------------------------------------------------------------------
    # The wrapped loader is typed as any iterable; these reach an engine DataLoader's own methods (hence
    # the ignores), and a loader without them raises as it would if called directly.
    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found on self: batch_size, epoch, seed, dataset, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)  # type: ignore[attr-defined]

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        return self.loader.epoch_order(epoch)  # type: ignore[attr-defined]

    # -- iteration -----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return self.upload(iter(self.loader))

    def upload(self, batches: Iterable[_Batch]) -> Iterator[_Batch]:
        """Move each tuple of host arrays in ``batches`` to the device (elements that are not NumPy
        arrays, such as None, pass through, and so does a named tuple's ``indices`` field). Use it for
        batches a caller has prepared on the host from the wrapped loader's output (teacher targets
        looked up per row, ...); named tuples come back as the same type."""
        if self.device == "cpu":
            yield from batches
            return
        yield from self._upload_cuda(iter(batches))

    def _cupy(self) -> Any:
        if self._cp is None:
            cp = cupy_module()
            if cp is None:
                raise RuntimeError("DeviceLoader: device 'cuda' but no usable CUDA GPU with CuPy")
            self._cp = cp
        return self._cp

    def _upload_cuda(self, it: Iterator[_Batch]) -> Iterator[_Batch]:
        cp = self._cupy()
        if self._copy_stream is None:
            self._copy_stream = cp.cuda.Stream(non_blocking=True)
            self._slots = [_Slot(cp), _Slot(cp)]
        nxt = next(it, None)
        if nxt is None:
            return
        k = 0
        self._slots[0].fill(cp, self._copy_stream, nxt)
        try:
            while True:
                nxt = next(it, None)  # the host prepares batch k + 1 while the GPU works ...
                if nxt is not None:   # ... and its upload is enqueued before batch k is handed out
                    self._slots[(k + 1) % 2].fill(cp, self._copy_stream, nxt)
                slot = self._slots[k % 2]
                compute = cp.cuda.get_current_stream()
                compute.wait_event(slot.ready)
                yield cast(_Batch, slot.batch)  # _Slot.fill rebuilds a named tuple with its own _make
                # The consumer came back for more: everything it enqueued with batch k is on the compute
                # stream now, so this buffer may be overwritten once the GPU has got past this point.
                slot.free.record(compute)
                slot.batch = ()
                if nxt is None:
                    return
                k += 1
        finally:  # also when the consumer stops early: nothing queued so far may see its buffer overwritten
            compute = cp.cuda.get_current_stream()
            for slot in self._slots:
                slot.free.record(compute)
                slot.batch = ()


class _Slot:
    """One of the two buffers: pinned host arrays, device arrays, and the two events guarding them."""

    def __init__(self, cp: Any) -> None:
        self.ready = cp.cuda.Event(disable_timing=True)  # the upload into this slot has finished
        self.free = cp.cuda.Event(disable_timing=True)   # the compute that read this slot has finished
        self.host: dict[int, np.ndarray] = {}  # element index -> pinned array (grown as needed)
        self.device: dict[int, Any] = {}       # element index -> device array (same capacity)
        self.batch: tuple[Any, ...] = ()

    def fill(self, cp: Any, stream: Any, batch: tuple[Any, ...]) -> None:
        """Upload ``batch``'s NumPy arrays into this slot on ``stream`` and record ``ready`` behind them."""
        self.ready.synchronize()        # the previous upload has read the pinned buffers: refill them
        stream.wait_event(self.free)    # the GPU has finished with the device buffers: overwrite them
        out = []
        host_only = _host_fields(batch)
        for i, a in enumerate(batch):
            if not isinstance(a, np.ndarray) or a.ndim == 0 or i in host_only:
                out.append(a)
                continue
            host, dev = self._buffers(cp, stream, i, a)
            n = a.shape[0]
            np.copyto(host[:n], a)              # pageable -> pinned, on the host
            dev[:n].set(host[:n], stream=stream)  # pinned -> device, asynchronous on the copy stream
            out.append(dev[:n])
        self.ready.record(stream)
        self.batch = type(batch)._make(out) if hasattr(batch, "_make") else tuple(out)

    def _buffers(self, cp: Any, stream: Any, i: int, a: np.ndarray) -> tuple[np.ndarray, Any]:
        """Pinned and device buffers for element ``i`` with room for ``a`` (first-axis slices are views).

        A new device buffer comes from the memory pool of the current (compute) stream, which may hand
        out memory that work already queued there still reads (freed by the host, not yet by the GPU:
        stream-ordered reuse is safe on that stream only). The ``free`` event knows nothing of it, so
        the copy stream is made to wait for everything enqueued on the compute stream so far before it
        writes into the new buffer (first fill, a larger batch, a new loader after a resume).
        """
        host = self.host.get(i)
        if host is None or host.dtype != a.dtype or host.shape[1:] != a.shape[1:] or host.shape[0] < a.shape[0]:
            mem = cp.cuda.alloc_pinned_memory(max(a.nbytes, 1))
            host = np.frombuffer(mem, dtype=a.dtype, count=a.size).reshape(a.shape)
            self.host[i] = host
            self.device[i] = None  # the old buffer goes back to the pool before the new one is taken
            self.device[i] = cp.empty(a.shape, dtype=a.dtype)
            _copy_waits_for_compute(cp, stream)
        return host, self.device[i]


def _copy_waits_for_compute(cp: Any, stream: Any) -> None:
    """Make ``stream`` (the copy stream) wait for all work enqueued on the current stream so far."""
    allocated = cp.cuda.Event(disable_timing=True)
    allocated.record(cp.cuda.get_current_stream())
    stream.wait_event(allocated)


HOST_FIELDS = ("indices",)


def _host_fields(batch: tuple[Any, ...]) -> set[int]:
    """Positions of a named tuple's fields that stay on the host (dataset row indices)."""
    return {i for i, name in enumerate(getattr(type(batch), "_fields", ())) if name in HOST_FIELDS}
