"""Gradient clipping by global norm, computed and applied on the gradients' device."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from leaflens.engine.backend import array_module
from leaflens.engine.nn.module import Parameter


def grad_norm(grads: list[Any]) -> Any:
    """The joint L2 norm of ``grads`` as a 0-d float64 array on their device (no host read)."""
    xp = array_module(grads[0])
    # float16 squares overflow from 256 on: those gradients are squared in float32 (the others as before)
    flat = [g.ravel().astype(np.float32) if g.dtype == np.float16 else g.ravel() for g in grads]
    squares = xp.stack([xp.vdot(g, g).astype(np.float64) for g in flat])
    # cumsum adds in order from the first parameter, as a Python sum over the parameters would: the
    # norm is the one earlier versions computed on the host, to the last bit
    return xp.sqrt(xp.cumsum(squares)[-1])


def clip_grad_norm_(params: Iterable[Parameter], max_norm: float) -> Any:
    """Scale all gradients so their joint L2 norm is at most ``max_norm``; returns the norm before.

    The norm comes back as a 0-d float64 array on the gradients' device (``float()`` reads it; on a GPU
    that read waits for the device, so the training step reads it together with its other checks).
    Everything happens on the device: the scale is ``max_norm / (norm + 1e-6)`` where the norm is finite
    and above ``max_norm``, else exactly 1. A non-finite norm therefore leaves the gradients alone: the
    caller decides (skip the step, lower the loss scale) rather than have NaN spread into every parameter.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return np.float64(0.0)
    xp = array_module(grads[0])
    total = grad_norm(grads)
    clip = xp.isfinite(total) & (total > max_norm)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf/NaN norms: the scale is 1 then
        scale = xp.where(clip, max_norm / (total + 1e-6), 1.0)
    for g in grads:
        g *= scale.astype(g.dtype)
    return total
