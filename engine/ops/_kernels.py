"""The one place where the engine's ops hand work to the hand-written CUDA kernels in ``kernels/``.

Every function here takes the op's array module ``xp`` first and answers in one of two ways: the
kernel's result, or ``None`` (``False`` for the optimiser steps) meaning "no kernel applies, run the
generic ``xp`` code". For NumPy arrays the answer is always None after a single identity test, so the
CPU path computes exactly what it computed before these kernels were wired in. On CuPy arrays a
kernel runs when kernels are enabled, ``leaflens.kernels._cuda.gpu_available()`` says the device works, and
the kernel supports the case (dtype float32/float16, the options the kernel implements, sizes that fit
its 32-bit indices); anything else falls back.

Switching the kernels off (comparisons, debugging, a suspected kernel bug): set
``LEAFLENS_NO_KERNELS=1`` in the environment (the default for every thread), or use
``with use_kernels(False): ...`` in code. The ops then run the same generic CuPy code that runs without
these kernels. ``use_kernels`` is per thread, like ``no_grad`` and ``autocast``: a comparison run with
the kernels off in one thread never changes what a training or serving thread beside it computes.

What is dispatched (forward/backward pairs keep what the kernel's backward needs):

* ``cross_entropy``, reduction 'mean' or 'sum': integer targets with optional label smoothing and
  ``ignore_index``, and soft targets (knowledge distillation): ``softmax_xent.cu`` (fused log-softmax +
  loss, and the fused gradient). Reduction 'none' and smoothed soft targets stay on xp.
* ReLU / LeakyReLU (slope > 0) / ReLU6 backward from the saved output: ``activation_grad.cu``.
* ``l2_normalize`` over the last axis: ``l2norm.cu``.
* ``max_pool2d``: ``maxpool.cu``, which is NHWC like the engine, so no transpose is needed; the
  forward records uint8 tap indices that the backward scatters through.
* Convolution's ``im2col``/``col2im``: ``im2col.cu``, whose column layout (row ``(n*Ho+ho)*Wo+wo``,
  column ``(i*kw+j)*C+c``) is exactly the engine's NHWC im2col, so the kernel replaces the strided
  copies one for one; it reads (and col2im drops) the zero padding itself, so no padded copy of the
  activations is made. The matrix products stay on ``cupy.matmul`` (cuBLAS).
* SGD with momentum (dampening 0) and Adam/AdamW on float32 parameters, and the running average of the
  weights (``ModelEMA``): ``fused_optim.cu``.

``dispatch_counts()`` tells how often each kernel family was chosen (tests use it to prove that a
comparison really exercised the kernel, and it is handy when profiling).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from leaflens.engine.deferred import require
from leaflens.kernels import _cuda
from leaflens.kernels.activation_grad import activation_grad_cuda
from leaflens.kernels.fused_optim import adamw_cuda, ema_cuda, sgd_momentum_cuda
from leaflens.kernels.im2col import col2im_cuda, im2col_cuda
from leaflens.kernels.l2norm import l2norm_backward_cuda, l2norm_forward_cuda
from leaflens.kernels.maxpool import maxpool_backward_cuda, maxpool_forward_cuda
from leaflens.kernels.softmax_xent import softmax_xent_backward_cuda, softmax_xent_forward_cuda

#: Set to 1 (any value but "" or "0") to keep the engine's ops on generic CuPy code.
DISABLE_ENV = "LEAFLENS_NO_KERNELS"

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))
_F32 = np.dtype(np.float32)
_INT32_MAX = 2**31 - 1

_switch = threading.local()  # .forced: set by use_kernels() in this thread; absent or None: the environment decides
_counts: Counter[str] = Counter()

# Tests only: route NumPy arrays through the kernel wrappers too, with leaflens.kernels._cuda patched to the
# CPU emulator (tests/kernels/kernel_emu.py), so the wiring is exercised on machines without a GPU.
_EMULATE_ON_NUMPY = False


# ---- switches ------------------------------------------------------------------------------------
def kernels_enabled() -> bool:
    """Whether dispatch to the CUDA kernels is allowed in this thread (``use_kernels`` wins over the
    environment's ``LEAFLENS_NO_KERNELS``, which is every thread's default)."""
    forced = getattr(_switch, "forced", None)
    if forced is not None:
        return forced
    return os.environ.get(DISABLE_ENV, "") in ("", "0")


@contextmanager
def use_kernels(enabled: bool) -> Iterator[None]:
    """Force kernel dispatch on or off for the calling thread inside the ``with`` block (other threads
    keep their own setting)."""
    before = getattr(_switch, "forced", None)
    _switch.forced = bool(enabled)
    try:
        yield
    finally:
        _switch.forced = before


def active(xp: Any) -> bool:
    """True when arrays of module ``xp`` should go to the CUDA kernels (never for NumPy)."""
    if xp is np and not _EMULATE_ON_NUMPY:
        return False
    if not kernels_enabled():
        return False
    return xp is np or _cuda.gpu_available()


def dispatch_counts() -> Counter[str]:
    """How many times each kernel family was dispatched in this process (a copy)."""
    return Counter(_counts)


def _hit(name: str) -> None:
    _counts[name] += 1


def _contig(xp: Any, a: Any) -> Any:
    """``a`` itself when C-contiguous (the kernels read raw pointers), else a contiguous copy."""
    return a if a.flags.c_contiguous else xp.ascontiguousarray(a)


def _fits_int32(*sizes: int) -> bool:
    return all(0 <= int(s) <= _INT32_MAX for s in sizes)


# ---- cross-entropy ---------------------------------------------------------------------------------
@dataclass
class SoftmaxXentSaved:
    """What the fused backward needs from the fused forward."""

    logits: Any  # contiguous (N, C) float32/float16
    targets: Any  # contiguous (N,) int64 class indices, or (N, C) float32 soft targets
    stats: Any  # (N, 2) float32: per-row log-sum-exp and target mass (0 on an ignored row)
    label_smoothing: float
    ignore_index: int | None
    reduction: str  # 'mean' or 'sum'


def softmax_xent_forward(
    xp: Any, logits: Any, targets: Any, label_smoothing: float, ignore_index: int | None, reduction: str
) -> tuple[Any, SoftmaxXentSaved] | None:
    """Fused softmax cross-entropy: ``(loss, saved)`` or None to use xp.

    Covers what training runs: class-index targets with label smoothing and ``ignore_index`` (the
    student's loss passes -1 for unlabelled photos) and soft targets (the KD term, cross-entropy against
    ``softmax(teacher / T)``; as on the xp path, ``ignore_index`` does not apply to them), reduction
    'mean' or 'sum'. The loss has the logits' dtype (as on the xp path); the kernel accumulates in
    float32. An out-of-range class index raises the xp path's ValueError through
    :func:`leaflens.engine.deferred.require`: inside a training step that check joins the step's one
    host read instead of synchronising here.
    """
    if not active(xp) or reduction not in ("mean", "sum"):
        return None
    if logits.ndim != 2 or logits.dtype not in _FLOATS:
        return None
    if not isinstance(targets, type(logits)):  # targets left on the host: the xp path reports that
        return None
    n, c = logits.shape
    if n == 0 or c == 0 or not _fits_int32(n, c):
        return None
    z = _contig(xp, logits)
    if targets.dtype.kind in "iu":
        if tuple(targets.shape) != (n,):
            return None
        bad = (targets < 0) | (targets >= c)
        if ignore_index is not None:
            bad &= targets != ignore_index
        require(~bad.any(), lambda: f"cross_entropy: target class {int(targets[bad][0])} is outside [0, {c})")
        t = xp.ascontiguousarray(targets, dtype=np.int64)
        ignore = None if ignore_index is None else int(ignore_index)
    elif targets.dtype.kind == "f":
        if tuple(targets.shape) != (n, c) or label_smoothing:  # smoothing is for class indices only
            return None
        t = xp.ascontiguousarray(targets, dtype=np.float32)
        ignore = None
    else:
        return None
    loss, stats = softmax_xent_forward_cuda(z, t, label_smoothing, validate=False, ignore_index=ignore,
                                            reduction=reduction)
    _hit("softmax_xent")
    saved = SoftmaxXentSaved(z, t, stats, float(label_smoothing), ignore, reduction)
    return xp.asarray(loss, dtype=logits.dtype), saved


def softmax_xent_backward(xp: Any, saved: SoftmaxXentSaved, gy: Any) -> Any:
    """Gradient with respect to the logits for the upstream (scalar) gradient ``gy``."""
    return softmax_xent_backward_cuda(saved.logits, saved.targets, saved.stats, xp.asarray(gy, dtype=np.float32),
                                      saved.label_smoothing, ignore_index=saved.ignore_index,
                                      reduction=saved.reduction)


# ---- activations -----------------------------------------------------------------------------------
def activation_grad(xp: Any, kind: str, y: Any, gy: Any, slope: float = 0.01) -> Any | None:
    """ReLU-family backward from the saved output ``y`` (kind: relu, leaky_relu, relu6), or None.

    The kernel writes exact zeros where the mask is off, also for an inf/NaN ``gy`` (the xp path's
    ``gy * mask`` gives NaN there); elsewhere the two agree bit for bit.
    """
    if not active(xp) or y.ndim == 0 or y.dtype not in _FLOATS or gy.dtype != y.dtype or gy.shape != y.shape:
        return None
    if kind == "leaky_relu" and not slope > 0:  # the mask is read from y, which needs slope > 0
        return None
    _hit("activation_grad")
    return activation_grad_cuda(kind, _contig(xp, y), _contig(xp, gy), slope)


# ---- L2 normalisation ------------------------------------------------------------------------------
def l2norm_forward(xp: Any, x: Any, axis: int, eps: float) -> tuple[Any, Any] | None:
    """``(y, norm)`` for L2 normalisation over the last axis (float32 norms), or None.

    Other axes stay on xp: the kernel reduces over contiguous rows only, and a transpose would cost
    more than it saves.
    """
    if not active(xp) or x.ndim == 0 or x.dtype not in _FLOATS or x.size == 0:
        return None
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim or axis % x.ndim != x.ndim - 1:
        return None
    d = x.shape[-1]
    if not _fits_int32(x.size // d, d):
        return None
    _hit("l2norm")
    return l2norm_forward_cuda(_contig(xp, x), eps)


def l2norm_backward(xp: Any, y: Any, gy: Any, norm: Any, eps: float) -> Any:
    """Gradient with respect to x from the kernel forward's ``y`` and ``norm``."""
    return l2norm_backward_cuda(y, _contig(xp, gy.astype(y.dtype, copy=False)), norm, eps)


