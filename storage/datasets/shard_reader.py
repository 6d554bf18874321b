"""The fast image reader: one sample's bytes straight out of a shard file.

Zarr spends ~0.3 ms of event-loop overhead per inner chunk, i.e. ~40 ms for a
128-sample batch; the bytes themselves take microseconds to copy from the page
cache. `storage.datasets.reader` uses this reader whenever a store has exactly the
layout `storage.datasets.writer` writes, and Zarr otherwise.

On a network file system (NFS, sshfs, Lustre) each `os.pread` is a round trip to
the server, and a batch's rows one after the other cost a round trip each: 64 rows
took 44-62 ms over sshfs behind a 1gbit link (docs/benchmarks.md). Where a reader's
first batch shows rows that slow (every row's `pread` `ROUND_TRIP_S` or more: the
fastest row decides, so neither opening a shard nor a moment without a core
counts), it reads every later batch with `READ_THREADS` threads at once, each
taking a contiguous part of it; the GIL is released during `pread`, so the round
trips overlap. From the page cache a
row takes microseconds, and threads would only add their wake-ups (about 1 ms a
batch), so there the caller reads alone.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zarr

from storage.checksums import crc32c
from storage.datasets.store import DatasetError


#: Threads that read one batch's rows at once (see the module doc).
READ_THREADS = 8

#: Rows a thread reads at least: smaller batches are read by the caller alone.
ROWS_PER_THREAD = 4

#: Seconds a row takes, at least, where it is a round trip to a file server (from
#: the page cache: a few microseconds).
ROUND_TRIP_S = 50e-6

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    """The process's reading threads, made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="dataset-read")
        return _pool


