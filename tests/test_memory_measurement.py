"""Memory is measured from one page-cache state: benchmarks/memory_fit.py's cases and
the machine's own memory figures (pipeline/records/memory.py) alike.

Why: a process's resident peak counts the library pages it maps, and how many it maps
depends on how the page cache holds the library files (a freshly installed
environment's libraries inflated every process by 50-90 MB, and the memory model's
runtimes measured then by 40 MB). The environment's shared libraries are dropped from
the page cache first (pipeline/records/library_pages.py); checked here on a file of our
own, whose residency `mincore` reports. No cluster is started.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import time
from pathlib import Path

from pipeline.records import memory as records_memory
from pipeline.records.library_pages import evict_library_pages, shared_libraries

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(path: Path) -> int:
    """How many of the file's pages the page cache holds (mincore on a mapping that is
    unmapped again before returning, so that it keeps no page in the cache)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = ctypes.create_string_buffer(pages)
        try:
            assert LIBC.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        finally:
            LIBC.munmap(address, size)
        return sum(byte & 1 for byte in vector.raw)
    finally:
        os.close(fd)


def cached_file(path: Path, size: int) -> Path:
    """A file written to disk and read back, so that the page cache holds it clean."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    path.read_bytes()
    return path


def test_the_shared_libraries_are_dropped_from_the_page_cache_and_nothing_else(tmp_path):
    library = cached_file(tmp_path / "lib" / "python3" / "libexample.so.1", 1 << 20)
    other = cached_file(tmp_path / "lib" / "data.bin", 1 << 20)
    assert resident_pages(library) > 0 and resident_pages(other) > 0

    assert shared_libraries(str(tmp_path)) == [str(library)]
    assert evict_library_pages(str(tmp_path)) == 1
    assert resident_pages(library) == 0
    assert resident_pages(other) > 0


def test_the_machines_memory_figures_are_measured_after_the_libraries_are_dropped(
        monkeypatch, tmp_path):
    """A figure not in the cache is measured after the libraries leave the page cache;
    one read back from the cache drops nothing (a run pays no eviction)."""
    monkeypatch.setenv("CNN_MEMORY_CACHE", str(tmp_path / "memory.json"))
    happened: list[str] = []
    monkeypatch.setattr(records_memory, "evict_library_pages",
                        lambda: happened.append("evicted") or 0)

    def measure() -> list[float]:
        happened.append("measured")
        return [123.0]
    assert records_memory._cached(["example", 1], measure) == [123.0]
    assert happened == ["evicted", "measured"]
    assert records_memory._cached(["example", 1], measure) == [123.0]
    assert happened == ["evicted", "measured"]


def test_processes_that_start_together_measure_a_figure_once_and_keep_the_same(
        monkeypatch, tmp_path):
    """Two callers at once (threads here: each opens the key's lock file apart, so its
    flock excludes the other as another process's would): the first measures, the
    second waits and takes what the first kept, and the cache keeps both keys that
    were measured under it."""
    monkeypatch.setenv("CNN_MEMORY_CACHE", str(tmp_path / "memory.json"))
    monkeypatch.setattr(records_memory, "evict_library_pages", lambda: 0)
    measured: list[float] = []

    def measure() -> list[float]:
        time.sleep(0.3)  # long enough for the other caller to arrive meanwhile
        measured.append(100.0 + len(measured))
        return [measured[-1]]

    results: list[list[float]] = []
    callers = [threading.Thread(target=lambda: results.append(
        records_memory._cached(["together", 1], measure))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert measured == [100.0] and results == [[100.0], [100.0]]
    assert records_memory._cached(["other", 1], lambda: [7.0]) == [7.0]
    kept = json.loads((tmp_path / "memory.json").read_text())
    assert sorted(v for v in kept.values()) == [[7.0], [100.0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.json"]  # locks gone
