"""Mixed precision: float16 compute with float32 master weights, and dynamic loss scaling.

Under ``autocast()`` the matrix-heavy ops (conv2d, linear, matmul) cast their inputs and weights to
float16 and compute in float16; the ops whose maths needs the range or the precision of float32
(cross-entropy and MSE losses, softmax / log-softmax, BatchNorm and its statistics, L2
normalisation) cast float16 inputs back up to float32 first. The casts are autograd ops
(``leaflens.engine.ops.cast``), so gradients flow back through them and reach the float32 master
parameters as float32; the optimiser only ever sees float32. Why: on a GPU float16 halves the
memory of the saved activations and the im2col columns, and runs the matrix products on tensor
cores; keeping the rest in float32 keeps training as stable as float32 training.

float16 only: bfloat16 would need no loss scaling, but it is not a NumPy dtype, and the engine
writes every op once for NumPy and CuPy. On the CPU float16 is correct but slow (NumPy has no
float16 BLAS), so the pipeline turns mixed precision on only on a GPU unless told otherwise.

float16 overflows above 65504 and flushes gradients below about 6e-8 to zero, so the loss is
multiplied by a large factor before backward and the gradients divided by it afterwards
(``GradScaler``): a step whose gradients overflowed is skipped and the factor halved; after
``growth_interval`` good steps in a row the factor doubles again (dynamic loss scaling, as in
Micikevicius et al. 2018 and ``torch.cuda.amp``).

The switch is per thread, like ``leaflens.engine.config.no_grad``: autocast in a training thread never
changes what a serving thread beside it computes.

:func:`train_step` is the one optimiser step built from these pieces (autocast forward, scaled
backward, unscale, clip, step, scale update): the pipeline's training loop, ``leaflens doctor``'s
memory measurement and ``benchmarks/gpu.py`` all call it, so they time and size the same step.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from leaflens.engine.backend import array_module
from leaflens.engine.deferred import deferred_checks, raise_first_failure, read_floats

if TYPE_CHECKING:
    from leaflens.engine.tensor import Tensor

__all__ = ["GradScaler", "StepResult", "autocast", "autocast_enabled", "float_input", "half_inputs", "train_step"]

LOW = np.dtype(np.float16)
HIGH = np.dtype(np.float32)

_state = threading.local()


def autocast_enabled() -> bool:
    """True inside ``autocast()`` on this thread."""
    return getattr(_state, "enabled", False)


@contextlib.contextmanager
def autocast(enabled: bool = True, dtype: Any = np.float16) -> Iterator[None]:
    """Context in which conv2d / linear / matmul compute in float16 (see the module docstring).

    ``enabled=False`` gives a no-op context, so callers can write ``with autocast(use_amp):``.
    """
    if np.dtype(dtype) != LOW:
        raise ValueError(f"autocast supports float16 only, got {dtype!r} (bfloat16 is not a NumPy dtype, and "
                         "every engine op runs on NumPy as well as CuPy)")
    previous = autocast_enabled()
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = previous


def _cast(x: Any, wanted: Any, dtype: np.dtype) -> Any:
    if x is None or not hasattr(x, "dtype") or not wanted(x.dtype):
        return x
    # Tensor.astype is the autograd cast (its gradient is cast back to x's dtype); a plain array (an input
    # batch, a target) has nothing to differentiate and is simply converted.
    return x.astype(dtype)


def half_inputs(*xs: Any) -> tuple[Any, ...]:
    """The inputs of a float16-friendly op (conv2d, linear, matmul): floats cast to float16 under autocast.

    Outside autocast the inputs come back unchanged (one thread-local lookup), so the float32 path is
    untouched. ``None`` (a missing bias) and non-float arrays pass through.
    """
    if not getattr(_state, "enabled", False):
        return xs
    return tuple(_cast(x, lambda d: d.kind == "f" and d != LOW, LOW) for x in xs)


def float_input(x: Any) -> Any:
    """The input of a float32-only op (loss, softmax, BatchNorm, L2 norm): float16 cast up under autocast."""
    if not getattr(_state, "enabled", False):
        return x
    return _cast(x, lambda d: d == LOW, HIGH)


class GradScaler:
    """Dynamic loss scaling for float16 training with float32 master weights.

    One step::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # true gradients, before clipping
        clip_grad_norm_(params, max_norm)   # skipped by the caller when scaler.found_inf
        scaler.step(optimizer)              # skipped (returns False) on inf/NaN gradients
        scaler.update()                     # halve on overflow, double after growth_interval good steps

    With ``enabled=False`` every method is a pass-through (``step`` just calls ``optimizer.step()``), so
    one training loop serves both precisions. ``state_dict()`` is JSON-able, for checkpoints.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(f"GradScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                             f"growth_interval >= 1, got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self.enabled = bool(enabled)
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0   # good steps in a row since the scale last changed
        self.skipped_steps = 0    # overflow steps skipped over the scaler's life
        self.found_inf: bool | None = None  # this step's verdict, set by unscale_ (None: not unscaled yet)

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled)."""
        return self.scale_value if self.enabled else 1.0

    def scale(self, loss: Tensor) -> Tensor:
        """``loss * scale`` (a graph op, so backward produces scaled gradients); ``loss`` itself when disabled.

        A float16 loss (one written with plain arithmetic under :func:`autocast`) is scaled in float32: in
        float16 the default scale, 2**16, is itself past the largest finite value and every loss became inf.
        Its gradient goes back into float16 as the scale, where a scale too large for float16 is an overflow
        like any other (the step is skipped and the scale lowered)."""
        if not self.enabled:
            return loss
        if loss.dtype == np.float16:
            loss = loss.astype(np.float32)
        return loss * self.scale_value

    def unscale_(self, optimizer_or_params: Any) -> bool:
        """Divide every gradient by the scale in place and record whether any is inf/NaN; returns found_inf.

        Takes an optimiser (all its parameter groups) or an iterable of parameters. Call it once per step,
        before gradient clipping, so that clipping sees the true gradients.
        """
        if not self.enabled:
            self.found_inf = False
            return False
        found = self.unscale_on_device_(optimizer_or_params)
        self.found_inf = bool(found)  # one device-to-host read for all parameters on a GPU
        return self.found_inf

    def unscale_on_device_(self, optimizer_or_params: Any) -> Any:
        """:meth:`unscale_` without the host read: returns whether any gradient is inf/NaN as a 0-d boolean
        array on the gradients' device (a Python bool when there is nothing to unscale).

        The caller reads it, in the same transfer as its other checks, and hands the answer to
        :meth:`set_found_inf` before :meth:`step` and :meth:`update`.
        """
        if not self.enabled:
            return False
        if self.found_inf is not None:
            raise RuntimeError("GradScaler.unscale_() was already called for this step; call update() after the step")
        grads = [p.grad for p in _parameters(optimizer_or_params) if p.grad is not None]
        if not grads:
            return False
        inv = 1.0 / self.scale_value
        xp = array_module(grads[0])
        finite = []
        for g in grads:
            g *= g.dtype.type(inv)
            finite.append(xp.isfinite(g).all())
        return ~xp.stack(finite).all()

    def set_found_inf(self, found_inf: bool) -> None:
        """Record this step's verdict read from :meth:`unscale_on_device_`."""
        self.found_inf = bool(found_inf) if self.enabled else False

    def step(self, optimizer: Any) -> bool:
        """``optimizer.step()`` unless the (unscaled) gradients hold inf/NaN; returns whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        if self.found_inf is None:
            self.unscale_(optimizer)
        if self.found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale from this step's verdict and get ready for the next step.

        Overflow: scale *= backoff_factor, the run of good steps restarts, the step counts as skipped.
        A good step: after ``growth_interval`` of them in a row, scale *= growth_factor. A step that
        was never unscaled (it failed before backward) leaves the scale alone.
        """
        if not self.enabled:
            self.found_inf = None
            return
        if self.found_inf is True:
            self.scale_value *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        elif self.found_inf is False:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                grown = self.scale_value * self.growth_factor
                if np.isfinite(np.float32(grown)):  # never grow into float32 overflow
                    self.scale_value = grown
                self.growth_tracker = 0
        self.found_inf = None

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: what a resumed run needs to scale exactly as an uninterrupted one."""
        return {"enabled": self.enabled, "scale": self.scale_value, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (refuses a non-positive or non-finite scale)."""
        scale = float(state["scale"])
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"GradScaler state has an invalid scale {scale!r}")
        self.enabled = bool(state.get("enabled", self.enabled))
        self.scale_value = scale
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.found_inf = None


