"""GPU benchmark: each hand-written kernel beside its CuPy / cuBLAS equivalent, on the same GPU.

For every kernel family the same inputs go through our kernel (``kernels/*_cuda``) and through the
obvious CuPy expression of the same maths (cuBLAS for the matrix product); the outputs are compared
(max |difference|, so a fast wrong kernel cannot hide) and timed with CUDA events. Rates are
effective: GFLOP/s for SGEMM, and for the memory-bound kernels GB/s counting the bytes that must
at least be read and written once.

SGEMM is the educational kernel of the set: cuBLAS is expected to win, and the engine keeps
``cupy.matmul`` (cuBLAS) for its convolutions and linear layers wherever it is faster; the table says
by how much.

Then the student training step (benchmarks/engine_speed.py's network, batch 64 and 256, 64x64) in the
engine on the GPU beside PyTorch on the same GPU (when torch with CUDA is importable), in float32 and
in mixed precision: images/s and peak GPU memory for both. The final JSON line carries them as flat
keys (``engine_step_img_s_b64_fp32``, ``torch_step_img_s_b256_amp``, ``engine_peak_mb_b64_amp``, ...) and
in detail under ``train_step``.

Without a GPU it prints why and ends with a JSON line whose figures are null and whose ``skipped``
holds the reason. The last line of output is always one JSON object.

``host_syncs_per_step`` (with or without a GPU): the most host reads of device values in one step of
the pipeline's student training (``leaflens.pipeline.host_syncs``, counted on the CPU with the engine's
CuPy stand-in; each read makes the host wait for the GPU), and ``host_syncs_mean_per_step``.

With ``--require-gpu`` (``make gpu-check`` uses it) the benchmark is also a check, exit status 1 when: there
is no usable GPU; a kernel the engine dispatches (all but SGEMM, see :data:`NOT_DISPATCHED`) takes more than
:data:`SLOWDOWN_LIMIT` times its generic CuPy expression's time, or gives a non-finite difference; or the
engine's training step raises. The reasons are printed and listed under ``failures`` in the JSON line.

    python benchmarks/gpu.py [--repeats 20] [--sizes full|tiny] [--no-train-step] [--require-gpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import Any

import numpy as np

from leaflens.kernels import _cuda
from leaflens.kernels.activation_grad import activation_grad_cuda
from leaflens.kernels.fused_optim import adamw_cuda, ema_cuda, sgd_momentum_cuda
from leaflens.kernels.im2col import col2im_cuda, im2col_cuda
from leaflens.kernels.l2norm import l2norm_backward_cuda, l2norm_forward_cuda
from leaflens.kernels.maxpool import maxpool_backward_cuda, maxpool_forward_cuda
from leaflens.kernels.sgemm import sgemm_cuda
from leaflens.kernels.softmax_xent import softmax_xent_backward_cuda, softmax_xent_forward_cuda
from leaflens.pipeline.cli.runtime import configure_process

KERNEL_NAMES = [
    "sgemm",
    "sgemm_conv_shape",
    "softmax_xent",
    "relu_grad_f32",
    "relu_grad_f16",
    "l2norm",
    "im2col",
    "col2im",
    "maxpool",
    "sgd_momentum",
    "adamw",
    "ema",
]

# Problem sizes: "full" for a real GPU, "tiny" for the CPU smoke test of this script (emulated kernels).
SIZES = {
    "full": dict(
        gemm=(2048, 2048, 2048),
        conv_gemm=(64 * 32 * 32, 288, 64),
        xent=(8192, 1000),
        elems=1 << 24,
        l2=(8192, 1280),
        img=(64, 64, 64, 32),
        pool=(64, 64, 64, 32),
        params=1 << 23,
    ),
    "tiny": dict(
        gemm=(70, 33, 65),
        conv_gemm=(96, 27, 8),
        xent=(6, 10),
        elems=700,
        l2=(4, 40),
        img=(1, 5, 6, 3),
        pool=(1, 6, 6, 2),
        params=600,
    ),
}


@dataclass
class Case:
    """One kernel versus its CuPy equivalent on the same inputs."""

    name: str
    shape: str
    ours: Callable[[], Any]
    theirs: Callable[[], Any]
    work: float  # bytes moved (memory-bound) or floating-point operations (SGEMM)
    unit: str  # "GB/s" or "GFLOP/s"
    compare: Callable[[Any, Any], float] | None = None  # max |difference| of the two outputs
    note: str = ""


def _maxdiff(xp: Any, a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        return max(_maxdiff(xp, x, y) for x, y in zip(a, b))
    return float(xp.max(xp.abs(xp.asarray(a, dtype=xp.float32) - xp.asarray(b, dtype=xp.float32))))


# ---- CuPy expressions of the same maths (they also run on NumPy, which the smoke test uses) ----------
def xent_composed(xp: Any, z: Any, t: Any) -> tuple[Any, Any]:
    n = z.shape[0]
    m = z.max(axis=1, keepdims=True)
    lse = m + xp.log(xp.exp(z - m).sum(axis=1, keepdims=True))
    loss = (lse[:, 0] - z[xp.arange(n), t]).mean()
    g = xp.exp(z - lse)
    g[xp.arange(n), t] -= 1
    return loss, g / n


def l2norm_composed(xp: Any, x: Any, gy: Any, eps: float) -> tuple[Any, Any]:
    norm = xp.sqrt((x * x).sum(axis=1, keepdims=True))
    denom = xp.maximum(norm, eps)
    y = x / denom
    proj = (gy * y).sum(axis=1, keepdims=True) * (norm >= eps)
    return y, (gy - y * proj) / denom


def im2col_composed(xp: Any, x: Any, k: int, pad: int) -> Any:
    n, h, w, c = x.shape
    xpad = xp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    ho, wo = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    cols = xp.empty((n, ho, wo, k, k, c), dtype=x.dtype)
    for i in range(k):
        for j in range(k):
            cols[:, :, :, i, j, :] = xpad[:, i : i + ho, j : j + wo, :]
    return cols.reshape(n * ho * wo, k * k * c)


def col2im_composed(xp: Any, cols: Any, shape: tuple[int, ...], k: int, pad: int) -> Any:
    n, h, w, c = shape
    ho, wo = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    blocks = cols.reshape(n, ho, wo, k, k, c)
    gx = xp.zeros((n, h + 2 * pad, w + 2 * pad, c), dtype=cols.dtype)
    for i in range(k):
        for j in range(k):
            gx[:, i : i + ho, j : j + wo, :] += blocks[:, :, :, i, j, :]
    return gx[:, pad : pad + h, pad : pad + w, :]


def maxpool2_composed(xp: Any, x: Any, gy: Any) -> tuple[Any, Any]:
    """2x2 stride-2 max-pool forward (maximum chain) and backward (first tap equal to the max)."""
    taps = [x[:, i::2, j::2, :] for i in range(2) for j in range(2)]
    y = taps[0].copy()
    for t in taps[1:]:
        xp.maximum(y, t, out=y)
    gx = xp.zeros_like(x)
    unclaimed = xp.ones(y.shape, dtype=bool)
    for t, (i, j) in zip(taps, [(0, 0), (0, 1), (1, 0), (1, 1)]):
        hit = (t == y) & unclaimed
        gx[:, i::2, j::2, :] = xp.where(hit, gy, 0)
        unclaimed &= ~hit
    return y, gx


def sgd_composed(p: Any, g: Any, buf: Any, lr: float, mom: float, wd: float) -> None:
    d = g + wd * p
    buf *= mom
    buf += d
    p -= lr * buf


def adamw_composed(xp: Any, p: Any, g: Any, m: Any, v: Any, step: int, lr: float, wd: float) -> None:
    b1, b2, eps = 0.9, 0.999, 1e-8
    p *= 1 - lr * wd
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    denom = xp.sqrt(v) / np.sqrt(1 - b2**step) + eps
    p -= (lr / (1 - b1**step)) * m / denom


# ---- the cases ----------------------------------------------------------------------------------------------
def build_cases(xp: Any, sizes: dict[str, Any]) -> list[Case]:
    rng = np.random.default_rng(0)

    def put(a: np.ndarray) -> Any:
        return xp.asarray(a)

    f32 = np.float32
    cases: list[Case] = []

    for name, (m, k, n) in (("sgemm", sizes["gemm"]), ("sgemm_conv_shape", sizes["conv_gemm"])):
        a = put(rng.standard_normal((m, k)).astype(f32))
        b = put(rng.standard_normal((k, n)).astype(f32))
        cases.append(
            Case(
                name,
                f"{m}x{k} @ {k}x{n}",
                lambda a=a, b=b: sgemm_cuda(a, b),
                lambda a=a, b=b: xp.matmul(a, b),
                2.0 * m * n * k,
                "GFLOP/s",
                lambda o, t: _maxdiff(xp, o, t),
                "vs cuBLAS; the engine keeps cuBLAS where it is faster",
            )
        )

    n, c = sizes["xent"]
    z = put((rng.standard_normal((n, c)) * 3).astype(f32))
    t = put(rng.integers(0, c, n).astype(np.int64))

    def xent_ours(z=z, t=t):
        loss, stats = softmax_xent_forward_cuda(z, t, validate=False)
        return loss, softmax_xent_backward_cuda(z, t, stats, 1.0)

    cases.append(
        Case(
            "softmax_xent",
            f"{n}x{c} fwd+bwd",
            xent_ours,
            lambda z=z, t=t: xent_composed(xp, z, t),
            3.0 * n * c * 4,
            "GB/s",
            lambda o, r: _maxdiff(xp, o, r),
        )
    )

    e = sizes["elems"]
    for dt, label in ((np.float32, "f32"), (np.float16, "f16")):
        y = put(np.maximum(rng.standard_normal(e), 0).astype(dt))
        gy = put(rng.standard_normal(e).astype(dt))
        cases.append(
            Case(
                f"relu_grad_{label}",
                f"{e} elements",
                lambda y=y, gy=gy: activation_grad_cuda("relu", y, gy),
                lambda y=y, gy=gy: xp.where(y > 0, gy, xp.zeros((), dtype=gy.dtype)),
                3.0 * e * np.dtype(dt).itemsize,
                "GB/s",
                lambda o, r: _maxdiff(xp, o, r),
            )
        )

    n, d = sizes["l2"]
    x = put(rng.standard_normal((n, d)).astype(f32))
    gy = put(rng.standard_normal((n, d)).astype(f32))

    def l2_ours(x=x, gy=gy):
        y, norm = l2norm_forward_cuda(x, 1e-12)
        return y, l2norm_backward_cuda(y, gy, norm, 1e-12)

    cases.append(
        Case(
            "l2norm",
            f"{n}x{d} fwd+bwd",
            l2_ours,
            lambda x=x, gy=gy: l2norm_composed(xp, x, gy, 1e-12),
            5.0 * n * d * 4,  # fwd: read x, write y; bwd: read y, gy, write gx
            "GB/s",
            lambda o, r: _maxdiff(xp, o, r),
        )
    )

    shape = sizes["img"]
    x = put(rng.standard_normal(shape).astype(f32))
    nb, h, w, ch = shape
    cols_elems = nb * h * w * 9 * ch
    cases.append(
        Case(
            "im2col",
            f"{shape} k3 s1 p1",
            lambda x=x: im2col_cuda(x, 3, 1, 1),
            lambda x=x: im2col_composed(xp, x, 3, 1),
            4.0 * (cols_elems + x.size),
            "GB/s",
            lambda o, r: _maxdiff(xp, o, r),
        )
    )
    g = put(rng.standard_normal((nb * h * w, 9 * ch)).astype(f32))
    cases.append(
        Case(
            "col2im",
            f"{shape} k3 s1 p1",
            lambda g=g, shape=shape: col2im_cuda(g, shape, 3, 1, 1),
            lambda g=g, shape=shape: col2im_composed(xp, g, shape, 3, 1),
            4.0 * (cols_elems + x.size),
            "GB/s",
            lambda o, r: _maxdiff(xp, o, r),
        )
    )

    shape = sizes["pool"]
    x = put(rng.standard_normal(shape).astype(f32))
    gy = put(rng.standard_normal((shape[0], shape[1] // 2, shape[2] // 2, shape[3])).astype(f32))

    def pool_ours(x=x, gy=gy, shape=shape):
        y, idx = maxpool_forward_cuda(x, 2, 2, 0)
        return y, maxpool_backward_cuda(gy, idx, shape, 2, 2, 0)

    cases.append(
        Case(
            "maxpool",
            f"{shape} 2x2/2 fwd+bwd",
            pool_ours,
            lambda x=x, gy=gy: maxpool2_composed(xp, x, gy),
            4.0 * (x.size + gy.size) * 2,  # fwd: read x, write y (+ idx); bwd: read gy (+ idx), write gx
            "GB/s",
            lambda o, r: _maxdiff(xp, o, r),
        )
    )

    p_n = sizes["params"]
    p0 = rng.standard_normal(p_n).astype(f32)
    grad = put(rng.standard_normal(p_n).astype(f32))
    p1, buf1, p2, buf2 = put(p0), put(np.zeros(p_n, f32)), put(p0), put(np.zeros(p_n, f32))

    def sgd_ours(p=p1, g=grad, b=buf1):
        sgd_momentum_cuda(p, g, b, lr=1e-3, momentum=0.9, weight_decay=1e-4)
        return p

    def sgd_theirs(p=p2, g=grad, b=buf2):
        sgd_composed(p, g, b, 1e-3, 0.9, 1e-4)
        return p

    # run_cases calls each side once before timing, so both buffers have taken exactly one step when compared
    same = lambda o, r: _maxdiff(xp, o, r)  # noqa: E731
    cases.append(Case("sgd_momentum", f"{p_n} params", sgd_ours, sgd_theirs, 20.0 * p_n, "GB/s", same))
    pa, ma, va = put(p0), put(np.zeros(p_n, f32)), put(np.zeros(p_n, f32))
    pb, mb, vb = put(p0), put(np.zeros(p_n, f32)), put(np.zeros(p_n, f32))
    steps = {"ours": 0, "theirs": 0}

    def adamw_ours():
        steps["ours"] += 1
        adamw_cuda(pa, grad, ma, va, step=steps["ours"], lr=1e-3, weight_decay=1e-2)
        return pa

    def adamw_theirs():
        steps["theirs"] += 1
        adamw_composed(xp, pb, grad, mb, vb, steps["theirs"], 1e-3, 1e-2)
        return pb

    cases.append(Case("adamw", f"{p_n} params", adamw_ours, adamw_theirs, 28.0 * p_n, "GB/s", same))
    avg_a, avg_b = put(p0), put(p0)
    live = put(rng.standard_normal(p_n).astype(f32))

    def ema_ours():
        ema_cuda(avg_a, live, decay=0.99)
        return avg_a

    def ema_theirs():  # ModelEMA's xp arithmetic
        avg_b[...] *= 0.99
        avg_b[...] += 0.01 * live
        return avg_b

    # bytes: read the average and the weights, write the average
    cases.append(Case("ema", f"{p_n} params", ema_ours, ema_theirs, 12.0 * p_n, "GB/s", same))
    return cases


# ---- timing -------------------------------------------------------------------------------------------------
def gpu_timer(cp: Any) -> Callable[[Callable[[], Any], int], float]:
    """Milliseconds per call of ``fn``, from CUDA events around ``repeats`` calls (median of 3 rounds)."""

    def timer(fn: Callable[[], Any], repeats: int) -> float:
        fn()  # warm-up: compiles kernels, fills the memory pool
        cp.cuda.Device().synchronize()
        rounds = []
        for _ in range(3):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            rounds.append(cp.cuda.get_elapsed_time(start, end) / repeats)
        return median(rounds)

    return timer


def cpu_timer(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def run_cases(cases: list[Case], timer: Callable[[Callable[[], Any], int], float], repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in cases:
        diff = case.compare(case.ours(), case.theirs()) if case.compare else None
        ours_ms = timer(case.ours, repeats)
        theirs_ms = timer(case.theirs, repeats)
        scale = 1e-9 / 1e-3  # (work / ms) -> G units per second
        results[case.name] = {
            "shape": case.shape,
            "unit": case.unit,
            "ours_ms": ours_ms,
            "cupy_ms": theirs_ms,
            "ours_rate": case.work / ours_ms * scale,
            "cupy_rate": case.work / theirs_ms * scale,
            "speedup_vs_cupy": theirs_ms / ours_ms,
            "max_abs_diff": diff,
            "note": case.note,
        }
    return results


def print_table(results: dict[str, Any]) -> None:
    head = f"{'kernel':<17} {'shape':<28} {'ours ms':>9} {'cupy ms':>9} {'ours':>10} {'cupy':>10} {'unit':<8} {'x':>6}"
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        print(
            f"{name:<17} {r['shape']:<28} {r['ours_ms']:>9.3f} {r['cupy_ms']:>9.3f} {r['ours_rate']:>10.1f} "
            f"{r['cupy_rate']:>10.1f} {r['unit']:<8} {r['speedup_vs_cupy']:>6.2f}"
            + (f"  max|diff| {r['max_abs_diff']:.2e}" if r["max_abs_diff"] is not None else "")
        )
    print("x = CuPy time / our time (> 1: our kernel is faster). Rates are effective GB/s or GFLOP/s.")
    if "sgemm" in results:
        print(
            f"SGEMM: our tiled kernel reaches {results['sgemm']['ours_rate'] / results['sgemm']['cupy_rate']:.0%} of "
            "cuBLAS; the engine uses cuBLAS (cupy.matmul) for its matrix products."
        )


# ---- the --require-gpu verdict -------------------------------------------------------------------------------
#: A dispatched kernel may take at most this many times its generic CuPy expression's time.
SLOWDOWN_LIMIT = 1.2
#: Kernels the engine does not dispatch (engine/ops/_kernels.py), so the limit does not apply to them.
NOT_DISPATCHED = {
    "sgemm": "the engine keeps cuBLAS (cupy.matmul) for matrix products",
    "sgemm_conv_shape": "the engine keeps cuBLAS (cupy.matmul) for matrix products",
}


def kernel_failures(results: dict[str, Any], limit: float = SLOWDOWN_LIMIT) -> list[str]:
    """One line per dispatched kernel that is slower than its CuPy fallback by more than ``limit`` times, or
    whose output differs from it by a non-finite amount (NaN/inf: a broken kernel); [] when all pass."""
    failures = []
    for name, r in results.items():
        diff = r.get("max_abs_diff")
        if diff is not None and not np.isfinite(diff):
            failures.append(f"{name}: our kernel and the CuPy expression differ by {diff}")
        if name in NOT_DISPATCHED:
            continue
        if r["ours_ms"] > limit * r["cupy_ms"]:
            failures.append(f"{name}: our kernel takes {r['ours_ms']:.3f} ms, {r['ours_ms'] / r['cupy_ms']:.2f}x the "
                            f"generic CuPy fallback's {r['cupy_ms']:.3f} ms (limit {limit:g}x)")
    return failures


def train_failures(train: dict[str, Any] | None) -> list[str]:
    """One line per training-step case where the engine raised (a PyTorch failure is not the engine's)."""
    if train is None:
        return []
    return [f"training step {key}: the engine raised {case['engine_error']}"
            for key, case in train["cases"].items() if "engine_error" in case]


# ---- the student training step: engine vs PyTorch on the same GPU ---------------------------------------------
TRAIN_BATCHES = (64, 256)
TRAIN_SIZE = 64
TRAIN_CLASSES = 10
PRECISIONS = ("fp32", "amp")


def train_step_keys() -> list[str]:
    """The flat keys the final JSON line carries for the training-step section (null without a GPU)."""
    keys = []
    for b in TRAIN_BATCHES:
        for prec in PRECISIONS:
            keys += [f"engine_step_img_s_b{b}_{prec}", f"torch_step_img_s_b{b}_{prec}",
                     f"engine_peak_mb_b{b}_{prec}", f"torch_peak_mb_b{b}_{prec}"]
    return keys


def engine_step(cp: Any, batch: int, size: int, use_amp: bool) -> Callable[[], None]:
    """One training step of the engine's student (benchmarks/engine_speed.py's network: StudentCNN with its
    default widths 32-64-128; cross-entropy; SGD with momentum) on the GPU, mixed precision or float32."""
    from leaflens.engine import Tensor, ops
    from leaflens.engine.amp import GradScaler, train_step
    from leaflens.engine.optim import SGD
    from leaflens.pipeline.models.student import StudentCNN

    model = StudentCNN(TRAIN_CLASSES, rng=np.random.default_rng(0))
    model.to("cuda")
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = GradScaler(enabled=use_amp)
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((batch, size, size, 3), dtype=np.float32))
    y = cp.asarray(rng.integers(0, TRAIN_CLASSES, batch))

    def step() -> None:  # the training loop's own step (leaflens.engine.amp.train_step), without clipping
        train_step(opt, scaler, lambda: ops.cross_entropy(model(Tensor(x)), y))

    return step


