"""leaflens.engine.device_loader: CPU pass-through, resume passthrough, and the CUDA protocol (pinned buffers, a
copy stream, double buffering, ready/free events) checked on a simulated GPU that runs one kind of
stream as early and the other as late as the recorded dependencies allow (both ways round), so that a
missing wait or host synchronisation shows up as wrong data."""

from __future__ import annotations

import gc
import weakref
from collections import deque
from typing import Any

import numpy as np
import pytest

from leaflens.engine.data import ArrayDataset, Augment, DataLoader
from leaflens.engine.device_loader import DeviceLoader, resolve_device


def _loader(n: int = 37, batch: int = 8, seed: int = 1) -> DataLoader:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 6, 6, 3), dtype=np.uint8)
    ds = ArrayDataset(x, (np.arange(n) % 4).astype(np.int64))
    return DataLoader(ds, batch, seed=seed, augment=Augment(crop="pad"), prefetch=2, num_threads=1)


def _host_batches(loader) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [(x.copy(), y.copy(), idx.copy()) for x, y, idx, _ in loader]


# ---- CPU -------------------------------------------------------------------------------------------------------
def test_cpu_passes_batches_through_identically():
    ref = _host_batches(_loader())
    dl = DeviceLoader(_loader(), "cpu")
    assert len(dl) == len(ref) == 5 and dl.batch_size == 8
    got = list(dl)
    for (x, y, idx, _), (rx, ry, ridx) in zip(got, ref):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        np.testing.assert_array_equal(idx, ridx)
    marker = (np.zeros(1), None)
    assert next(iter(dl.upload([marker])))[0] is marker[0]  # no copy at all on the CPU


def test_passthrough_keeps_exact_resume():
    a = DeviceLoader(_loader(), "cpu")
    a.set_epoch(2)
    np.testing.assert_array_equal(a.epoch_order(), a.loader.epoch_order(2))
    it = iter(a)
    next(it)
    next(it)
    state = a.state_dict()
    rest = [(x.copy(), y.copy(), idx.copy()) for x, y, idx, _ in it]
    b = DeviceLoader(_loader(), "cpu")
    b.load_state_dict(state)
    assert b.epoch == 2
    again = list(b)
    assert len(again) == len(rest) == 3
    for (x, y, idx, _), (rx, ry, ridx) in zip(again, rest):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        np.testing.assert_array_equal(idx, ridx)


def test_refuses_unknown_devices():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        DeviceLoader(_loader(), "tpu")
    assert resolve_device("auto") in ("cpu", "cuda")


# ---- a simulated GPU ---------------------------------------------------------------------------------------------
class SimGPU:
    """Streams are queues of operations. With ``eager="copy"`` the copy stream runs as soon as its waits
    allow and the compute stream only when the host synchronises; ``eager="compute"`` is the other way
    round. CUDA's rules: an event's ``record`` captures the stream's work so far; ``wait_event`` makes
    later work wait for the record current at the time of the call; an event never recorded counts as
    done; the host may write a pinned buffer at any time, and a copy reads it when the copy runs."""

    def __init__(self, eager: str = "copy") -> None:
        self.copy_eager = eager == "copy"
        self.compute = SimStream(self, eager=not self.copy_eager)
        self.streams = [self.compute]
        self.log: list[str] = []
        self.pinned_allocs = 0

    def run(self, until=lambda: False) -> None:
        progress = True
        while progress and not until():
            progress = False
            for s in sorted(self.streams, key=lambda s: not s.eager):  # eager streams first
                if s.step():
                    progress = True
                    break

    def pump(self) -> None:
        """Run the eager streams as far as they go (the compute stream stays behind)."""
        progress = True
        while progress:
            progress = any(s.step() for s in self.streams if s.eager)

    def synchronize(self) -> None:
        self.run()
        assert all(not s.ops for s in self.streams), "deadlock: work left that can never run"


class SimStream:
    def __init__(self, gpu: SimGPU, eager: bool) -> None:
        self.gpu, self.eager = gpu, eager
        self.ops: deque[tuple[str, Any]] = deque()
        self.done = 0      # operations completed so far
        self.issued = 0

    def enqueue(self, kind: str, payload: Any) -> int:
        self.ops.append((kind, payload))
        self.issued += 1
        self.gpu.pump()
        return self.issued

    def step(self) -> bool:
        if not self.ops:
            return False
        kind, payload = self.ops[0]
        if kind == "wait":
            stream, mark = payload
            if stream is not None and stream.done < mark:
                return False
        elif kind == "run":
            payload()
        self.ops.popleft()
        self.done += 1
        return True

    def wait_event(self, event: SimEvent) -> None:
        self.enqueue("wait", (event.stream, event.mark))


