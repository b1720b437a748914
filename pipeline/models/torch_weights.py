"""Read PyTorch checkpoint files into NumPy arrays without PyTorch and without trusting the pickle.

A ``.pth`` file is a pickle: loading it with plain ``pickle.load`` (or ``torch.load`` without
``weights_only``) runs whatever callable the file names, so a crafted checkpoint can execute code.
This reader uses a restricted :class:`pickle.Unpickler` whose ``find_class`` admits only the few
globals a state dict of tensors needs, and returns inert stand-ins for them (it never imports
torch); any other global is refused with :class:`UnsafeCheckpointError` naming it, before anything
is called. Tensor data never go through the pickle: the pickle only references storages by key
("persistent ids"), which are read here as raw little-endian buffers and viewed with the recorded
dtype, size, stride and storage offset (bounds-checked, so a crafted stride cannot read past a
storage).

Two container formats are handled:

- zip (PyTorch >= 1.6): ``<prefix>/data.pkl`` plus one raw file ``<prefix>/data/<key>`` per storage;
- legacy (PyTorch < 1.6; the shipped EfficientNet-Lite0 file uses it): five consecutive pickles
  (magic number, protocol version, system info, the object, the list of storage keys) followed by
  each storage as an int64 element count and its raw bytes, in key-list order.

The even older tar format (PyTorch < 0.4) is refused with a clear message.

Globals the shipped EfficientNet-Lite0 checkpoint needs (checked with ``pickletools``):
``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``, ``torch.FloatStorage`` and
``torch.LongStorage`` (the ``num_batches_tracked`` counters). The other storage types are admitted
so that checkpoints of other dtypes load too.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import tarfile
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

__all__ = ["ALLOWED_GLOBALS", "CheckpointFormatError", "UnsafeCheckpointError", "load_torch_state_dict",
           "read_torch_checkpoint"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001


class CheckpointFormatError(ValueError):
    """The file is not a PyTorch checkpoint this reader understands, or it is inconsistent."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint's pickle references a global outside the allow-list (nothing was called)."""

    def __init__(self, path: str, global_name: str):
        self.global_name = global_name
        super().__init__(f"{path}: refusing to load: the checkpoint references the global {global_name!r}, "
                         f"which is not one of the tensor-rebuild entries this reader admits "
                         f"({', '.join(sorted(ALLOWED_GLOBALS))})")


@dataclass(frozen=True, slots=True)
class _StorageType:
    """Inert stand-in for ``torch.<Kind>Storage``: only says which dtype the bytes hold."""

    name: str
    dtype: np.dtype
    bfloat16: bool = False