def _forget_pool_in_child() -> None:
    """A forked child has none of its parent's threads: it makes its own pool."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


class ShardRowReader:
    """Reads one sample's bytes straight out of a shard file with ``os.pread``.

    For the exact layout the writer makes (local files, sharding_indexed with an
    uncompressed little-endian inner chunk of one sample and the index at the end,
    checksummed with crc32c) we follow the Zarr v3 sharding spec directly: the index
    is (chunks_per_shard, 2) uint64 (offset, nbytes), read once per shard. Any other
    layout returns None from `for_array` and Zarr does the reading.
    """

    EXPECTED_INDEX_CODECS = [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "crc32c"},
    ]
    MISSING = 2**64 - 1  # spec: offset and nbytes of an absent inner chunk

    def __init__(self, array_dir: str, shard_rows: int,
                 row_shape: tuple[int, ...], dtype: np.dtype, separator: str,
                 fill_value: Any) -> None:
        self.array_dir = array_dir
        self.shard_rows = shard_rows
        self.row_shape = row_shape
        self.dtype = dtype
        self.row_nbytes = int(np.prod(row_shape)) * dtype.itemsize
        self.separator = separator
        self.fill_value = fill_value
        self._shards: dict[int, tuple[int, np.ndarray]] = {}  # shard -> (fd, index)
        self._lock = threading.Lock()
        self.parallel: bool | None = None  # decided by the first batch's rows (module doc)
        # raw descriptors (pread needs no file object); closed when the reader goes
        weakref.finalize(self, _close_descriptors, self._shards)

    @classmethod
    def for_array(cls, array_dir: str, array: zarr.Array) -> ShardRowReader | None:
        """A reader for `array` if its metadata is exactly the layout above, else None."""
        if sys.byteorder != "little" or not hasattr(os, "pread"):
            return None
        meta = json.loads(json.dumps(array.metadata.to_dict(), default=str))
        try:
            (codec,) = meta["codecs"]
            config = codec["configuration"]
            chunk_shape = tuple(config["chunk_shape"])
            shard_shape = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
            key_encoding = meta["chunk_key_encoding"]
            dtype = np.dtype(meta["data_type"]).newbyteorder("<")
            layout_ok = (
                codec["name"] == "sharding_indexed"
                and config["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
                and config["index_codecs"] == cls.EXPECTED_INDEX_CODECS
                and config["index_location"] == "end"
                and meta["chunk_grid"]["name"] == "regular"
                and key_encoding["name"] == "default"
                and chunk_shape == (1, *array.shape[1:])
                and shard_shape[1:] == chunk_shape[1:]
                and not meta.get("storage_transformers")
            )
        except (KeyError, TypeError, ValueError):
            return None
        if not layout_ok or not os.path.isdir(array_dir):
            return None
        return cls(array_dir, int(shard_shape[0]), chunk_shape[1:], dtype,
                   key_encoding.get("configuration", {}).get("separator", "/"),
                   array.metadata.fill_value)

    def _shard(self, shard: int) -> tuple[int, np.ndarray]:
        """The open file and the decoded index of one shard, cached for the process."""
        cached = self._shards.get(shard)
        if cached is not None:
            return cached
        with self._lock:
            cached = self._shards.get(shard)
            if cached is not None:
                return cached
            key = self.separator.join(["c", str(shard)] + ["0"] * len(self.row_shape))
            file_path = os.path.join(self.array_dir, *key.split("/"))
            try:
                fd = os.open(file_path, os.O_RDONLY)
            except FileNotFoundError:
                raise DatasetError(f"dataset shard missing: {file_path!r}") from None
            index_nbytes = 16 * self.shard_rows + 4
            size = os.fstat(fd).st_size
            raw = os.pread(fd, index_nbytes, size - index_nbytes) if size >= index_nbytes else b""
            if len(raw) != index_nbytes or not _crc32c_ok(raw[:-4], raw[-4:]):
                os.close(fd)
                raise DatasetError(f"dataset shard {file_path!r} has a damaged index")
            index = np.frombuffer(raw[:-4], dtype="<u8").reshape(self.shard_rows, 2)
            self._shards[shard] = (fd, index)
            return fd, index

    def read(self, idx: np.ndarray) -> np.ndarray:
        """The rows `idx` (already range-checked by the caller), in that order."""
        out = np.empty((idx.size, *self.row_shape), dtype=self.dtype)
        rows = idx.tolist()
        parts = min(READ_THREADS, len(rows) // ROWS_PER_THREAD)
        if parts <= 1 or not self.parallel:
            reads: list[float] | None = [] if self.parallel is None else None
            self._read_into(out, rows, 0, len(rows), reads)
            if reads:
                self.parallel = min(reads) >= ROUND_TRIP_S
            return out
        bounds = np.linspace(0, len(rows), parts + 1).astype(int).tolist()
        for _ in _read_pool().map(lambda i: self._read_into(out, rows, bounds[i], bounds[i + 1]),
                                  range(parts)):
            pass  # map re-raises a thread's error here
        return out

    def _read_into(self, out: np.ndarray, rows: list[int], start: int, stop: int,
                   reads: list[float] | None = None) -> None:
        """Rows ``rows[start:stop]`` into the same positions of `out`; with `reads`, each
        row's `pread` seconds appended to it."""
        for position in range(start, stop):
            row = rows[position]
            shard, inner = divmod(row, self.shard_rows)
            fd, index = self._shard(shard)
            offset, nbytes = int(index[inner, 0]), int(index[inner, 1])
            if offset == self.MISSING and nbytes == self.MISSING:
                out[position] = self.fill_value  # Zarr's meaning of an absent chunk
                continue
            started = time.perf_counter()
            data = os.pread(fd, nbytes, offset)
            if reads is not None:
                reads.append(time.perf_counter() - started)
            if nbytes != self.row_nbytes or len(data) != self.row_nbytes:
                raise DatasetError(
                    f"dataset row {row} in {self.array_dir!r} has {len(data)} bytes, "
                    f"expected {self.row_nbytes}"
                )
            out[position] = np.frombuffer(data, dtype=self.dtype).reshape(self.row_shape)


def _close_descriptors(shards: dict[int, tuple[int, np.ndarray]]) -> None:
    """Close a reader's shard files; a function, not a method, so the finalizer that
    calls it holds no reference to the reader."""
    for fd, _ in shards.values():
        try:
            os.close(fd)
        except OSError:
            pass
    shards.clear()


def _crc32c_ok(data: bytes, stored: bytes) -> bool:
    """Check a Zarr crc32c checksum (little-endian, after the data)."""
    return crc32c(data) == int.from_bytes(stored, "little")
