"""Streaming writers and readers for ``.npy`` arrays, and file checksums.

Arrays are created with ``numpy.lib.format.open_memmap`` (header + preallocated size) and then
filled row by row through ordinary file writes at the right offset. That keeps the process's
memory flat however many images there are: dirty pages of a long-lived mapping would count
towards RSS, file writes only touch the page cache.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import numpy as np
from numpy.lib.format import open_memmap

_CHUNK_BYTES = 1 << 20


class NpyRowWriter:
    """Append rows of a fixed shape/dtype to a preallocated ``.npy`` file."""

    def __init__(self, path: str | os.PathLike, rows: int, row_shape: tuple[int, ...], dtype) -> None:
        self.path = os.fspath(path)
        self.rows = rows
        self.row_shape = tuple(row_shape)
        self.dtype = np.dtype(dtype)
        mm = open_memmap(self.path, mode="w+", dtype=self.dtype, shape=(rows, *self.row_shape))
        self.offset = int(mm.offset)
        del mm
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.written = 0
        self._fh = open(self.path, "r+b")  # noqa: SIM115 - closed in close()
        self._fh.seek(self.offset)

    def write(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path}: row shape {rows.shape[1:]} != {self.row_shape}")
        if self.written + len(rows) > self.rows:
            raise ValueError(f"{self.path}: more than the {self.rows} rows it was created for")
        self._fh.write(rows.tobytes())
        self.written += len(rows)

    def close(self) -> None:
        if self._fh.closed:
            return
        self._fh.close()
        if self.written != self.rows:
            raise ValueError(f"{self.path}: wrote {self.written} rows, expected {self.rows}")

    def abort(self) -> None:
        """Close without the row-count check (the caller is discarding the file)."""
        self._fh.close()

    def __enter__(self) -> NpyRowWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def iter_npy_rows(path: str | os.PathLike, chunk_rows: int) -> Iterator[np.ndarray]:
    """Read a ``.npy`` file's rows sequentially in chunks without mapping the whole file."""
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    shape, dtype, offset = arr.shape, arr.dtype, int(arr.offset)
    del arr
    row_items = int(np.prod(shape[1:], dtype=np.int64))
    with open(path, "rb") as fh:
        fh.seek(offset)
        for start in range(0, shape[0], chunk_rows):
            n = min(chunk_rows, shape[0] - start)
            buf = np.fromfile(fh, dtype=dtype, count=n * row_items)
            if buf.size != n * row_items:
                raise ValueError(f"{path}: file ends early at row {start + buf.size // max(row_items, 1)}")
            yield buf.reshape((n, *shape[1:]))


def sha256_file(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def npy_expected_size(path: str | os.PathLike) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, total bytes the file must have) read from a ``.npy`` header."""
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        offset = fh.tell()
    if fortran:
        raise ValueError(f"{path}: Fortran-ordered arrays are not expected here")
    count = int(np.prod(shape, dtype=np.int64))
    return tuple(shape), np.dtype(dtype), offset + count * np.dtype(dtype).itemsize