# storage class name -> little-endian NumPy dtype of one element
_STORAGE_DTYPES: dict[str, tuple[str, bool]] = {
    "DoubleStorage": ("<f8", False),
    "FloatStorage": ("<f4", False),
    "HalfStorage": ("<f2", False),
    "BFloat16Storage": ("<u2", True),  # no NumPy bfloat16: widened to float32 on read
    "LongStorage": ("<i8", False),
    "IntStorage": ("<i4", False),
    "ShortStorage": ("<i2", False),
    "CharStorage": ("i1", False),
    "ByteStorage": ("u1", False),
    "BoolStorage": ("?", False),
}
_STORAGE_TYPES = {name: _StorageType(name, np.dtype(dt), bf) for name, (dt, bf) in _STORAGE_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    stype: _StorageType
    numel: int
    offset: int = 0  # element offset into the root storage (legacy storage views)


@dataclass(frozen=True, slots=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> _TensorRef:
    """Stand-in for ``torch._utils._rebuild_tensor_v2``: records where the tensor's data lie."""
    if not isinstance(storage, _StorageRef):
        raise CheckpointFormatError(f"_rebuild_tensor_v2 got {type(storage).__name__} instead of a storage")
    try:
        size_t = tuple(int(s) for s in size)
        stride_t = tuple(int(s) for s in stride)
        offset = int(storage_offset)
    except (TypeError, ValueError) as exc:
        raise CheckpointFormatError(f"_rebuild_tensor_v2: bad size/stride/offset: {exc}") from exc
    if len(size_t) != len(stride_t):
        raise CheckpointFormatError(f"_rebuild_tensor_v2: size {size_t} and stride {stride_t} differ in length")
    return _TensorRef(storage, offset, size_t, stride_t)


class _Callable:
    """A callable with no settable attributes.

    The pickle BUILD opcode can set attributes on any object the pickle holds, including the
    globals ``find_class`` returns; handing out the real ``collections.OrderedDict`` class or a
    plain function would let a crafted file monkeypatch them for the whole process. Instances of
    this slotted class refuse every attribute assignment.
    """

    __slots__ = ("_fn",)
    _fn: Callable[..., Any]

    def __init__(self, fn: Callable[..., Any]):
        object.__setattr__(self, "_fn", fn)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"checkpoint stand-ins are read-only (tried to set {name!r})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


# "module.name" -> the inert object the unpickler hands back instead of the real global
ALLOWED_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": _Callable(collections.OrderedDict),
    "torch._utils._rebuild_tensor_v2": _Callable(_rebuild_tensor_v2),
    **{f"torch.{name}": stype for name, stype in _STORAGE_TYPES.items()},
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only ALLOWED_GLOBALS; storages are resolved through ``persistent_load``."""

    def __init__(self, file: BinaryIO, path: str, storage_ref: Any | None):
        super().__init__(file)
        self._path = path
        self._storage_ref = storage_ref

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(self._path, full)
        return ALLOWED_GLOBALS[full]

    def persistent_load(self, pid: Any) -> Any:
        if self._storage_ref is None:
            raise CheckpointFormatError(f"{self._path}: unexpected persistent id {pid!r} in a header pickle")
        return self._storage_ref(pid)

    def safe_load(self) -> Any:
        """``load()``, with every malformed-pickle failure reported as CheckpointFormatError."""
        try:
            return self.load()
        except (UnsafeCheckpointError, CheckpointFormatError):
            raise
        except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, KeyError, IndexError,
                struct.error, RecursionError) as exc:
            raise CheckpointFormatError(f"{self._path}: malformed checkpoint pickle: {type(exc).__name__}: "
                                        f"{exc}") from exc


def _parse_storage_pid(pid: Any, path: str) -> tuple[_StorageType, str, int, Any]:
    """('storage', storage_type, key, location, numel[, view_metadata]) -> its fields, checked."""
    if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
        raise CheckpointFormatError(f"{path}: unsupported persistent id {pid!r} (expected a 'storage' tuple)")
    stype, key, _location, numel = pid[1:5]
    if not isinstance(stype, _StorageType):
        raise CheckpointFormatError(f"{path}: persistent id names {stype!r}, not a storage type")
    if not isinstance(numel, int) or numel < 0:
        raise CheckpointFormatError(f"{path}: storage {key!r} has an invalid element count {numel!r}")
    return stype, str(key), numel, pid[5] if len(pid) > 5 else None


def _materialise(ref: _TensorRef, storages: dict[str, np.ndarray], path: str) -> np.ndarray:
    """View the storage with the tensor's offset/size/stride (bounds-checked) and copy it out."""
    st = ref.storage
    if st.key not in storages:
        raise CheckpointFormatError(f"{path}: storage {st.key!r} is referenced but its data are missing")
    flat = storages[st.key]
    base = st.offset + ref.offset
    if any(s < 0 for s in ref.size) or any(s < 0 for s in ref.stride) or base < 0:
        raise CheckpointFormatError(f"{path}: tensor with size {ref.size}, stride {ref.stride}, offset {base} "
                                    f"is not supported (negative values)")
    if 0 in ref.size:
        return np.zeros(ref.size, dtype=flat.dtype)
    last = base + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))
    if last >= min(st.offset + st.numel, flat.size):
        raise CheckpointFormatError(f"{path}: tensor with size {ref.size}, stride {ref.stride} and offset {base} "
                                    f"reaches element {last}, past the end of storage {st.key!r} "
                                    f"({flat.size} elements)")
    item = flat.itemsize
    view = np.lib.stride_tricks.as_strided(flat[base:], shape=ref.size, strides=[s * item for s in ref.stride],
                                           writeable=False)
    out = np.array(view, copy=True, order="C")
    if st.stype.bfloat16:
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out.astype(out.dtype.newbyteorder("="), copy=False)


def _resolve(obj: Any, storages: dict[str, np.ndarray], path: str) -> Any:
    """Replace every _TensorRef inside dicts/lists/tuples by its array."""
    if isinstance(obj, _TensorRef):
        return _materialise(obj, storages, path)
    if isinstance(obj, dict):
        out = type(obj)() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _resolve(v, storages, path)
        return out
    if isinstance(obj, list):
        return [_resolve(v, storages, path) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_resolve(v, storages, path) for v in obj)
    if isinstance(obj, (_StorageRef, _StorageType)):
        raise CheckpointFormatError(f"{path}: a bare storage outside a tensor is not supported")
    return obj


def _storage_array(raw: bytes, stype: _StorageType, numel: int, key: str, path: str) -> np.ndarray:
    need = numel * stype.dtype.itemsize
    if len(raw) < need:
        raise CheckpointFormatError(f"{path}: storage {key!r} holds {len(raw)} bytes, {need} expected "
                                    f"({numel} x {stype.name}); the file is truncated or corrupt")
    return np.frombuffer(raw, dtype=stype.dtype, count=numel)


