"""Learning-rate schedules, stepped once per optimiser step (or per epoch, as the caller chooses)."""

from __future__ import annotations

import math
from typing import Any

from leaflens.engine.optim.optimizer import Optimizer


class Scheduler:
    """Sets every group's lr to ``initial_lr * factor(n)`` where n counts calls to ``step()``."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.last_step = 0
        self._apply()

    def factor(self, n: int) -> float:
        raise NotImplementedError

    def _apply(self) -> None:
        f = self.factor(self.last_step)
        for g in self.optimizer.param_groups:
            g["lr"] = g["initial_lr"] * f

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != type(self).__name__:
            raise ValueError(f"scheduler state is for {state.get('type')}, not {type(self).__name__}")
        self.last_step = int(state["last_step"])
        self._apply()


class StepLR(Scheduler):
    """Multiply the learning rate by ``gamma`` every ``step_size`` steps."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1):
        if step_size <= 0:
            raise ValueError(f"StepLR: step_size must be positive, got {step_size}")
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer)

    def factor(self, n: int) -> float:
        return self.gamma ** (n // self.step_size)


class WarmupCosine(Scheduler):
    """Linear warm-up from ~0 over ``warmup_steps``, then cosine decay to ``min_factor`` at ``total_steps``."""

    def __init__(self, optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, min_factor: float = 0.0):
        if total_steps <= 0 or warmup_steps < 0 or warmup_steps > total_steps:
            raise ValueError(f"WarmupCosine: need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}) "
                             "and total_steps > 0")
        self.total_steps, self.warmup_steps, self.min_factor = total_steps, warmup_steps, min_factor
        super().__init__(optimizer)

    def factor(self, n: int) -> float:
        if n >= self.total_steps:  # the end, even with no decay phase (warmup_steps == total_steps)
            return self.min_factor
        if n < self.warmup_steps:
            return (n + 1) / (self.warmup_steps + 1)
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((n - self.warmup_steps) / span, 1.0)
        return self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * progress))
