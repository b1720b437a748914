"""Tensor and Function: the autograd core.

A ``Tensor`` wraps one array of the active backend (NumPy or CuPy). Every differentiable operation
is a ``Function`` with a ``forward`` on raw arrays and a ``backward`` that maps output gradients to
input gradients. Calling a Function on tensors records it as the ``creator`` of its outputs when
gradients are wanted; ``Tensor.backward()`` then walks that graph in reverse topological order.

Gradients are plain arrays (no graph of their own): leaflens never needs higher-order derivatives,
and plain arrays keep backward fast and light.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from leaflens.engine.backend import array_module, device_of, to_device, wide_sum
from leaflens.engine.config import grad_enabled


class NonFiniteLossError(FloatingPointError):
    """backward() was called on a loss that is NaN or infinite."""


class GraphFreedError(RuntimeError):
    """backward() reached a part of the graph whose saved values were already released."""


def _as_array(data: Any, dtype: Any = None) -> Any:
    xp = array_module(data)
    if isinstance(data, np.ndarray) or xp is not np:
        return data if dtype is None or data.dtype == dtype else data.astype(dtype)
    if isinstance(data, np.generic):  # NumPy scalars (e.g. from a full reduction) keep their dtype
        return np.asarray(data, dtype=dtype)
    arr = np.asarray(data, dtype=dtype)
    if dtype is None and arr.dtype == np.float64:
        arr = arr.astype(np.float32)  # Python floats and lists: float32 unless asked otherwise
    return arr


class Tensor:
    """An n-dimensional array that can record the operations applied to it."""

    __slots__ = ("data", "grad", "requires_grad", "creator", "name", "__weakref__")
    __array_priority__ = 200  # so ndarray + Tensor calls Tensor.__radd__
    data: Any  # the NumPy or CuPy array

    def __init__(self, data: Any, requires_grad: bool = False, name: str | None = None, dtype: Any = None):
        if isinstance(data, Tensor):
            data = data.data
        self.data = _as_array(data, dtype)
        if requires_grad and self.data.dtype.kind not in "fc":
            raise TypeError(f"only floating-point tensors can require grad, got {self.data.dtype} (a gradient "
                            "would be truncated to it): cast with .astype(np.float32) first")
        self.grad: Any = None
        self.requires_grad = bool(requires_grad)
        self.creator: Function | None = None
        self.name = name

    # ---- array facts -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def device(self) -> str:
        return device_of(self.data)

    @property
    def is_leaf(self) -> bool:
        return self.creator is None

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        body = np.array2string(np.asarray(self.numpy()), precision=4, threshold=20, edgeitems=2)
        extra = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({body}, dtype={self.dtype}{extra})"

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (copied from the GPU if needed)."""
        return to_device(self.data, "cpu")

    def item(self) -> float:
        if self.data.size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {self.shape}")
        return self.data.reshape(()).item()

    def detach(self) -> Tensor:
        """The same values, cut off from the graph."""
        return Tensor(self.data)

    def to(self, device: str) -> Tensor:
        """The same values on ``device`` ("cpu", "cuda"): this tensor itself when it is there already, else a
        copy that gradients flow back through, as through any op."""
        if device_of(self.data) == ("cpu" if device == "cpu" else "cuda"):
            return self
        out = ToDevice(device)(self)
        out.name = self.name
        return out

    def zero_grad(self) -> None:
        self.grad = None

    # ---- backward ----------------------------------------------------------------------------
    def backward(self, grad: Any = None, retain_graph: bool = False, check_finite: bool = True) -> None:
        """Accumulate d(self)/d(leaf) into ``leaf.grad`` for every leaf that requires grad.

        Without ``grad``, self must be a scalar (a loss): a non-finite one raises NonFiniteLossError
        unless ``check_finite`` is False (that check reads the loss on the host, a synchronisation on a
        GPU; ``leaflens.engine.amp.train_step`` makes it together with its other checks instead).
        Intermediate gradients and the values each Function saved for backward are released as soon
        as they are used, unless ``retain_graph`` is set.
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad: no parameter or input "
                               "that requires grad took part in computing it (or it was made under no_grad())")
        xp = array_module(self.data)
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a scalar, but this tensor has shape "
                                   f"{self.shape}; pass grad= of the same shape or reduce it first (e.g. .mean())")
            if check_finite and not bool(xp.isfinite(self.data).all()):
                raise NonFiniteLossError(f"loss is {float(self.data.reshape(()))}: refusing to backpropagate a "
                                         "non-finite loss (check the learning rate, the inputs and the labels)")
            grad = xp.ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else _as_array(grad, self.dtype)
            if tuple(grad.shape) != self.shape:
                raise ValueError(f"backward(): grad has shape {tuple(grad.shape)} but the tensor has shape "
                                 f"{self.shape}")

        if self.creator is None:
            self._accumulate(grad)
            return

        order = _topological_order(self.creator)
        # Gradients of intermediate tensors wait here, keyed by tensor, until their creator runs;
        # holding the tensor keeps its id unique meanwhile. Each is dropped as soon as it is used.
        pending: dict[int, tuple[Tensor, Any]] = {id(self): (self, grad)}
        for fn in order:
            gys = []
            for ref in fn.outputs:
                o = ref()
                entry = pending.pop(id(o), None) if o is not None else None
                gys.append(None if entry is None else entry[1])
            inputs = fn.inputs
            if all(g is None for g in gys):
                if not retain_graph:
                    fn.release()
                continue
            gxs = fn.backward(*gys)
            if not isinstance(gxs, tuple):
                gxs = (gxs,)
            if not retain_graph:
                fn.release()
            for x, gx in zip(inputs, gxs):
                if gx is None or not x.requires_grad:
                    continue
                if x.creator is None:
                    x._accumulate(gx)
                else:
                    prev = pending.get(id(x))
                    pending[id(x)] = (x, gx if prev is None else prev[1] + gx)
            del gys, gxs, inputs

    def _accumulate(self, g: Any) -> None:
        if tuple(g.shape) != self.shape:
            raise RuntimeError(f"internal error: gradient of shape {tuple(g.shape)} for tensor "
                               f"{self.name or ''} of shape {self.shape}")
        if g.dtype != self.data.dtype:
            g = g.astype(self.data.dtype)
        if self.grad is None:
            # Own the array: the same gradient object may have been handed to several inputs.
            self.grad = g.copy()
        else:
            self.grad += g

    # ---- operators (implemented in leaflens.engine.ops) -------------------------------------------------
    def __add__(self, other: Any) -> Tensor:
        return _ops.add(self, other)

    def __radd__(self, other: Any) -> Tensor:
        return _ops.add(other, self)

    def __sub__(self, other: Any) -> Tensor:
        return _ops.sub(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return _ops.sub(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return _ops.mul(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return _ops.mul(other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return _ops.div(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return _ops.div(other, self)

    def __neg__(self) -> Tensor:
        return _ops.neg(self)

    def __pow__(self, exponent: Any) -> Tensor:
        return _ops.pow(self, exponent)

    def __rpow__(self, base: Any) -> Tensor:
        return _ops.pow(base, self)

    def __matmul__(self, other: Any) -> Tensor:
        return _ops.matmul(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return _ops.matmul(other, self)

    def __getitem__(self, key: Any) -> Tensor:
        return _ops.getitem(self, key)

    # In-place arithmetic, as in PyTorch. Under no_grad() it changes the values where they are (an optimiser's
    # p -= lr * p.grad: without it Python fell back to p = p - x, and a loop over the parameters updated nothing).
    # Where autograd records, ``x += y`` is ``x = x + y`` (a running loss, a term that needs gradients: the graph
    # stays whole, and a tensor a graph saved is not changed under it), except on a parameter, which it refuses.
    def __iadd__(self, other: Any) -> Tensor:
        return self._in_place(other, "+")

    def __isub__(self, other: Any) -> Tensor:
        return self._in_place(other, "-")

    def __imul__(self, other: Any) -> Tensor:
        return self._in_place(other, "*")

    def __itruediv__(self, other: Any) -> Tensor:
        return self._in_place(other, "/")

    def _in_place(self, other: Any, symbol: str) -> Tensor:
        op = {"+": _ops.add, "-": _ops.sub, "*": _ops.mul, "/": _ops.div}[symbol]
        recording = grad_enabled()
        if recording and self.requires_grad and self.creator is None:
            raise RuntimeError(
                f"in-place {symbol}= on a tensor that requires grad (a parameter): backward would see the new "
                f"values. Update parameters under no_grad() (with no_grad(): p -= lr * p.grad), or write "
                f"x = x {symbol} y for a new tensor")
        result = op(self, other)  # the engine's own rules: float dtypes must match, integers take the float dtype
        if result.shape != self.shape:
            raise ValueError(f"in-place {symbol}= would change the shape {self.shape} to {result.shape}")
        if result.dtype != self.dtype:
            raise TypeError(f"in-place {symbol}= would store {result.dtype} values in a {self.dtype} tensor: cast "
                            "one with .astype() first")
        # a new tensor where autograd records (the graph stays whole) or the array cannot be written (a read-only
        # memmap; CuPy arrays have no such flag: always writable)
        if recording or not getattr(self.data.flags, "writeable", True):
            return result
        self.data[...] = result.data
        return self

    # comparisons give plain boolean arrays, element by element: they have no gradient
    def __eq__(self, other: Any) -> Any:
        return self.data == _raw(other)

    def __ne__(self, other: Any) -> Any:
        return self.data != _raw(other)

    def __lt__(self, other: Any) -> Any:
        return self.data < _raw(other)

    def __le__(self, other: Any) -> Any:
        return self.data <= _raw(other)

    def __gt__(self, other: Any) -> Any:
        return self.data > _raw(other)

    def __ge__(self, other: Any) -> Any:
        return self.data >= _raw(other)

    __hash__ = object.__hash__

    # ---- method forms of common ops ------------------------------------------------------------
    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.sum(self, axis, keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.mean(self, axis, keepdims)

    def var(self, axis: Any = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
        return _ops.var(self, axis, keepdims, ddof)

    def max(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.max(self, axis, keepdims)

    def min(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.min(self, axis, keepdims)

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _ops.reshape(self, shape)

    def transpose(self, *axes: Any) -> Tensor:
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return _ops.transpose(self, axes or None)

    @property
    def T(self) -> Tensor:  # noqa: N802
        return _ops.transpose(self, None)

    def exp(self) -> Tensor:
        return _ops.exp(self)

    def log(self) -> Tensor:
        return _ops.log(self)

    def sqrt(self) -> Tensor:
        return _ops.sqrt(self)

    def abs(self) -> Tensor:
        return _ops.abs(self)

    def clip(self, lo: float | None, hi: float | None) -> Tensor:
        return _ops.clip(self, lo, hi)

    def astype(self, dtype: Any) -> Tensor:
        return _ops.cast(self, dtype)


def _raw(x: Any) -> Any:
    return x.data if isinstance(x, Tensor) else x


def as_tensor(x: Any, like: Tensor | None = None) -> Tensor:
    """Wrap ``x`` as a Tensor; Python scalars take the dtype and device of ``like``, except a fractional
    scalar beside an integer or boolean ``like``, which becomes float32 (uint8 pixels * (1 / 255) must not be
    truncated to 0)."""
    if isinstance(x, Tensor):
        return x
    if like is not None and np.isscalar(x):
        xp = array_module(like.data)
        dtype = like.dtype
        if dtype.kind not in "fc" and isinstance(x, (float, complex, np.inexact)):
            dtype = np.dtype(np.float32)
        return Tensor(xp.asarray(x, dtype=dtype))
    return Tensor(x)


class Function:
    """One differentiable operation: ``forward`` on arrays, ``backward`` on gradients.

    Subclasses keep what backward needs as attributes set in ``forward``; ``release()`` drops them
    once backward has run, so a training step never holds activations longer than it must.
    ``self.needs_grad[i]`` tells backward whether input i wants a gradient at all (skip the work if not).
    """

    inputs: Sequence[Tensor]
    outputs: Sequence[weakref.ReferenceType[Tensor]]
    needs_grad: tuple[bool, ...]

    def __call__(self, *inputs: Any) -> Any:
        tensors = _coerce_inputs(inputs)
        self.needs_grad = tuple(t.requires_grad for t in tensors)
        record = grad_enabled() and any(self.needs_grad)
        self.recording = record
        ys = self.forward(*[t.data for t in tensors])
        single = not isinstance(ys, tuple)
        # an integer output (a cast to int) has no gradient, even from inputs that have one
        outputs = [Tensor(y, requires_grad=record and y.dtype.kind in "fc") for y in ((ys,) if single else ys)]
        if record:
            self.inputs = tensors
            self.outputs = [weakref.ref(o) for o in outputs]
            for o in outputs:
                o.creator = self
        return outputs[0] if single else tuple(outputs)

    def forward(self, *xs: Any) -> Any:
        raise NotImplementedError

    def backward(self, *gys: Any) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Forget inputs and saved arrays (called by backward once this node is done)."""
        self.__dict__.clear()
        self.__dict__["released"] = True