# ---- zip container (PyTorch >= 1.6) ----------------------------------------------------------------------
def _read_zip(path: str) -> Any:
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        pkls = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise CheckpointFormatError(f"{path}: a zip checkpoint must hold exactly one '<prefix>/data.pkl', "
                                        f"found {pkls or 'none'}")
        prefix = pkls[0][: -len("data.pkl")]
        byteorder = "little"
        if f"{prefix}byteorder" in names:
            byteorder = zf.read(f"{prefix}byteorder").decode("ascii", "replace").strip()
        if byteorder != "little":
            raise CheckpointFormatError(f"{path}: byte order {byteorder!r} is not supported (little-endian only)")
        storages: dict[str, np.ndarray] = {}

        def storage_ref(pid: Any) -> _StorageRef:
            stype, key, numel, _ = _parse_storage_pid(pid, path)
            if key not in storages:
                member = f"{prefix}data/{key}"
                try:
                    raw = zf.read(member)
                except KeyError:
                    raise CheckpointFormatError(f"{path}: storage {key!r} has no member {member!r}") from None
                storages[key] = _storage_array(raw, stype, numel, key, path)
            return _StorageRef(key, stype, numel)

        obj = _RestrictedUnpickler(io.BytesIO(zf.read(pkls[0])), path, storage_ref).safe_load()
    return _resolve(obj, storages, path)


# ---- legacy container (PyTorch < 1.6) --------------------------------------------------------------------
def _read_legacy(path: str, f: BinaryIO) -> Any:
    def header() -> Any:
        return _RestrictedUnpickler(f, path, None).safe_load()

    try:
        magic = header()
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{path}: not a PyTorch checkpoint (neither zip nor legacy pickle): "
                                    f"{exc.__cause__ or exc}") from exc
    if magic != LEGACY_MAGIC:
        raise CheckpointFormatError(f"{path}: not a PyTorch checkpoint (bad magic number {magic!r})")
    protocol = header()
    if protocol != LEGACY_PROTOCOL:
        raise CheckpointFormatError(f"{path}: legacy checkpoint protocol {protocol!r} is not supported "
                                    f"(expected {LEGACY_PROTOCOL})")
    sys_info = header()
    if not isinstance(sys_info, dict) or not sys_info.get("little_endian", False):
        raise CheckpointFormatError(f"{path}: only little-endian legacy checkpoints are supported "
                                    f"(system info {sys_info!r})")

    roots: dict[str, tuple[_StorageType, int]] = {}

    def storage_ref(pid: Any) -> _StorageRef:
        stype, key, numel, view = _parse_storage_pid(pid, path)
        prev = roots.setdefault(key, (stype, numel))
        if prev != (stype, numel):
            raise CheckpointFormatError(f"{path}: storage {key!r} is referenced as {prev[1]} x {prev[0].name} "
                                        f"and as {numel} x {stype.name}")
        if view is None:
            return _StorageRef(key, stype, numel)
        # a view of a root storage: (view_key, element offset, view size)
        try:
            _view_key, view_offset, view_size = view
        except (TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: bad storage view metadata {view!r}") from None
        return _StorageRef(key, stype, int(view_size), int(view_offset))

    obj = _RestrictedUnpickler(f, path, storage_ref).safe_load()
    keys = header()
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointFormatError(f"{path}: the storage key list is malformed")
    storages: dict[str, np.ndarray] = {}
    for key in keys:
        if key not in roots:
            raise CheckpointFormatError(f"{path}: storage {key!r} is listed but no tensor references it")
        stype, numel = roots[key]
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointFormatError(f"{path}: file ends before storage {key!r}")
        (count,) = struct.unpack("<q", head)
        if count != numel:
            raise CheckpointFormatError(f"{path}: storage {key!r} declares {count} elements in the data section "
                                        f"but {numel} in the pickle")
        raw = f.read(numel * stype.dtype.itemsize)
        storages[key] = _storage_array(raw, stype, numel, key, path)
    return _resolve(obj, storages, path)


def read_torch_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Unpickle a PyTorch checkpoint safely; tensors come back as NumPy arrays (copies, C order).

    Raises :class:`UnsafeCheckpointError` when the pickle names any global outside
    :data:`ALLOWED_GLOBALS` and :class:`CheckpointFormatError` for anything malformed.
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"PyTorch checkpoint not found: {p}")
    if zipfile.is_zipfile(p):
        return _read_zip(p)
    if tarfile.is_tarfile(p):
        raise CheckpointFormatError(f"{p}: tar-format checkpoints (PyTorch < 0.4) are not supported; re-save it "
                                    f"with a newer PyTorch")
    with open(p, "rb") as f:
        return _read_legacy(p, f)


def load_torch_state_dict(path: str | os.PathLike[str]) -> OrderedDict[str, np.ndarray]:
    """A checkpoint holding a state dict (optionally under a 'state_dict' or 'model' key) as name -> array."""
    obj = read_torch_checkpoint(path)
    if isinstance(obj, dict) and not any(isinstance(v, np.ndarray) for v in obj.values()):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{os.fspath(path)}: holds a {type(obj).__name__}, not a state dict")
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for k, v in obj.items():
        if not isinstance(v, np.ndarray):
            raise CheckpointFormatError(f"{os.fspath(path)}: entry {k!r} is a {type(v).__name__}, not a tensor")
        out[str(k)] = v
    return out