# ---- max pooling -----------------------------------------------------------------------------------
def maxpool_forward(
    xp: Any, x: Any, kernel: tuple[int, int], stride: tuple[int, int], pads: tuple[int, int, int, int]
) -> tuple[Any, Any] | None:
    """``(y, idx)`` for NHWC max pooling (idx: uint8 winning tap per output), or None.

    The kernel is NHWC like the engine's activations: no transpose. Ties go to the first tap, as
    in the xp path. A NaN in a window wins (and gets the gradient) where the xp path drops it.
    """
    if not active(xp) or x.ndim != 4 or x.dtype not in _FLOATS or x.size == 0:
        return None
    kh, kw = int(kernel[0]), int(kernel[1])
    if kh * kw > 256 or not _fits_int32(*x.shape):  # a tap index is a uint8
        return None
    _hit("maxpool")
    return maxpool_forward_cuda(_contig(xp, x), (kh, kw), tuple(int(s) for s in stride), tuple(int(p) for p in pads))


def maxpool_backward(
    xp: Any,
    gy: Any,
    idx: Any,
    x_shape: tuple[int, ...],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    pads: tuple[int, int, int, int],
) -> Any:
    """Gradient with respect to the pooled input from the forward's tap indices."""
    n, h, w, c = (int(v) for v in x_shape)  # the forward ran only on NHWC inputs
    return maxpool_backward_cuda(
        _contig(xp, gy),
        idx,
        (n, h, w, c),
        tuple(int(k) for k in kernel),
        tuple(int(s) for s in stride),
        tuple(int(p) for p in pads),
    )