class ToDevice(Function):
    """Move to another device; the gradient moves back (:meth:`Tensor.to`)."""

    def __init__(self, device: str):
        self.device = device

    def forward(self, x):
        self.src = device_of(x)
        return to_device(x, self.device)

    def backward(self, gy):
        return to_device(gy, self.src)


def _coerce_inputs(inputs: Sequence[Any]) -> list[Tensor]:
    like = next((x for x in inputs if isinstance(x, Tensor)), None)
    tensors = [as_tensor(x, like) for x in inputs]
    floats = [t for t in tensors if t.dtype.kind == "f"]
    if len(floats) > 1:
        dt = floats[0].dtype
        for t in floats[1:]:
            if t.dtype != dt:
                raise TypeError(f"mismatched dtypes {dt} and {t.dtype}: cast one with .astype() first "
                                "(the engine never upcasts silently)")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(f"tensors on different devices {sorted(devices)}: move them with .to(device)")
    return tensors


def _topological_order(root: Function) -> list[Function]:
    """Functions reachable from ``root``, each before the ones that produced its inputs.

    Iterative depth-first search: graphs tens of thousands of nodes deep must not hit Python's
    recursion limit.
    """
    post: list[Function] = []
    seen: set[int] = set()
    stack: list[tuple[Function, bool]] = [(root, False)]
    while stack:
        fn, expanded = stack.pop()
        if expanded:
            post.append(fn)
            continue
        if id(fn) in seen:
            continue
        if getattr(fn, "released", False):
            raise GraphFreedError("backward() through a graph that was already backpropagated and released; "
                                  "pass retain_graph=True to the first backward() to keep it")
        seen.add(id(fn))
        stack.append((fn, True))
        for x in fn.inputs:
            c = x.creator
            if c is not None and id(c) not in seen:
                stack.append((c, False))
    post.reverse()
    return post


def sum_to(g: Any, shape: tuple[int, ...]) -> Any:
    """Sum a broadcast gradient back down to ``shape`` (the inverse of broadcasting)."""
    if tuple(g.shape) == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, s in enumerate(shape) if s == 1 and g.shape[i + lead] != 1)
    g = wide_sum(g, axis=axes, keepdims=True)
    if lead:
        g = g.reshape(g.shape[lead:])
    return g


from leaflens.engine import ops as _ops  # noqa: E402  (operators above dispatch to the op modules)