class SimEvent:
    def __init__(self, gpu: SimGPU) -> None:
        self.gpu, self.stream, self.mark = gpu, None, 0

    def record(self, stream: SimStream) -> None:
        self.stream, self.mark = stream, stream.issued + 1
        stream.enqueue("mark", None)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.gpu.run(until=lambda: self.stream.done >= self.mark)
            assert self.stream.done >= self.mark, "deadlock waiting for an event"


class SimPool:
    """A device memory pool as CuPy's: memory whose last array the host dropped goes back to the pool at
    once and is handed out again (smallest block that fits), whether or not queued GPU work still reads
    it. Reuse is stream-ordered: safe for work on the stream that allocated it, not for another stream."""

    def __init__(self) -> None:
        self.free: list[bytearray] = []
        self.reused = 0

    def alloc(self, nbytes: int) -> bytearray:
        fits = [b for b in self.free if len(b) >= nbytes]
        if fits:
            block = min(fits, key=len)
            self.free.remove(block)
            self.reused += 1
            return block
        return bytearray(b"\xff" * max(nbytes, 1))  # fresh memory: NaN / all-ones garbage

    def release(self, block: bytearray) -> None:
        self.free.append(block)


class _Allocation:
    """Owner of one pool block; every SimArray view holds it, as a CuPy view holds its memory pointer."""


class SimArray:
    def __init__(self, a: np.ndarray, owner: _Allocation | None = None) -> None:
        self.a = a
        self.owner = owner

    @property
    def shape(self):
        return self.a.shape

    def __getitem__(self, key) -> SimArray:
        return SimArray(self.a[key], self.owner)

    def set(self, host: np.ndarray, stream: SimStream) -> None:
        assert host.shape == self.a.shape and host.dtype == self.a.dtype
        dst = self.a
        stream.enqueue("run", lambda: np.copyto(dst, host))  # the DMA reads the host buffer when it runs


class FakeCupy:
    """Just the CuPy surface DeviceLoader uses, on top of SimGPU."""

    def __init__(self, gpu: SimGPU, pool: SimPool | None = None) -> None:
        self.gpu = gpu
        self.pool = pool
        fake = self

        class _Cuda:
            @staticmethod
            def Stream(non_blocking: bool = False):  # noqa: N802
                s = SimStream(gpu, eager=gpu.copy_eager)
                gpu.streams.append(s)
                return s

            @staticmethod
            def Event(disable_timing: bool = False):  # noqa: N802
                return SimEvent(gpu)

            @staticmethod
            def get_current_stream():
                return gpu.compute

            @staticmethod
            def alloc_pinned_memory(nbytes: int):
                fake.gpu.pinned_allocs += 1
                return bytearray(nbytes)

        self.cuda = _Cuda

    def empty(self, shape, dtype) -> SimArray:
        if self.pool is None:  # fresh memory every time
            return SimArray(np.full(shape, 255 if np.dtype(dtype).kind in "iu" else np.nan, dtype=dtype))
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        block = self.pool.alloc(count * dtype.itemsize)
        owner = _Allocation()
        weakref.finalize(owner, self.pool.release, block)  # the last view dropped: back to the pool
        return SimArray(np.frombuffer(block, dtype=dtype, count=count).reshape(shape), owner)

    def scratch(self, stream: SimStream, data: np.ndarray) -> dict[str, np.ndarray]:
        """The consumer's own work: a device array written and then read by work queued on ``stream``,
        dropped by the host at once (as a temporary is). Returns where the read lands when it runs."""
        arr = self.empty(data.shape, data.dtype).a  # raw memory, as a kernel sees it: no owner held
        seen: dict[str, np.ndarray] = {}
        stream.enqueue("run", lambda: np.copyto(arr, data))
        stream.enqueue("run", lambda: seen.update(value=arr.copy()))
        return seen


