"""Small Zarr helpers shared by the workspace and the checkpoints.

Arrays are created uncompressed with ``write_empty_chunks=True``: on this machine
Zarr's empty-chunk scan and the default Zstd compressor cost far more time than the
bytes they save on activations (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Iterable
from typing import NamedTuple

import zarr
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.common import ZARR_JSON
from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata
from zarr.core.sync import sync
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
    one by one, 0.42 s at once here). The documents are written concurrently, as
    `zarr.create_hierarchy` would, but every write is awaited to its end before the
    first failure is raised: `create_hierarchy` raises at the first and leaves the
    others' errors unretrieved, which asyncio then prints as tracebacks (a disk that
    fills while a checkpoint is made fails hundreds of writes at once). Parent groups
    missing are made; those that exist are left as they are, attributes included."""
    prefix = f"{group.path}/" if group.path else ""
    nodes = {prefix + name: _metadata(layout) for name, layout in arrays.items()}
    sync(_create_nodes(group.store, nodes))


async def _create_nodes(store: Store, arrays: dict[str, ArrayV3Metadata]) -> None:
    parents = sorted({"/".join(path.split("/")[:depth]) for path in arrays
                      for depth in range(path.count("/") + 1)} - set(arrays))
    there = await asyncio.gather(*(store.exists(_document(path)) for path in parents))
    nodes: dict[str, ArrayV3Metadata | GroupMetadata] = {
        path: GroupMetadata(zarr_format=3) for path, found in zip(parents, there) if not found}
    await _all_of(store.delete_dir(path) for path in arrays)  # replaced: chunks and all
    nodes.update(arrays)
    prototype = default_buffer_prototype()
    await _all_of(store.set(_document(path), document)
                  for path, node in nodes.items()
                  for document in node.to_buffer_dict(prototype).values())


def _document(path: str) -> str:
    """The key of the metadata document of the node at `path` ("" is the root)."""
    return f"{path}/{ZARR_JSON}" if path else ZARR_JSON


async def _all_of(writes: Iterable[Awaitable[object]]) -> None:
    """Await every one of `writes`, then raise the first failure (if any)."""
    for outcome in await asyncio.gather(*writes, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


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
