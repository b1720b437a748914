"""A stand-in for CuPy that runs on NumPy and counts every host synchronisation.

On a GPU every read of a device value by the host (``float()``, ``int()``, ``bool()``, ``.item()``,
``.get()``, ``asnumpy``, ``tolist()``, ``np.asarray`` of a device array, a boolean-mask index or a
``nonzero`` whose result size depends on the data) blocks Python until the device has drained its
queue, and the GPU then idles while Python prepares the next kernels. On the CPU such reads cost
nothing, so they creep in unseen. :func:`counting_device` makes them visible on any machine: it
installs a module with CuPy's surface as the engine's GPU backend (``leaflens.engine.backend``), whose
arrays (:class:`DeviceArray`) wrap NumPy arrays and record each host conversion in a
:class:`SyncCounter`, with the line of code that asked for it. Real training code then runs "on the
device" unchanged, and a test can count its synchronisations per step.

Faithful to CuPy where it matters for counting: reductions and scalar indexing give 0-d device
arrays, never host scalars; a host NumPy array (one or more dimensions) mixed into a device
computation raises ``TypeError`` as CuPy does; ``xp.asarray(host)`` is an upload (no sync). The
CUDA stream and event API (``xp.cuda``) is a set of no-ops, since NumPy finishes each operation
before it returns. The hand-written CUDA kernels are switched off inside :func:`counting_device`
(they need a real GPU), so the ops run their generic ``xp`` code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DeviceArray", "SyncCounter", "counting_device", "counting_module"]

_HERE = os.path.abspath(__file__)
_BACKEND = os.path.join(os.path.dirname(_HERE), "backend.py")

# Functions whose output size depends on the values: CuPy must read a count back to allocate it.
_DATA_DEPENDENT = frozenset({"nonzero", "flatnonzero", "argwhere", "unique", "extract", "compress", "trim_zeros"})
# Functions that may take host data: they are the uploads.
_UPLOADS = frozenset({"asarray", "array", "asanyarray", "ascontiguousarray"})


@dataclass
class SyncCounter:
    """Host synchronisations seen so far: ``(kind, where)`` per event, oldest first."""

    events: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.events)

    def record(self, kind: str) -> None:
        self.events.append((kind, _caller()))

    def since(self, start: int) -> list[tuple[str, str]]:
        """The events after the first ``start`` (a snapshot of :attr:`total` taken earlier)."""
        return self.events[start:]

    def by_site(self, start: int = 0) -> Counter[str]:
        """How often each ``kind at file:line`` occurred after the first ``start`` events."""
        return Counter(f"{kind} at {where}" for kind, where in self.events[start:])


def _caller() -> str:
    """Where a read came from: the first two frames outside this module, NumPy and the backend's
    ``to_device`` (``innermost < its caller``, as file:line)."""
    sites: list[str] = []
    f: types.FrameType | None = sys._getframe(2)
    while f is not None and len(sites) < 2:
        path = os.path.abspath(f.f_code.co_filename)
        if path != _HERE and f"{os.sep}numpy{os.sep}" not in path and not path.endswith((">", _BACKEND)):
            rel = os.path.relpath(path)
            sites.append(f"{path if rel.startswith('..') else rel}:{f.f_lineno}")
        f = f.f_back
    return " < ".join(sites) or "?"


_counter = SyncCounter()  # replaced by counting_device(); module level so arrays need no back reference


def _unwrap(x: Any) -> Any:
    if isinstance(x, DeviceArray):
        return x._a
    if type(x) in (list, tuple):
        return type(x)(_unwrap(v) for v in x)
    return x


def _wrap(r: Any) -> Any:
    if isinstance(r, np.ndarray):
        return DeviceArray(r)
    if isinstance(r, np.generic):  # CuPy gives 0-d arrays where NumPy gives scalars
        return DeviceArray(np.asarray(r))
    if type(r) in (list, tuple):
        return type(r)(_wrap(v) for v in r)
    return r


def _refuse_host(args: Any, what: str) -> None:
    """CuPy refuses host arrays in device computations; so does the stand-in (a bug on a real GPU)."""
    for a in args:
        if isinstance(a, np.ndarray) and a.ndim > 0:
            raise TypeError(f"{what}: a host NumPy array of shape {a.shape} mixed into a device computation "
                            "(CuPy refuses this: upload it with xp.asarray first)")
        if type(a) in (list, tuple):
            _refuse_host(a, what)


def _operand(x: Any) -> bool:
    return isinstance(x, (DeviceArray, np.ndarray, np.generic, int, float, complex, bool))


def _call(func: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` (a NumPy function) on unwrapped arguments, its arrays wrapped as device arrays."""
    if name in _DATA_DEPENDENT or (name == "where" and len(args) + len(kwargs) == 1):
        _counter.record(f"xp.{name} (size depends on the data)")
    if name not in _UPLOADS:
        _refuse_host(args, f"xp.{name}")
        _refuse_host(tuple(kwargs.values()), f"xp.{name}")
    elif args and not isinstance(args[0], DeviceArray):  # an upload: a copy, sharing no memory with the host
        return DeviceArray(np.array(args[0], dtype=kwargs.get("dtype", args[1] if len(args) > 1 else None)))
    out = kwargs.get("out")
    r = func(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
    return out if isinstance(out, DeviceArray) else _wrap(r)


def _binary(ufunc: np.ufunc) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    def forward(self: DeviceArray, other: Any) -> Any:
        return ufunc(self, other) if _operand(other) else NotImplemented

    def reverse(self: DeviceArray, other: Any) -> Any:
        return ufunc(other, self) if _operand(other) else NotImplemented

    def inplace(self: DeviceArray, other: Any) -> Any:
        return ufunc(self, other, out=(self,)) if _operand(other) else NotImplemented

    return forward, reverse, inplace


class DeviceArray:
    """A NumPy array posing as a CuPy one: every read by the host is recorded in the active counter."""

    __slots__ = ("_a",)
    __array_priority__ = 100  # below Tensor's, so ``array * tensor`` is the tensor's operation
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    # ---- facts the host knows without asking the device --------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: DeviceArray(self._a.T))

    def __len__(self) -> int:
        return len(self._a)

    # ---- host conversions: each one a synchronisation on a GPU --------------------------------------
    def __bool__(self) -> bool:
        _counter.record("bool()")
        return bool(self._a)

    def __float__(self) -> float:
        _counter.record("float()")
        return float(self._a)

    def __int__(self) -> int:
        _counter.record("int()")
        return int(self._a)

    def __index__(self) -> int:
        _counter.record("int()")
        return self._a.__index__()

    def __complex__(self) -> complex:
        _counter.record("complex()")
        return complex(self._a)

    def item(self, *args: Any) -> Any:
        _counter.record(".item()")
        return self._a.item(*args)

    def tolist(self) -> Any:
        _counter.record(".tolist()")
        return self._a.tolist()

    def get(self, stream: Any = None) -> np.ndarray:
        _counter.record(".get()")
        return self._a.copy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        _counter.record("np.asarray()")
        return np.array(self._a, dtype=dtype, copy=True)

    def __repr__(self) -> str:
        _counter.record("repr()")
        return f"DeviceArray({self._a!r})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        _counter.record("format()")
        return format(self._a.item() if self._a.ndim == 0 else self._a, spec)

    # ---- uploads --------------------------------------------------------------------------------------
    def set(self, host: np.ndarray, stream: Any = None) -> None:
        """Copy ``host`` into this array (CuPy's asynchronous upload)."""
        self._a[...] = host

    # ---- NumPy's protocols: device in, device out --------------------------------------------------
    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if not all(_operand(x) for x in inputs):
            return NotImplemented
        _refuse_host(inputs, f"np.{ufunc.__name__}")
        out = kwargs.get("out")
        kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
        r = getattr(ufunc, method)(*_unwrap(inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return None if method == "at" else _wrap(r)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        if not all(issubclass(t, (DeviceArray, np.ndarray)) for t in types_):
            return NotImplemented
        return _call(func, func.__name__, tuple(args), dict(kwargs))

    # ---- indexing ----------------------------------------------------------------------------------
    def _key(self, key: Any) -> Any:
        items = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, DeviceArray) and k.dtype == np.bool_ and k.ndim > 0 for k in items):
            _counter.record("boolean-mask index (size depends on the data)")
        return _unwrap(key)  # host index arrays are fine: CuPy uploads them

    def __getitem__(self, key: Any) -> DeviceArray:
        return _wrap(self._a[self._key(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[self._key(key)] = _unwrap(value)

    def __iter__(self) -> Iterator[DeviceArray]:
        for i in range(len(self._a)):
            yield self[i]

    # ---- methods: NumPy's, with device results ------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # never hand NumPy the raw buffer (__array_interface__, ...): that read is __array__
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr)

        def method(*args: Any, **kwargs: Any) -> Any:
            _refuse_host(args, f".{name}()")
            return _wrap(attr(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))

        return method

    def __neg__(self) -> Any:
        return np.negative(self)

    def __pos__(self) -> Any:
        return np.positive(self)

    def __abs__(self) -> Any:
        return np.absolute(self)

    def __invert__(self) -> Any:
        return np.invert(self)

    __add__, __radd__, __iadd__ = _binary(np.add)
    __sub__, __rsub__, __isub__ = _binary(np.subtract)
    __mul__, __rmul__, __imul__ = _binary(np.multiply)
    __truediv__, __rtruediv__, __itruediv__ = _binary(np.true_divide)
    __floordiv__, __rfloordiv__, __ifloordiv__ = _binary(np.floor_divide)
    __mod__, __rmod__, __imod__ = _binary(np.remainder)
    __pow__, __rpow__, __ipow__ = _binary(np.power)
    __matmul__, __rmatmul__, __imatmul__ = _binary(np.matmul)
    __and__, __rand__, __iand__ = _binary(np.bitwise_and)
    __or__, __ror__, __ior__ = _binary(np.bitwise_or)
    __xor__, __rxor__, __ixor__ = _binary(np.bitwise_xor)
    __lt__ = _binary(np.less)[0]
    __le__ = _binary(np.less_equal)[0]
    __gt__ = _binary(np.greater)[0]
    __ge__ = _binary(np.greater_equal)[0]
    __eq__ = _binary(np.equal)[0]
    __ne__ = _binary(np.not_equal)[0]


class _Stream:
    """CuPy's stream, as no-ops: the stand-in computes eagerly, so nothing is ever queued."""

    def __init__(self, non_blocking: bool = False) -> None:
        self.non_blocking = non_blocking

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    @property
    def done(self) -> bool:
        return True


_CURAND = types.SimpleNamespace(CURAND_RNG_PSEUDO_PHILOX4_32_10=104)  # cupy.cuda.curand's constant


def _cuda_namespace() -> types.SimpleNamespace:
    current = _Stream()
    return types.SimpleNamespace(
        Stream=_Stream, Event=_Event, get_current_stream=lambda: current,
        alloc_pinned_memory=lambda nbytes: bytearray(int(nbytes)),
        Device=lambda device=0: types.SimpleNamespace(id=int(device)),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1), curand=_CURAND)


class _RandomState:
    """``cupy.random.RandomState`` (a device generator): NumPy's legacy generator, draws as device arrays."""

    def __init__(self, seed: int | None = None, method: Any = None) -> None:
        self._rs = np.random.RandomState(None if seed is None else int(seed) % 2**32)

    def seed(self, seed: int | None = None) -> None:
        self._rs.seed(None if seed is None else int(seed) % 2**32)

    def random_sample(self, size: Any = None, dtype: Any = float) -> DeviceArray:
        return DeviceArray(np.asarray(self._rs.random_sample(size), dtype=dtype))


class _RandomProxy(types.ModuleType):
    """``cupy.random``: ``RandomState`` as above, the module functions NumPy's with device results."""

    RandomState = _RandomState

    def __getattr__(self, name: str) -> Any:
        return getattr(_NumpyProxy("leaflens_counting_cupy.random", np.random), name)


class _NumpyProxy(types.ModuleType):
    """``numpy`` (or one of its submodules) with device arrays in and out."""

    def __init__(self, name: str, target: types.ModuleType) -> None:
        super().__init__(name)
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if isinstance(attr, types.ModuleType):
            return _NumpyProxy(f"{self.__name__}.{name}", attr)
        if isinstance(attr, (type, np.ufunc)) or not callable(attr):
            return attr  # dtypes, classes, constants; ufuncs dispatch through DeviceArray.__array_ufunc__

        def function(*args: Any, **kwargs: Any) -> Any:
            return _call(attr, name, args, kwargs)

        return function


def counting_module() -> types.ModuleType:
    """A fresh module with CuPy's surface over NumPy (``ndarray`` is :class:`DeviceArray`)."""
    xp = _NumpyProxy("leaflens_counting_cupy", np)
    xp.ndarray = DeviceArray  # type: ignore[attr-defined]
    xp.cuda = _cuda_namespace()  # type: ignore[attr-defined]
    xp.random = _RandomProxy("leaflens_counting_cupy.random")  # type: ignore[attr-defined]

    def asnumpy(a: Any, stream: Any = None) -> np.ndarray:
        if isinstance(a, DeviceArray):
            _counter.record("xp.asnumpy()")
            return a._a.copy()
        return np.asarray(a)

    xp.asnumpy = asnumpy  # type: ignore[attr-defined]
    return xp


@contextlib.contextmanager
def counting_device() -> Iterator[SyncCounter]:
    """Make the stand-in the engine's GPU backend inside the block; yields its :class:`SyncCounter`.

    ``to_device(x, "cuda")``, ``model.to("cuda")`` and ``DeviceLoader(..., "cuda")`` all land on the
    stand-in, and ``leaflens.engine.backend.array_module`` answers it for its arrays. The hand-written
    kernels are off in this thread meanwhile. Everything is put back on exit (a real CuPy included).
    The switch is process-wide: no other thread should compute on a real GPU meanwhile.
    """
    from leaflens.engine import backend  # noqa: PLC0415  (engine/__init__ imports the ops, which import this)
    from leaflens.engine.ops import _kernels  # noqa: PLC0415

    global _counter
    before = backend._cupy, backend._cupy_checked, _counter
    counter = SyncCounter()
    backend._cupy, backend._cupy_checked, _counter = counting_module(), True, counter
    stubs = _cupy_import_stubs()
    try:
        with _kernels.use_kernels(False):
            yield counter
    finally:
        backend._cupy, backend._cupy_checked, _counter = before
        for name in stubs:
            sys.modules.pop(name, None)


def _cupy_import_stubs() -> list[str]:
    """Without CuPy installed, ``from cupy.cuda import curand`` (the device dropout's one import) must still
    work: put stand-in modules for ``cupy`` and ``cupy.cuda`` in ``sys.modules``; returns their names.

    They carry no ``ndarray``, so nothing takes them for CuPy itself. With CuPy installed, nothing is
    stubbed: the import gets the real constant, which the stand-in's generator ignores.
    """
    if "cupy" in sys.modules or importlib.util.find_spec("cupy") is not None:
        return []
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    cuda.curand = _CURAND  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    sys.modules["cupy"], sys.modules["cupy.cuda"] = cupy, cuda
    return ["cupy.cuda", "cupy"]
