"""Per-thread engine settings: whether operations record the graph for backward.

Thread-local, so a serving thread running under ``no_grad()`` never switches off gradient
recording in a training thread beside it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


def grad_enabled() -> bool:
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def _grad_mode(enabled: bool) -> Iterator[None]:
    previous = grad_enabled()
    _state.grad_enabled = enabled
    try:
        yield
    finally:
        _state.grad_enabled = previous


def no_grad() -> contextlib.AbstractContextManager[None]:
    """Context in which operations build no graph (inference, evaluation, parameter updates)."""
    return _grad_mode(False)


def enable_grad() -> contextlib.AbstractContextManager[None]:
    return _grad_mode(True)
