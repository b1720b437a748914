"""Adam (L2 weight decay in the gradient) and AdamW (decoupled weight decay, Loshchilov & Hutter).

On CuPy, float32 parameters take one fused ``adamw`` kernel launch per parameter (engine/ops/_kernels.py
explains why per parameter rather than one flat buffer); the state (``exp_avg``, ``exp_avg_sq``, ``step``)
is the same either way (``step`` a host int), so checkpoints move freely between the two paths.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from leaflens.engine.backend import array_module
from leaflens.engine.ops import _kernels as gpu
from leaflens.engine.optim.optimizer import Optimizer


class Adam(Optimizer):
    decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"{type(self).__name__}: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=list(betas), eps=eps, weight_decay=weight_decay))
        if any(p.dtype == np.float16 for p in self._all_params()):
            # eps (1e-8) and small squared gradients are 0 in float16: the update divides by zero
            raise TypeError(f"{type(self).__name__} keeps its moments in the parameters' dtype, and float16 cannot "
                            "hold them: keep the parameters float32 and compute in float16 under "
                            "leaflens.engine.amp.autocast() (mixed precision)")

    def update(self, p, grad, group, state):
        d = p.data
        xp = array_module(d)
        f = d.dtype.type
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if "exp_avg" not in state:
            state["exp_avg"] = xp.zeros_like(d)
            state["exp_avg_sq"] = xp.zeros_like(d)
            state["step"] = 0
        # a host int (checkpoints store it as a 0-d array; Optimizer.load_state_dict gives an int back):
        # the bias corrections below need it on the host, and reading it from a GPU would stall each step
        t = state["step"] = int(state["step"]) + 1
        if gpu.adam_step(xp, d, grad, state["exp_avg"], state["exp_avg_sq"], t, lr=lr, beta1=b1, beta2=b2, eps=eps,
                         weight_decay=wd, decoupled=self.decoupled):
            return
        if wd:
            if self.decoupled:
                d *= f(1 - lr * wd)
            else:
                grad = grad + f(wd) * d
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m *= f(b1)
        m += f(1 - b1) * grad
        v *= f(b2)
        v += f(1 - b2) * (grad * grad)
        step_size = lr / (1 - b1 ** t)
        denom = xp.sqrt(v / f(1 - b2 ** t))
        denom += f(eps)
        d -= f(step_size) * (m / denom)


class AdamW(Adam):
    decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr, betas, eps, weight_decay)
