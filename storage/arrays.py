"""Small Zarr helpers shared by the workspace and the checkpoints.

Arrays are created uncompressed with ``write_empty_chunks=True``: on this machine
Zarr's empty-chunk scan and the default Zstd compressor cost far more time than the
bytes they save on activations (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import zarr

FAST_ARRAY_CONFIG = {"write_empty_chunks": True}


def create_array(group: zarr.Group, name: str, shape: tuple[int, ...],
                 chunks: tuple[int, ...], dtype: str, attrs: dict | None = None) -> zarr.Array:
    """Create (or replace) an uncompressed array inside `group`."""
    return group.create_array(
        name, shape=shape, chunks=chunks, dtype=dtype, compressors=None,
        fill_value=0, overwrite=True, config=FAST_ARRAY_CONFIG, attributes=attrs or {},
    )


@functools.lru_cache(maxsize=512)
def open_cached(store: str, path: str) -> zarr.Array:
    """Open an array once per process: workers touch the same arrays every step.

    The metadata is read once; the array's shape never changes during a run (the
    master recreates a workspace before a run starts, which uses fresh paths).
    """
    return zarr.open_array(store, path=path, mode="r+", config=FAST_ARRAY_CONFIG)