# ---- convolution's im2col / col2im -----------------------------------------------------------------
_NO_PADS = (0, 0, 0, 0)


def im2col(
    xp: Any, x: Any, kernel: tuple[int, int], stride: tuple[int, int], pads: tuple[int, int, int, int] = _NO_PADS
) -> Any | None:
    """Columns (N*Ho*Wo, kh*kw*C) of NHWC ``x`` with zero padding ``pads`` (top, bottom, left, right), or None.

    Same layout as the engine's im2col (tap-major, channels fastest), so the result feeds the same
    cuBLAS matmul. The kernel reads the padding as zeros, so the caller makes no padded copy of x.
    """
    if not active(xp) or x.ndim != 4 or x.dtype not in _FLOATS or x.size == 0:
        return None
    kh, kw = int(kernel[0]), int(kernel[1])
    if not _fits_int32(*x.shape, kh * kw * x.shape[3]):
        return None
    _hit("im2col")
    return im2col_cuda(_contig(xp, x), (kh, kw), tuple(int(s) for s in stride), tuple(int(p) for p in pads))


def col2im(
    xp: Any,
    cols: Any,
    x_shape: tuple[int, ...],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    pads: tuple[int, int, int, int] = _NO_PADS,
) -> Any | None:
    """The adjoint of :func:`im2col` into a fresh array of ``x_shape`` (the unpadded input: what lands in
    the padding is dropped; overlaps summed), or None."""
    if not active(xp) or cols.ndim != 2 or cols.dtype not in _FLOATS or cols.size == 0 or len(x_shape) != 4:
        return None
    kh, kw = int(kernel[0]), int(kernel[1])
    c = int(x_shape[3])
    if cols.shape[1] != kh * kw * c or not _fits_int32(*x_shape, kh * kw * c):
        return None
    _hit("col2im")
    n, h, w = (int(v) for v in x_shape[:3])
    return col2im_cuda(_contig(xp, cols), (n, h, w, c), (kh, kw), tuple(int(s) for s in stride),
                       tuple(int(p) for p in pads))


