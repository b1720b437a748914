"""An exponential moving average of a model's weights (Polyak averaging), kept beside the training.

The weights a run evaluates and keeps can be an average of its recent steps instead of the last step's:
the average sits nearer the middle of the valley the optimiser bounces around in, which with small
validation sets mostly shows as less luck in which epoch (and which seed) comes out best.

``decay`` is the weight of the old average at each step. Early steps use ``min(decay, (1 + n) / (10 + n))``
after ``n`` updates, so the average follows the fast-moving first steps instead of dragging the initial
weights along for ``1 / (1 - decay)`` steps. Floating-point buffers (BatchNorm's running statistics) are
averaged like the parameters, so the averaged weights come with statistics of similar weights; other
buffers are copied. On CuPy a float32 array's update is one fused kernel launch (``ema_f32`` in
kernels/fused_optim.cu); this module's NumPy arithmetic defines its maths.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from leaflens.engine.backend import array_module, to_device
from leaflens.engine.nn.module import Module
from leaflens.engine.ops import _kernels as gpu


class ModelEMA:
    """The running average of ``model``'s parameters and buffers; :meth:`update` after each optimiser step."""

    def __init__(self, model: Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the weight average's decay must be in (0, 1), got {decay}")
        self.decay = float(decay)
        self.updates = 0
        self.shadow: dict[str, Any] = {name: array.copy() for name, array in _live(model)}

    def restart(self, model: Module) -> None:
        """Start the average again from ``model``'s current weights (a run resumed from a checkpoint without one)."""
        for name, live in _live(model):
            self.shadow[name][...] = live
        self.updates = 0

    def current_decay(self) -> float:
        """The decay the next :meth:`update` uses."""
        n = self.updates + 1
        return min(self.decay, (1.0 + n) / (10.0 + n))

    def update(self, model: Module) -> None:
        """Move the average towards ``model``'s current weights."""
        d = self.current_decay()
        for name, live in _live(model):
            avg = self.shadow[name]
            if not np.issubdtype(avg.dtype, np.floating):
                avg[...] = live
                continue
            if not gpu.ema_update(array_module(avg), avg, live, d):
                avg *= d
                avg += (1.0 - d) * live
        self.updates += 1

    @contextmanager
    def applied(self, model: Module) -> Iterator[Module]:
        """``model`` holds the averaged weights inside the block and its own again after it."""
        saved = {name: array.copy() for name, array in _live(model)}
        _assign(model, self.shadow)
        try:
            yield model
        finally:
            _assign(model, saved)

    def state_dict(self) -> dict[str, Any]:
        """{"meta": {"decay", "updates"}, "arrays": {name: host ndarray}}: what a checkpoint stores."""
        return {"meta": {"decay": self.decay, "updates": self.updates},
                "arrays": {k: np.array(to_device(v, "cpu"), copy=True) for k, v in self.shadow.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back a :meth:`state_dict`, refusing one from another model."""
        meta, arrays = state["meta"], state["arrays"]
        if set(arrays) != set(self.shadow):
            missing, extra = sorted(set(self.shadow) - set(arrays)), sorted(set(arrays) - set(self.shadow))
            raise ValueError(f"weight average state is for another model (missing {missing[:3]}, "
                             f"unexpected {extra[:3]})")
        for name, value in arrays.items():  # every shape checked before any array is written
            if tuple(value.shape) != tuple(self.shadow[name].shape):
                raise ValueError(f"weight average {name!r} has shape {tuple(value.shape)}, "
                                 f"the model {tuple(self.shadow[name].shape)}")
        for name, value in arrays.items():
            avg = self.shadow[name]
            avg[...] = array_module(avg).asarray(value, dtype=avg.dtype)
        self.decay, self.updates = float(meta["decay"]), int(meta["updates"])


def _live(model: Module) -> Iterator[tuple[str, Any]]:
    """The model's parameter and buffer arrays by name, themselves (not copies)."""
    for name, p in model.named_parameters():
        yield name, p.data
    yield from model.named_buffers()


def _assign(model: Module, values: dict[str, Any]) -> None:
    for name, live in _live(model):
        live[...] = values[name]
