"""Weight initialisers (He/Kaiming and Xavier/Glorot), drawing from the generator the caller passes.

``rng=None`` draws from ``leaflens.engine.random.default_generator()``, a fallback for interactive
use; the pipeline always passes its own generator (see :mod:`leaflens.engine.random`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from leaflens.engine import random as erandom


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) for a Linear (out, in) or an OIHW conv weight."""
    if len(shape) < 2:
        raise ValueError(f"fan-in/fan-out need a weight with at least 2 dimensions, got shape {shape}")
    receptive = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def _gain(nonlinearity: str, slope: float = 0.0) -> float:
    if nonlinearity in ("relu", "relu6"):
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity in ("linear", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    raise ValueError(f"unknown nonlinearity {nonlinearity!r}")


def kaiming_normal(shape: tuple[int, ...], nonlinearity: str = "relu", mode: str = "fan_in",
                   dtype: Any = np.float32, rng: np.random.Generator | None = None) -> np.ndarray:
    fan_in, fan_out = fans(shape)
    std = _gain(nonlinearity) / math.sqrt(fan_in if mode == "fan_in" else fan_out)
    return (erandom.generator(rng).standard_normal(shape) * std).astype(dtype)


def kaiming_uniform(shape: tuple[int, ...], nonlinearity: str = "relu", mode: str = "fan_in",
                    dtype: Any = np.float32, rng: np.random.Generator | None = None) -> np.ndarray:
    fan_in, fan_out = fans(shape)
    bound = _gain(nonlinearity) * math.sqrt(3.0 / (fan_in if mode == "fan_in" else fan_out))
    return erandom.generator(rng).uniform(-bound, bound, shape).astype(dtype)


def xavier_uniform(shape: tuple[int, ...], gain: float = 1.0, dtype: Any = np.float32,
                   rng: np.random.Generator | None = None) -> np.ndarray:
    fan_in, fan_out = fans(shape)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return erandom.generator(rng).uniform(-bound, bound, shape).astype(dtype)


def xavier_normal(shape: tuple[int, ...], gain: float = 1.0, dtype: Any = np.float32,
                  rng: np.random.Generator | None = None) -> np.ndarray:
    fan_in, fan_out = fans(shape)
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    return (erandom.generator(rng).standard_normal(shape) * std).astype(dtype)


def uniform_bias(fan_in: int, size: int, dtype: Any = np.float32,
                 rng: np.random.Generator | None = None) -> np.ndarray:
    """Bias drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the usual default for layers with a bias."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return erandom.generator(rng).uniform(-bound, bound, size).astype(dtype)