# ---- optimisers ------------------------------------------------------------------------------------
# The fused kernels work on one flat buffer. The engine keeps each parameter (and its gradient and
# state) as its own array, so each parameter gets one launch over a flat *view* of it: no copy, the
# optimiser state keeps its per-parameter layout (state_dict and checkpoints unchanged), and a step
# costs one kernel per parameter instead of the 5-10 elementwise kernels of the xp code. Packing all
# parameters into one buffer would save launches only if the parameters lived there permanently
# (copying in and out every step costs more than the launches it saves).
def _flat_f32(xp: Any, *arrays: Any) -> bool:
    return all(a.dtype == _F32 and a.flags.c_contiguous for a in arrays)


def sgd_step(
    xp: Any,
    param: Any,
    grad: Any,
    state: dict[str, Any],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
) -> bool:
    """One SGD-with-momentum step in place with ``sgd_momentum_f32``; False (untouched) if it does not apply.

    Covers momentum > 0 with dampening 0 (the kernel's semantics) on float32 parameters. The buffer
    starts at zero, so the first step stores ``grad + wd * p`` in it, as the xp path does.
    """
    if not active(xp) or momentum <= 0 or dampening != 0 or param.size == 0 or not _flat_f32(xp, param):
        return False
    buf = state.get("momentum_buffer")
    if buf is not None and (buf.shape != param.shape or not _flat_f32(xp, buf)):
        return False
    if buf is None:
        buf = state["momentum_buffer"] = xp.zeros_like(param)
    g = xp.ascontiguousarray(grad, dtype=np.float32)
    sgd_momentum_cuda(param.reshape(-1), g.reshape(-1), buf.reshape(-1), lr=lr, momentum=momentum,
                      weight_decay=weight_decay, nesterov=bool(nesterov))
    _hit("sgd_momentum")
    return True


def adam_step(
    xp: Any,
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> bool:
    """One Adam/AdamW step (``step`` counts from 1) in place with ``adamw_f32``; False if it does not apply.

    AdamW (decoupled) passes its weight decay to the kernel (``p *= 1 - lr*wd`` first, as the xp
    path). Adam's L2 decay is added to the gradient here and the kernel runs with decay 0. Bias
    corrections for ``step`` are computed on the host in float64, as in the xp path.
    """
    if not active(xp) or eps <= 0 or param.size == 0:
        return False
    if exp_avg.shape != param.shape or exp_avg_sq.shape != param.shape:
        return False
    if not _flat_f32(xp, param, exp_avg, exp_avg_sq):
        return False
    g = xp.ascontiguousarray(grad, dtype=np.float32)
    if weight_decay and not decoupled:
        g = g + np.float32(weight_decay) * param
    adamw_cuda(param.reshape(-1), g.reshape(-1), exp_avg.reshape(-1), exp_avg_sq.reshape(-1), step=int(step),
               lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay if decoupled else 0.0)
    _hit("adamw")
    return True


def ema_update(xp: Any, average: Any, param: Any, decay: float) -> bool:
    """``average = decay * average + (1 - decay) * param`` in place with ``ema_f32`` (one launch instead of
    three and a temporary); False (untouched) if it does not apply."""
    if not active(xp) or average.size == 0 or average.shape != param.shape or not _flat_f32(xp, average, param):
        return False
    ema_cuda(average.reshape(-1), param.reshape(-1), decay=decay)
    _hit("ema")
    return True