def torch_step(torch: Any, batch: int, size: int, use_amp: bool) -> Callable[[], None]:
    """The same network and step in PyTorch eager on the GPU, channels_last (NHWC in memory, like the
    engine; the layout cuDNN prefers with float16), torch.autocast + GradScaler for mixed precision."""
    from torch import nn

    torch.manual_seed(0)

    def block(a: int, b: int) -> list[Any]:
        return [nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(), nn.MaxPool2d(2)]

    model = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(128, TRAIN_CLASSES)).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, TRAIN_CLASSES, (batch,), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp) if hasattr(torch, "amp") and hasattr(
        torch.amp, "GradScaler") else torch.cuda.amp.GradScaler(enabled=use_amp)
    lossf = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            loss = lossf(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def wall_timer(sync: Callable[[], None]) -> Callable[[Callable[[], Any], int], float]:
    """Milliseconds per call, wall clock between device synchronisations (median of 3 rounds): the same
    clock for both frameworks, and it counts the host work between kernels as well as the kernels."""

    def timer(fn: Callable[[], Any], repeats: int) -> float:
        fn()  # warm-up: kernel compilation, cuDNN autotuning, memory pools
        sync()
        rounds = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            sync()
            rounds.append((time.perf_counter() - t0) / repeats * 1e3)
        return median(rounds)

    return timer


def _torch_cuda() -> tuple[Any, str | None]:
    try:
        import torch
    except Exception as exc:  # not installed, or a broken install
        return None, f"PyTorch is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} sees no CUDA device (a CPU-only build?)"
    return torch, None


def train_step_benchmark(cp: Any, repeats: int = 20) -> dict[str, Any]:
    """Images/s and peak GPU memory of the student training step, engine and PyTorch, float32 and mixed
    precision, batch 64 and 256 at 64x64. Peak memory: CuPy's pool (emptied before, its size after: what the
    engine holds) and ``torch.cuda.max_memory_allocated`` (also ``max_memory_reserved``, PyTorch's pool)."""
    import gc

    pool = cp.get_default_memory_pool()
    engine_timer = wall_timer(lambda: cp.cuda.Device().synchronize())
    torch, torch_reason = _torch_cuda()
    out: dict[str, Any] = {"batches": list(TRAIN_BATCHES), "size": TRAIN_SIZE, "repeats": repeats,
                           "torch_version": None if torch is None else torch.__version__, "torch_skipped": torch_reason,
                           "cases": {}}
    for b in TRAIN_BATCHES:
        for prec in PRECISIONS:
            use_amp = prec == "amp"
            case: dict[str, Any] = {}
            gc.collect()
            pool.free_all_blocks()
            base = pool.used_bytes()
            try:
                step = engine_step(cp, b, TRAIN_SIZE, use_amp)
                ms = engine_timer(step, repeats)
                cp.cuda.Device().synchronize()
                case["engine_ms"] = ms
                case["engine_img_s"] = b / (ms / 1e3)
                case["engine_peak_mb"] = (pool.total_bytes() - base) / 2**20
                del step
            except Exception as exc:  # report and go on: the kernel table above still stands
                case["engine_error"] = f"{type(exc).__name__}: {exc}"
            gc.collect()
            pool.free_all_blocks()
            if torch is not None:
                try:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    tstep = torch_step(torch, b, TRAIN_SIZE, use_amp)
                    ms = wall_timer(torch.cuda.synchronize)(tstep, repeats)
                    case["torch_ms"] = ms
                    case["torch_img_s"] = b / (ms / 1e3)
                    case["torch_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
                    case["torch_reserved_peak_mb"] = torch.cuda.max_memory_reserved() / 2**20
                    del tstep
                    torch.cuda.empty_cache()
                except Exception as exc:
                    case["torch_error"] = f"{type(exc).__name__}: {exc}"
            out["cases"][f"b{b}_{prec}"] = case
    return out


def train_step_flat(train: dict[str, Any] | None) -> dict[str, Any]:
    """The final JSON line's flat keys from :func:`train_step_benchmark`'s result (None: all null)."""
    flat: dict[str, Any] = {k: None for k in train_step_keys()}
    if train is None:
        return flat
    for b in TRAIN_BATCHES:
        for prec in PRECISIONS:
            case = train["cases"].get(f"b{b}_{prec}", {})
            for who in ("engine", "torch"):
                img_s, peak = case.get(f"{who}_img_s"), case.get(f"{who}_peak_mb")
                flat[f"{who}_step_img_s_b{b}_{prec}"] = None if img_s is None else round(img_s, 1)
                flat[f"{who}_peak_mb_b{b}_{prec}"] = None if peak is None else round(peak, 1)
    return flat


def print_train_table(train: dict[str, Any]) -> None:
    print(f"\nstudent training step ({TRAIN_SIZE}x{TRAIN_SIZE}x3, widths 32-64-128, SGD momentum), wall clock "
          f"between syncs, median of 3 rounds of {train['repeats']} steps")
    head = f"{'batch':>5} {'precision':<9} {'engine img/s':>13} {'torch img/s':>12} {'engine/torch':>12} " \
           f"{'engine MiB':>11} {'torch MiB':>10}"
    print(head)
    print("-" * len(head))

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for b in TRAIN_BATCHES:
        for prec in PRECISIONS:
            c = train["cases"][f"b{b}_{prec}"]
            e, t = c.get("engine_img_s"), c.get("torch_img_s")
            ratio = e / t if e and t else None
            print(f"{b:>5} {prec:<9} {num(e, '.0f'):>13} {num(t, '.0f'):>12} {num(ratio, '.2f'):>12} "
                  f"{num(c.get('engine_peak_mb'), '.0f'):>11} {num(c.get('torch_peak_mb'), '.0f'):>10}")
            for who in ("engine", "torch"):
                if f"{who}_error" in c:
                    print(f"      {who} failed: {c[f'{who}_error']}")
    if train["torch_skipped"]:
        print(f"PyTorch columns empty: {train['torch_skipped']}")
    print("engine MiB: CuPy memory pool after the steps (what the engine holds); torch MiB: max_memory_allocated")


def skipped_json(reason: str) -> dict[str, Any]:
    return {"skipped": reason, "device": None, "kernels": {name: None for name in KERNEL_NAMES}, "train_step": None,
            **train_step_flat(None)}


def host_syncs_keys() -> dict[str, Any]:
    """The JSON line's host-synchronisation keys, measured on the CPU (needs no GPU); prints one line."""
    from leaflens.pipeline.host_syncs import measure_host_syncs  # noqa: PLC0415

    report = measure_host_syncs()
    print(f"host reads per training step (CuPy stand-in, {len(report.per_step)} steps): at most "
          f"{report.max_per_step}, mean {report.mean_per_step:.2f} (the progress bar reads every "
          f"{report.log_every} steps)")
    return {"host_syncs_per_step": report.max_per_step, "host_syncs_mean_per_step": round(report.mean_per_step, 3)}


def main(argv: list[str] | None = None) -> int:
    configure_process(engine=True)  # what the `leaflens` command runs with
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per round")
    parser.add_argument("--sizes", choices=sorted(SIZES), default="full")
    parser.add_argument("--no-train-step", action="store_true", help="skip the engine-vs-PyTorch training step")
    parser.add_argument("--require-gpu", action="store_true",
                        help=f"exit 1 without a usable GPU, when a dispatched kernel is over {SLOWDOWN_LIMIT:g}x "
                        "slower than its CuPy fallback, or when the engine's training step fails")
    args = parser.parse_args(argv)

    ok, reason = _cuda.gpu_probe()
    if not ok:
        print(f"benchmarks/gpu.py: skipped, no GPU: {reason}")
        print("training step (engine vs PyTorch, float32 and mixed precision): not measured, no GPU")
        print(json.dumps({**skipped_json(reason), **host_syncs_keys()}))
        if args.require_gpu:
            print(f"benchmarks/gpu.py: FAILED (--require-gpu): no usable GPU: {reason}", file=sys.stderr)
            return 1
        return 0
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    device = f"{name} (compute capability {props['major']}.{props['minor']})"
    print(f"GPU: {device}, CuPy {cp.__version__}")
    results = run_cases(build_cases(cp, SIZES[args.sizes]), gpu_timer(cp), args.repeats)
    print_table(results)
    train = None
    if args.no_train_step:
        print("training step (engine vs PyTorch): skipped (--no-train-step)")
    else:
        train = train_step_benchmark(cp, args.repeats)
        print_train_table(train)
    slow = kernel_failures(results)
    failures = slow + train_failures(train)
    print(f"\nkernels dispatched by the engine vs their CuPy fallback (limit {SLOWDOWN_LIMIT:g}x slower): "
          + ("FAILED" if slow else "all within"))
    for line in failures:
        print(f"  FAILED {line}")
    syncs = host_syncs_keys()
    print(json.dumps({"skipped": None, "device": device, "kernels": results, "train_step": train,
                      **train_step_flat(train), "failures": failures, **syncs}))
    return 1 if args.require_gpu and failures else 0


if __name__ == "__main__":
    sys.exit(main())
