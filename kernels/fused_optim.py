"""Fused optimiser steps over one flat float32 parameter buffer (``fused_optim.cu``).

PyTorch semantics. SGD: momentum with dampening 0, optional Nesterov, L2 weight decay added to the
gradient. AdamW: decoupled weight decay ``p *= 1 - lr*wd`` then Adam with bias correction for step t.
``grad_scale`` multiplies the gradient first, so unscaling a mixed-precision loss scale (1/scale) and a
gradient-clipping factor cost nothing extra. All updates are in place; nothing is returned.

The maths is defined once, by the engine's ``SGD`` and ``Adam``/``AdamW`` updates and ``ModelEMA``'s
average (:mod:`leaflens.engine.optim`); tests/kernels/test_kernel_launch.py holds these kernels to them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from leaflens.kernels import _checks, _cuda


def _check_sgd(lr: float, momentum: float, weight_decay: float, nesterov: bool) -> None:
    if lr < 0 or momentum < 0 or weight_decay < 0:
        raise ValueError(f"sgd: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
    if nesterov and momentum <= 0:
        raise ValueError("sgd: Nesterov momentum needs momentum > 0")


def _adam_scalars(
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> tuple[float, float]:
    """(step_size, sqrt(bias_correction2)) in float64 for step ``step`` (1-based)."""
    if not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"adamw: step must be an int >= 1 (the number of this update), got {step!r}")
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"adamw: betas must be in [0, 1), got {beta1}, {beta2}")
    if lr < 0 or eps <= 0 or weight_decay < 0:
        raise ValueError(f"adamw: need lr >= 0, eps > 0, weight_decay >= 0; got {lr}, {eps}, {weight_decay}")
    bias_correction1 = 1.0 - beta1 ** int(step)
    bias_correction2 = 1.0 - beta2 ** int(step)
    return lr / bias_correction1, math.sqrt(bias_correction2)


def _check_flat(xp: Any, name: str, **arrays: Any) -> int:
    size = None
    for arg, arr in arrays.items():
        _checks.require_array(xp, name, arg, arr, [np.float32], ndim=1)
        if size is None:
            size = arr.shape[0]
        elif arr.shape[0] != size:
            raise ValueError(f"{name}: {arg} has {arr.shape[0]} elements, param has {size}")
    return int(size or 0)


def sgd_momentum_cuda(
    param: Any,
    grad: Any,
    momentum_buffer: Any,
    *,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """One SGD step in place on flat float32 ``param`` and ``momentum_buffer`` (zeros before step 1),
    one launch for the whole buffer."""
    cp = _cuda.cupy_module()
    _check_sgd(lr, momentum, weight_decay, nesterov)
    n = _check_flat(cp, "sgd_momentum", param=param, grad=grad, momentum_buffer=momentum_buffer)
    if n == 0:
        return
    kernel = _cuda.load_kernel("fused_optim.cu", "sgd_momentum_f32")
    grid, block = _cuda.grid_1d(n)
    kernel(
        grid,
        block,
        (
            param,
            grad,
            momentum_buffer,
            np.int64(n),
            np.float32(lr),
            np.float32(momentum),
            np.float32(weight_decay),
            np.float32(grad_scale),
            np.int32(1 if nesterov else 0),
        ),
    )


def adamw_cuda(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW step in place (``step`` counts from 1; moments are zeros before step 1); the bias
    corrections are computed here in float64."""
    cp = _cuda.cupy_module()
    step_size, bc2_sqrt = _adam_scalars(step, lr, beta1, beta2, eps, weight_decay)
    n = _check_flat(cp, "adamw", param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if n == 0:
        return
    kernel = _cuda.load_kernel("fused_optim.cu", "adamw_f32")
    grid, block = _cuda.grid_1d(n)
    scalars = (lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt, grad_scale)
    kernel(grid, block, (param, grad, exp_avg, exp_avg_sq, np.int64(n)) + tuple(np.float32(s) for s in scalars))


def ema_cuda(average: Any, param: Any, *, decay: float) -> None:
    """``average = decay * average + (1 - decay) * param`` in place on flat float32 arrays, one launch."""
    cp = _cuda.cupy_module()
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"ema: decay must be in [0, 1], got {decay}")
    n = _check_flat(cp, "ema", average=average, param=param)
    if n == 0:
        return
    kernel = _cuda.load_kernel("fused_optim.cu", "ema_f32")
    grid, block = _cuda.grid_1d(n)
    kernel(grid, block, (average, param, np.int64(n), np.float32(decay)))
