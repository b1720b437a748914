"""Stochastic gradient descent with momentum, Nesterov momentum and L2 weight decay (PyTorch semantics).

On CuPy, float32 parameters with momentum (dampening 0) take one fused ``sgd_momentum`` kernel launch
per parameter (engine/ops/_kernels.py explains why per parameter rather than one flat buffer).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from leaflens.engine.backend import array_module
from leaflens.engine.ops import _kernels as gpu
from leaflens.engine.optim.optimizer import Optimizer


class SGD(Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 0.01, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: lr, momentum and weight_decay must be >= 0 (got {lr}, {momentum}, {weight_decay})")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum needs momentum > 0 and dampening 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def update(self, p, grad, group, state):
        d = p.data
        lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
        if gpu.sgd_step(array_module(d), d, grad, state, lr=lr, momentum=mom, dampening=group["dampening"],
                        weight_decay=wd, nesterov=group["nesterov"]):
            return
        g = grad + d.dtype.type(wd) * d if wd else grad
        if mom:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.astype(d.dtype, copy=True)
            else:
                buf *= d.dtype.type(mom)
                buf += d.dtype.type(1 - group["dampening"]) * g
            g = g + d.dtype.type(mom) * buf if group["nesterov"] else buf
        d -= d.dtype.type(lr) * g
