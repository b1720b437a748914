"""Gradient clipping by global norm."""

from __future__ import annotations

import math
from collections.abc import Iterable

from leaflens.engine.backend import array_module
from leaflens.engine.nn.module import Parameter


def clip_grad_norm_(params: Iterable[Parameter], max_norm: float) -> float:
    """Scale all gradients so their joint L2 norm is at most ``max_norm``; returns the norm before.

    A non-finite norm is returned as it is and the gradients are left alone: the caller decides
    (skip the step, lower the loss scale) rather than have NaN spread into every parameter.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    xp = array_module(grads[0])
    total = math.sqrt(sum(float(xp.vdot(g.ravel(), g.ravel())) for g in grads))
    if math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g *= g.dtype.type(scale)
    return total
