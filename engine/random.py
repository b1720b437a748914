"""The engine's random number generator: one seeded stream for initialisation and dropout.

Its state goes into checkpoints (as JSON, never pickle) so a resumed run draws the same numbers.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

_rng = np.random.default_rng(0)


def seed(value: int) -> None:
    global _rng
    _rng = np.random.default_rng(value)


def generator() -> np.random.Generator:
    return _rng


def get_state() -> str:
    """The generator's state as a JSON string."""
    return json.dumps(_rng.bit_generator.state)


def set_state(state: str | dict[str, Any]) -> None:
    data = json.loads(state) if isinstance(state, str) else state
    if data.get("bit_generator") != type(_rng.bit_generator).__name__:
        raise ValueError(f"RNG state is for {data.get('bit_generator')!r}, not {type(_rng.bit_generator).__name__}")
    _rng.bit_generator.state = data