def _consume(dl, gpu: SimGPU, host_sync_every: int = 0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Enqueue, per batch, compute that reads the batch (runs late, on the compute stream); the batch's
    dataset indices must arrive as a host array, usable at once."""
    seen: list[Any] = []
    for i, (x, y, idx, number) in enumerate(dl):
        assert isinstance(idx, np.ndarray) and number == i
        slot: dict[str, np.ndarray] = {"idx": idx.copy()}
        seen.append(slot)
        # the queued work holds the raw memory only (a kernel holds pointers, not arrays)
        gpu.compute.enqueue("run", lambda x=x.a, y=y.a, slot=slot: slot.update(x=x.copy(), y=y.copy()))
        if host_sync_every and (i + 1) % host_sync_every == 0:
            gpu.synchronize()
    gpu.synchronize()
    return [(s["x"], s["y"], s["idx"]) for s in seen]


@pytest.mark.parametrize("eager", ["copy", "compute"])
@pytest.mark.parametrize("sync_every", [0, 1, 3])
def test_cuda_protocol_delivers_every_batch_intact(sync_every, eager):
    ref = _host_batches(_loader())
    gpu = SimGPU(eager)
    dl = DeviceLoader(_loader(), "cuda", cupy=FakeCupy(gpu))
    got = _consume(dl, gpu, sync_every)
    assert len(got) == len(ref)
    for i, ((x, y, idx), (rx, ry, ridx)) in enumerate(zip(got, ref)):
        np.testing.assert_array_equal(x, rx, err_msg=f"batch {i}")
        np.testing.assert_array_equal(y, ry, err_msg=f"batch {i}")
        np.testing.assert_array_equal(idx, ridx, err_msg=f"batch {i}")
    # two slots, each with a pinned x and y buffer (the indices stay on the host), allocated once (the short
    # last batch reuses them)
    assert gpu.pinned_allocs == 4
    # a second epoch reuses the same buffers and is still intact
    ref2 = _host_batches(_loader_at_epoch(1))
    got2 = _consume(dl, gpu, sync_every)
    for (x, y, idx), (rx, ry, ridx) in zip(got2, ref2):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        np.testing.assert_array_equal(idx, ridx)
    assert gpu.pinned_allocs == 4


def _loader_at_epoch(epoch: int) -> DataLoader:
    dl = _loader()
    dl.set_epoch(epoch)
    return dl


@pytest.mark.parametrize("skip", ["free event", "ready wait", "pinned sync"])
def test_the_simulator_catches_each_missing_wait(monkeypatch, skip):
    """The check above has teeth: leave out any one of the three waits and batches arrive corrupted."""
    import leaflens.engine.device_loader as dlm

    gpu = SimGPU("copy" if skip == "free event" else "compute")
    cp = FakeCupy(gpu)
    real_fill = dlm._Slot.fill

    def careless_fill(self, cp_, stream, batch):
        if skip == "free event":
            self.free = SimEvent(gpu)  # never recorded: "done" at once, so the copy overwrites in-use buffers
        if skip == "pinned sync":
            self.ready.synchronize = lambda: None  # refill pinned memory while its upload may still be pending
        return real_fill(self, cp_, stream, batch)

    monkeypatch.setattr(dlm._Slot, "fill", careless_fill)
    if skip == "ready wait":
        monkeypatch.setattr(gpu.compute, "wait_event", lambda event: None)  # compute reads before the upload
    ref = _host_batches(_loader())
    got = _consume(DeviceLoader(_loader(), "cuda", cupy=cp), gpu)
    assert any(not np.array_equal(x, rx) for (x, *_), (rx, *_) in zip(got, ref))


def _check(got, ref) -> None:
    assert len(got) == len(ref)
    for i, ((x, y, idx), (rx, ry, ridx)) in enumerate(zip(got, ref)):
        np.testing.assert_array_equal(x, rx, err_msg=f"batch {i}")
        np.testing.assert_array_equal(y, ry, err_msg=f"batch {i}")
        np.testing.assert_array_equal(idx, ridx, err_msg=f"batch {i}")


def _pool_reuse_run(case: str) -> tuple[dict[str, np.ndarray], list, list, SimPool]:
    """Device memory freed by the host while queued compute work still reads it is handed to a new
    DeviceLoader buffer (its "free" event was never recorded). ``case``: "first fill" (the consumer's
    own temporary) or "new loader" (an earlier loader's buffers, as after a stop and a resume)."""
    gpu = SimGPU("copy")  # the copy stream runs at once, the compute stream only when the host syncs
    pool = SimPool()
    cp = FakeCupy(gpu, pool)
    ref = _host_batches(_loader())
    pattern = np.arange(ref[0][0].size, dtype=np.float32).reshape(ref[0][0].shape)
    seen = cp.scratch(gpu.compute, pattern)  # same size as a batch's x: the pool will hand it out again
    earlier: list = []
    if case == "new loader":
        first = DeviceLoader(_loader(), "cuda", cupy=cp)
        it = iter(first)
        for _k, (x, y, idx, _) in zip(range(2), it):  # two batches, then the run stops (and is resumed)
            slot: dict[str, np.ndarray] = {"idx": idx.copy()}
            earlier.append(slot)
            gpu.compute.enqueue("run", lambda x=x.a, y=y.a, slot=slot: slot.update(x=x.copy(), y=y.copy()))
        it.close()
        del first, it, x, y
        gc.collect()
    got = _consume(DeviceLoader(_loader(), "cuda", cupy=cp), gpu)
    return seen, got, [(s["x"], s["y"], s["idx"]) for s in earlier], pool


@pytest.mark.parametrize("case", ["first fill", "new loader"])
def test_new_device_buffers_wait_for_queued_compute_on_reused_pool_memory(case):
    ref = _host_batches(_loader())
    seen, got, earlier, pool = _pool_reuse_run(case)
    assert pool.reused >= 1  # the hazard was set up: a new loader buffer got memory still in use
    np.testing.assert_array_equal(seen["value"], np.arange(ref[0][0].size, dtype=np.float32).reshape(ref[0][0].shape))
    _check(got, ref)
    _check(earlier, ref[:len(earlier)])


@pytest.mark.parametrize("case", ["first fill", "new loader"])
def test_the_pool_model_catches_a_copy_that_does_not_wait_after_allocating(monkeypatch, case):
    """The check above has teeth: without the wait after allocating (the code before this fix), the
    upload overwrites memory that queued compute work reads."""
    import leaflens.engine.device_loader as dlm

    monkeypatch.setattr(dlm, "_copy_waits_for_compute", lambda cp, stream: None)
    ref = _host_batches(_loader())
    seen, got, earlier, _ = _pool_reuse_run(case)
    pattern = np.arange(ref[0][0].size, dtype=np.float32).reshape(ref[0][0].shape)
    intact = [np.array_equal(seen["value"], pattern)]
    intact += [np.array_equal(x, rx) for (x, *_), (rx, *_) in zip(got + earlier, ref + ref[:len(earlier)])]
    assert not all(intact)


def test_upload_moves_prepared_tuples_and_passes_none_through():
    gpu = SimGPU()
    dl = DeviceLoader(_loader(), "cuda", cupy=FakeCupy(gpu))
    feats = [np.full((4, 5), i, np.float32) for i in range(3)]
    out = []
    for f, none in dl.upload((f, None) for f in feats):
        assert none is None and isinstance(f, SimArray)
        slot: dict[str, np.ndarray] = {}
        out.append(slot)
        gpu.compute.enqueue("run", lambda f=f, slot=slot: slot.update(f=f.a.copy()))
    gpu.synchronize()
    for i, slot in enumerate(out):
        np.testing.assert_array_equal(slot["f"], feats[i])


# ---- a real GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_yields_the_same_batches_as_the_cpu_loader():
    import cupy as cp

    ref = _host_batches(_loader(n=203, batch=16))
    dl = DeviceLoader(_loader(n=203, batch=16), "cuda")
    got = []
    for x, y, idx, _ in dl:
        assert isinstance(x, cp.ndarray) and x.dtype == np.float32 and y.dtype == np.int64
        assert isinstance(idx, np.ndarray)  # the dataset indices stay on the host
        got.append((float(x.sum()), cp.asnumpy(x), cp.asnumpy(y), idx.copy()))  # compute on it, then copy out
    assert len(got) == len(ref)
    for (s, x, y, idx), (rx, ry, ridx) in zip(got, ref):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        np.testing.assert_array_equal(idx, ridx)
        assert s == pytest.approx(float(rx.sum()), rel=1e-4)
