"""Checks on device values that a training step reads together, in its one host read per step.

A check such as "every target class is in range" needs the host to see a device value; on a GPU each
such read stalls the step until the device has caught up. Inside :func:`deferred_checks` (entered by
:func:`leaflens.engine.amp.train_step`) :func:`require` only records a device flag; the step stacks the
flags into the one read it makes anyway (loss and gradients finite) and :func:`raise_first_failure`
raises the same error the check would have raised at once. Outside that context, and for host values
(NumPy, Python bools) always, :func:`require` checks at once, so the CPU path is unchanged.

:func:`read_floats` is that one read: any number of device scalars in a single transfer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from leaflens.engine.backend import array_module, to_device

__all__ = ["Pending", "deferred_checks", "raise_first_failure", "read_floats", "require"]

Pending = tuple[Any, Callable[[], str], type[Exception]]  # (device flag, message maker, error type)

_state = threading.local()


def require(ok: Any, message: Callable[[], str], error: type[Exception] = ValueError) -> None:
    """Raise ``error(message())`` unless ``ok`` (a bool or a 0-d boolean array) is true.

    ``message`` is called only on failure (it may read device values: the error path may be slow).
    A device flag inside :func:`deferred_checks` is recorded instead, for the step's single read.
    """
    pending: list[Pending] | None = getattr(_state, "pending", None)
    if pending is None or isinstance(ok, (bool, np.bool_, np.ndarray)):
        if not bool(ok):
            raise error(message())
        return
    pending.append((ok, message, error))


@contextlib.contextmanager
def deferred_checks() -> Iterator[list[Pending]]:
    """Collect this thread's device checks in the returned list instead of reading each at once."""
    previous = getattr(_state, "pending", None)
    pending: list[Pending] = []
    _state.pending = pending
    try:
        yield pending
    finally:
        _state.pending = previous


def raise_first_failure(pending: Sequence[Pending], verdicts: Sequence[Any]) -> None:
    """Raise the error of the first check whose verdict (read by the caller, same order) is false."""
    for (_, message, error), ok in zip(pending, verdicts):
        if not ok:
            raise error(message())


def read_floats(values: Sequence[Any]) -> list[float]:
    """``float(v)`` for each value, with a single device-to-host transfer for all the device arrays among
    them (0-d arrays: scalars, booleans, counts); host values (Python numbers, NumPy) cost no transfer."""
    out = [0.0] * len(values)
    on_device = []
    for i, v in enumerate(values):
        if isinstance(v, (bool, int, float, np.generic, np.ndarray)):
            out[i] = float(v)
        else:
            on_device.append(i)
    if on_device:
        xp = array_module(values[on_device[0]])
        stacked = xp.stack([values[i].reshape(()).astype(np.float64) for i in on_device])
        for i, v in zip(on_device, to_device(stacked, "cpu").tolist()):
            out[i] = v
    return out
