"""Dropping the environment's shared libraries from the page cache, so that memory is
measured from one state of it.

A process's resident size counts the library pages it maps (``RssFile``), and how many
it maps for a page it touches depends on how the page cache holds the file. Files pip
has just written sit in the cache as large folios, and the kernel maps a whole folio on
a fault: a bare worker held 143 MB of library pages in a fresh environment against 51
MB once those files were read back from disk, the same code and the same anonymous
memory (small network, `single`, batch 32); a tiny run's working memory, which the
memory model adds to every worker (pipeline/records/memory_runtime.py), read 133 MB
against 93 MB (AMD EPYC, 2026-11-30). Files read back stay in the second state until
they are written again, so that is the state a machine is in for every run but those
right after an install, and the one the machine's memory figures
(pipeline/records/memory.py) and `benchmarks/memory_fit.py` measure in.

Dropping a file's cached pages needs no privilege (``posix_fadvise``), and the pages a
running process maps stay where they are.
"""

from __future__ import annotations

import os
import sys

__all__ = ["evict_library_pages", "shared_libraries"]


def shared_libraries(prefix: str) -> list[str]:
    """The shared libraries (``*.so``, ``*.so.N``) installed under `prefix`."""
    return sorted(os.path.join(root, name) for root, _, names in os.walk(prefix)
                  for name in names if name.endswith(".so") or ".so." in name)


def evict_library_pages(prefix: str = sys.prefix) -> int:
    """Drop the page cache's copy of every shared library under `prefix` (those no
    process maps stay out until read again); the number of files dropped."""
    dropped = 0
    for path in shared_libraries(prefix):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return dropped
