"""Random generators for the engine: passed in by the caller, never a hidden process-wide stream.

Everything random in the engine draws from a ``numpy.random.Generator`` that its caller hands over:
the weight initialisers (``leaflens.engine.nn.init``, ``rng=``), the layers built on them
(``nn.Linear``, ``nn.Conv2d``), dropout (``ops.dropout``, ``nn.Dropout``, both ``rng=``;
:func:`leaflens.engine.nn.set_dropout_generator` points a whole model's dropout at one generator);
the data loader and the augmentation take a seed or a generator too. So a model built and trained
from a recipe's seed is the same model whatever else ran earlier in the process; the same teacher
recipe once gave 90.6 % or 95.3 % test accuracy depending on what had drawn from a shared stream
before it. Checkpoints save and restore generator states by name (as JSON, never pickle), so a
resumed run draws the same numbers as an uninterrupted one.

For interactive use only (a notebook, a quick script), ``rng=None`` falls back to
:func:`default_generator`, one module-level stream that :func:`seed` re-seeds. The pipeline never
relies on it: its tests train a teacher and a student with that stream replaced by a trap.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["default_generator", "generator", "restore_state", "seed", "state_of"]

_default = np.random.default_rng(0)


def default_generator() -> np.random.Generator:
    """The interactive fallback stream (what ``rng=None`` draws from); product code passes its own."""
    return _default


def seed(value: int) -> None:
    """Re-seed the interactive fallback stream (:func:`default_generator`)."""
    global _default
    _default = np.random.default_rng(value)


def generator(rng: np.random.Generator | int | Sequence[int] | None) -> np.random.Generator:
    """The generator to draw from: ``rng`` itself, a new one seeded with it (an int or a sequence of
    ints), or, for ``None``, the interactive fallback :func:`default_generator`."""
    if rng is None:
        return _default
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


def state_of(rng: np.random.Generator) -> dict[str, Any]:
    """``rng``'s state as a JSON-able dict (for checkpoints)."""
    return json.loads(json.dumps(rng.bit_generator.state))


def restore_state(rng: np.random.Generator, state: str | dict[str, Any]) -> None:
    """Put ``rng`` back into a state from :func:`state_of` (a dict or its JSON text), in place."""
    data = json.loads(state) if isinstance(state, str) else state
    mine = type(rng.bit_generator).__name__
    if not isinstance(data, dict) or data.get("bit_generator") != mine:
        found = data.get("bit_generator") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"RNG state is for {found!r}, not {mine!r}")
    rng.bit_generator.state = data
