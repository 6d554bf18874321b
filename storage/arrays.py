"""Small Zarr helpers shared by the workspace and the checkpoints.

Arrays are created uncompressed with ``write_empty_chunks=True``: on this machine
Zarr's empty-chunk scan and the default Zstd compressor cost far more time than the
bytes they save on activations (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import zarr
from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata
from zarr.storage import MemoryStore

FAST_ARRAY_CONFIG = {"write_empty_chunks": True}


class ArrayLayout(NamedTuple):
    """One array to create: its shape, chunk shape and dtype (``"float32"``)."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str


def create_array(group: zarr.Group, name: str, shape: tuple[int, ...],
                 chunks: tuple[int, ...], dtype: str, attrs: dict | None = None) -> zarr.Array:
    """Create (or replace) an uncompressed array inside `group`."""
    return group.create_array(
        name, shape=shape, chunks=chunks, dtype=dtype, compressors=None,
        fill_value=0, overwrite=True, config=FAST_ARRAY_CONFIG, attributes=attrs or {},
    )


def create_arrays(group: zarr.Group, arrays: dict[str, ArrayLayout]) -> None:
    """Create (or replace, chunks and all) many arrays inside `group` at once, each
    as `create_array` makes it.

    Why not `create_array` in a loop: Zarr then writes one metadata document after the
    other, and a checkpoint holds two arrays per tensor (ResNet-50's, 640 arrays: 2.4 s
    one by one, 0.42 s at once here). `zarr.create_hierarchy` writes them concurrently.
    Parent groups missing are made; those that exist are left as they are, attributes
    included."""
    prefix = f"{group.path}/" if group.path else ""
    nodes: dict[str, ArrayV3Metadata | GroupMetadata] = {
        prefix + name: _metadata(layout) for name, layout in arrays.items()}
    for _ in zarr.create_hierarchy(store=group.store, nodes=nodes, overwrite=True):
        pass


def _metadata(layout: ArrayLayout) -> ArrayV3Metadata:
    """The metadata document `create_array` writes for `layout`: its dtype's document
    as Zarr makes it (codecs, fill value), with the layout's shape and chunks."""
    document = dict(_template_document(layout.dtype), shape=list(layout.shape),
                    chunk_grid={"name": "regular",
                                "configuration": {"chunk_shape": list(layout.chunks)}})
    return ArrayV3Metadata.from_dict(document)


@functools.lru_cache(maxsize=16)
def _template_document(dtype: str) -> dict:
    return zarr.create_array(MemoryStore(), shape=(1,), chunks=(1,), dtype=dtype,
                             compressors=None, fill_value=0).metadata.to_dict()


@functools.lru_cache(maxsize=512)
def open_cached(store: str, path: str) -> zarr.Array:
    """Open an array once per process: workers touch the same arrays every step.

    The metadata is read once; the array's shape never changes during a run (the
    master recreates a workspace before a run starts, which uses fresh paths).
    """
    return zarr.open_array(store, path=path, mode="r+", config=FAST_ARRAY_CONFIG)