def _parameters(obj: Any) -> Iterable[Any]:
    groups = getattr(obj, "param_groups", None)
    if groups is not None:
        return [p for g in groups for p in g["params"]]
    return obj


@dataclass
class StepResult:
    """What one :func:`train_step` did."""

    loss: Tensor        # the (unscaled) loss of the batch
    output: Any         # whatever ``compute_loss`` returned beside the loss (None if nothing)
    stepped: bool       # the optimiser updated the parameters
    overflow: bool      # skipped: float16 gradients overflowed at a loss scale above 1 (the scale was lowered)
    grad_norm: float | None = None  # the gradients' global norm before clipping (None: not clipped)


def _any_nonfinite(params: list[Any]) -> Any:
    """Whether any gradient holds inf/NaN, as a 0-d boolean array on the gradients' device (False: none)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return False
    xp = array_module(grads[0])
    return ~xp.stack([xp.isfinite(g).all() for g in grads]).all()


def train_step(optimizer: Any, scaler: GradScaler, compute_loss: Callable[[], Any],
               clip_grad_norm: float | None = None) -> StepResult:
    """One optimiser step, in float32 or mixed precision as ``scaler.enabled`` says.

    Zeroes the gradients, runs ``compute_loss()`` under :func:`autocast` (it returns the loss tensor, or
    a tuple whose first element is the loss and whose second is passed back as ``StepResult.output``),
    backpropagates the scaled loss, unscales the gradients, clips their global norm to
    ``clip_grad_norm`` when given, steps the optimiser and updates the scale.

    A float16 overflow at a loss scale above 1 is routine dynamic loss scaling: the step is skipped and
    reported as ``overflow``. Anything else non-finite (the loss itself, gradients that overflow even at
    scale 1 or in float32, a non-finite gradient norm) raises ``NonFiniteLossError`` with the optimiser
    untouched; the scaler is left ready for the next step either way, so the caller decides whether to
    skip the batch or stop.

    On a GPU the step reads the device once: the loss, the overflow flag, the gradient norm and any
    checks the loss deferred (:mod:`leaflens.engine.deferred`) travel in one transfer. Clipping is
    computed and applied on the device. ``StepResult.loss`` stays a device tensor (reading it is the
    caller's choice, and a synchronisation).
    """
    from leaflens.engine.optim.clip import clip_grad_norm_  # noqa: PLC0415  (optim imports the ops, which import amp)
    from leaflens.engine.tensor import NonFiniteLossError  # noqa: PLC0415

    optimizer.zero_grad()
    params = list(_parameters(optimizer))
    try:
        with deferred_checks() as pending:  # device-side input checks (target ranges, ...), read below
            with autocast(scaler.enabled):
                out = compute_loss()
            loss, output = (out[0], out[1] if len(out) > 1 else None) if isinstance(out, tuple) else (out, None)
            on_host = array_module(loss.data) is np
            # float16 overflow is expected now and then under mixed precision: the scaler handles it
            with np.errstate(over="ignore", invalid="ignore") if scaler.enabled else contextlib.nullcontext():
                # on the host a non-finite loss is refused before backpropagating; on a GPU that check joins the
                # step's one read below (the gradients of a non-finite loss are then computed, never applied)
                scaler.scale(loss).backward(check_finite=on_host)
            found_inf = scaler.unscale_on_device_(params)  # true gradients before clipping
            norm = None if clip_grad_norm is None else clip_grad_norm_(params, float(clip_grad_norm))
            if not scaler.enabled and norm is None:  # float32 without clipping: nothing above looked at them
                found_inf = _any_nonfinite(params)
        # The step's one host read: the loss (finite?), the overflow flag, the gradient norm, the input checks.
        loss_value, found, norm_value, *checks = read_floats(
            [loss.data, found_inf, 0.0 if norm is None else norm, *(flag for flag, _, _ in pending)])
        raise_first_failure(pending, checks)
        if not math.isfinite(loss_value):
            raise NonFiniteLossError(f"loss is {loss_value}: a non-finite loss, the step is left out (check the "
                                     "learning rate, the inputs and the labels)")
        scaler.set_found_inf(bool(found))
        if found:  # inf/NaN gradients
            if scaler.enabled and scaler.get_scale() > 1.0:
                scaler.update()
                return StepResult(loss, output, stepped=False, overflow=True)
            raise NonFiniteLossError("gradients are not finite even with the loss scale at 1" if scaler.enabled
                                     else "gradients are not finite (in float32, with a finite loss)")
        grad_norm = None if norm is None else norm_value
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise NonFiniteLossError(f"gradient norm is {grad_norm}")
    except NonFiniteLossError:
        scaler.update()
        raise
    scaler.step(optimizer)
    scaler.update()
    return StepResult(loss, output, stepped=True, overflow=False, grad_norm=grad_norm)
