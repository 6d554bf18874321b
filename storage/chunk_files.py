"""The chunk files of this project's Zarr arrays, read and written as plain files.

Every array the project makes (storage/arrays.py) is uncompressed (one ``bytes``
codec, little-endian) and chunked along its first axis only, on a local disk. A
chunk of such an array is a file holding the chunk's values in C order, nothing
else; an edge chunk is stored whole, its rows past the array's end holding the fill
value. Zarr's array machinery costs about 1.2 ms of CPU per chunk here, and a real
CNN's checkpoint is hundreds to thousands of files (ResNet-50 at 64x64: 16,595 by
channel quanta, 1,815 at a two-worker split, metadata included): through Zarr,
seconds where its bytes take milliseconds (`benchmarks.checkpoint_writes`).
`RowChunks` writes and reads those files itself, the same bytes under the same
names as Zarr would (each file made whole under a temporary name, then renamed
into place, as Zarr's local store does), so the arrays stay plain Zarr arrays any
reader opens.

`RowChunks.open` checks the array's metadata first and answers None for any other
layout (compressed, big-endian, chunked along a later axis, a remote store, a big-
endian machine): the caller then goes through Zarr. A write that does not cover
whole chunks (rows starting or ending inside one) is left to Zarr as well, whose
read-modify-write of the chunk it needs.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass

import numpy as np
from zarr.codecs import BytesCodec
from zarr.core.metadata import ArrayV3Metadata

METADATA = "zarr.json"


def plain_rows(meta: ArrayV3Metadata) -> int | None:
    """The rows of each chunk of an array whose chunk files hold its raw values
    (one little-endian ``bytes`` codec, chunked along the first axis only), or None
    for any other array, or on a machine that is not little-endian."""
    chunks = tuple(getattr(meta.chunk_grid, "chunk_shape", None) or ())
    codecs = getattr(meta, "codecs", ())
    shape = tuple(meta.shape)
    if (sys.byteorder != "little" or not shape or len(chunks) != len(shape)
            or chunks[1:] != shape[1:] or len(codecs) != 1
            or not isinstance(codecs[0], BytesCodec)
            or getattr(codecs[0].endian, "value", "little") != "little"
            or getattr(meta, "storage_transformers", ())):
        return None
    return chunks[0]


def native_dtype(meta: ArrayV3Metadata) -> np.dtype:
    """The numpy dtype of the array's chunk bytes (little-endian)."""
    return np.dtype(meta.data_type.to_native_dtype()).newbyteorder("<")


@dataclass(frozen=True)
class RowChunks:
    """One local array's chunk files, chunked every `rows` rows along axis 0."""

    folder: str
    meta: ArrayV3Metadata
    rows: int
    dtype: np.dtype

    @classmethod
    def open(cls, folder: str) -> RowChunks | None:
        """The array whose metadata is in `folder`, or None where Zarr must do the work
        (another layout, or no array there: Zarr then says what is wrong)."""
        try:
            with open(os.path.join(folder, METADATA), "rb") as handle:
                meta = ArrayV3Metadata.from_dict(json.load(handle))
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return cls.of(folder, meta)

    @classmethod
    def of(cls, folder: str, meta: ArrayV3Metadata) -> RowChunks | None:
        """The array in `folder` whose metadata is already read (`meta`), or None for
        a layout Zarr must handle."""
        rows = plain_rows(meta)
        return None if rows is None else cls(folder, meta, rows, native_dtype(meta))

    @property
    def length(self) -> int:
        return int(self.meta.shape[0])

    def chunk_path(self, index: int) -> str:
        """The file of the chunk holding rows [index * rows, (index + 1) * rows)."""
        key = self.meta.encode_chunk_key((index,) + (0,) * (len(self.meta.shape) - 1))
        return os.path.join(self.folder, *key.split("/"))

    def covers_whole_chunks(self, start: int, stop: int) -> bool:
        """Whether rows [start, stop) begin and end on chunk boundaries (the array's
        end counts as one)."""
        return (0 <= start < stop <= self.length and start % self.rows == 0
                and (stop % self.rows == 0 or stop == self.length))

    def write(self, start: int, data: np.ndarray) -> bool:
        """Write `data` as rows [start, start + len(data)); False (nothing written)
        where they do not cover whole chunks, which Zarr must then merge."""
        stop = start + data.shape[0]
        if tuple(data.shape[1:]) != tuple(self.meta.shape[1:]):
            raise ValueError(f"{self.folder}: rows of shape {data.shape[1:]}, the array's "
                             f"are {tuple(self.meta.shape[1:])}")
        if not self.covers_whole_chunks(start, stop):
            return False
        data = np.ascontiguousarray(data, dtype=self.dtype)
        for first in range(start, stop, self.rows):
            rows = data[first - start:first - start + self.rows]
            if len(rows) < self.rows:  # the edge chunk: stored whole, filled past the end
                padded = np.full((self.rows,) + rows.shape[1:], self.meta.fill_value,
                                 dtype=self.dtype)
                padded[:len(rows)] = rows
                rows = padded
            _write_file(self.chunk_path(first // self.rows), memoryview(rows).cast("B"))
        return True

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) (all by default), each chunk's part read straight into
        the result (a slice of a tensor reads only its own bytes); a chunk never
        written reads as the fill value, as in Zarr, and a chunk file of the wrong
        size raises ValueError."""
        stop = self.length if stop is None else stop
        out = np.empty((max(0, stop - start),) + tuple(self.meta.shape[1:]), dtype=self.dtype)
        row_bytes = self.dtype.itemsize * int(np.prod(out.shape[1:]))
        if out.size == 0:
            return out
        for index in range(start // self.rows, -(-stop // self.rows)):
            first = index * self.rows
            low, high = max(start, first), min(stop, first + self.rows)
            target = out[low - start:high - start]
            path = self.chunk_path(index)
            try:
                descriptor = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                target[...] = self.meta.fill_value
                continue
            try:
                size = os.fstat(descriptor).st_size
                if size != self.rows * row_bytes:
                    raise ValueError(f"chunk file {path} holds {size} bytes, "
                                     f"a chunk is {self.rows * row_bytes}")
                got = os.preadv(descriptor, [memoryview(target).cast("B")],
                                (low - first) * row_bytes)
            finally:
                os.close(descriptor)
            if got != target.nbytes:
                raise ValueError(f"chunk file {path}: read {got} of {target.nbytes} bytes")
        return out


def _write_file(path: str, payload: memoryview) -> None:
    """Make `path` hold `payload`: written whole under a temporary name, then renamed
    into place, so that a reader meets the old file or the new, never half of one."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with open(temporary, "wb") as handle:
            handle.write(payload)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
