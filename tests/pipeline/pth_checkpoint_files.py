"""Hand-written PyTorch checkpoints for tests: pickle opcodes emitted directly, no torch involved.

Writing the opcodes (protocol 2, as torch.save does) keeps the tests free of PyTorch and lets them
name any global, including ones no honest checkpoint would hold (``os.system``), which is the point.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
STORAGE_NAMES = {np.dtype("float32"): "FloatStorage", np.dtype("float64"): "DoubleStorage",
                 np.dtype("float16"): "HalfStorage", np.dtype("int64"): "LongStorage",
                 np.dtype("int32"): "IntStorage", np.dtype("uint8"): "ByteStorage", np.dtype("bool"): "BoolStorage"}


class Raw:
    """Opcode bytes spliced into the pickle as one value (e.g. a call to a forbidden global)."""

    def __init__(self, data: bytes):
        self.data = data


class TensorSpec:
    """A tensor as torch would store it: a view (offset, size, stride) into a flat storage."""

    def __init__(self, key: str, storage: np.ndarray, offset: int, size: tuple[int, ...], stride: tuple[int, ...]):
        self.key, self.storage, self.offset, self.size, self.stride = key, storage.ravel(), offset, size, stride

    @classmethod
    def of(cls, key: str, array: np.ndarray) -> TensorSpec:
        a = np.ascontiguousarray(array)
        strides = tuple(s // a.itemsize for s in a.strides) if a.ndim else ()
        return cls(key, a, 0, a.shape, strides)

    def expected(self) -> np.ndarray:
        item = self.storage.itemsize
        return np.lib.stride_tricks.as_strided(self.storage[self.offset:], self.size,
                                               [s * item for s in self.stride]).copy()


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _tuple(items: Iterable[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def call(module: str, name: str, *args: Any) -> Raw:
    """``module.name(*args)`` as opcodes (args: str or int)."""
    return Raw(glob(module, name) + _tuple(_str(a) if isinstance(a, str) else _int(a) for a in args) + b"R")


def _value(v: Any, legacy: bool) -> bytes:
    if isinstance(v, Raw):
        return v.data
    if isinstance(v, TensorSpec):
        # legacy persistent ids end with the view metadata (None: no view); zip ones have no such field
        pid = _tuple([_str("storage"), glob("torch", STORAGE_NAMES[v.storage.dtype]), _str(v.key), _str("cpu"),
                      _int(v.storage.size)] + ([b"N"] if legacy else []))
        args = [pid + b"Q", _int(v.offset), _tuple(map(_int, v.size)), _tuple(map(_int, v.stride)), b"\x89",
                glob("collections", "OrderedDict") + b")R"]
        return glob("torch._utils", "_rebuild_tensor_v2") + _tuple(args) + b"R"
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, int):
        return _int(v)
    raise TypeError(f"cannot emit {v!r}")


def state_dict_pickle(entries: dict[str, Any], extra: bytes = b"", legacy: bool = True) -> bytes:
    """An OrderedDict of ``entries`` (TensorSpec / Raw / str / int values), then ``extra`` opcodes."""
    body = b"".join(_str(k) + _value(v, legacy) + b"s" for k, v in entries.items())
    return b"\x80\x02" + glob("collections", "OrderedDict") + b")R" + body + extra + b"."


def storages(entries: dict[str, Any]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for v in entries.values():
        if isinstance(v, TensorSpec):
            out[v.key] = v.storage
    return out


def write_legacy(path: Path, entries: dict[str, Any], extra: bytes = b"", corrupt_count: bool = False) -> Path:
    """The pre-1.6 format: magic, protocol, sys info, the object, the storage keys, then the storages."""
    f = io.BytesIO()
    for obj in (LEGACY_MAGIC, 1001, {"protocol_version": 1001, "little_endian": True,
                                     "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(obj, f, protocol=2)
    f.write(state_dict_pickle(entries, extra))
    st = storages(entries)
    pickle.dump(list(st), f, protocol=2)
    for arr in st.values():
        f.write(struct.pack("<q", arr.size + (1 if corrupt_count else 0)))
        f.write(arr.astype(arr.dtype.newbyteorder("<")).tobytes())
    path.write_bytes(f.getvalue())
    return path


def write_zip(path: Path, entries: dict[str, Any], extra: bytes = b"", prefix: str = "archive") -> Path:
    """The >= 1.6 format: ``<prefix>/data.pkl`` and one raw file per storage."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{prefix}/data.pkl", state_dict_pickle(entries, extra, legacy=False))
        zf.writestr(f"{prefix}/byteorder", "little")
        for key, arr in storages(entries).items():
            zf.writestr(f"{prefix}/data/{key}", arr.tobytes())
        zf.writestr(f"{prefix}/version", "3\n")
    return path
