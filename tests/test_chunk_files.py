"""Chunk files written and read as plain files (storage/chunk_files.py) are exactly
Zarr's: the same files with the same bytes, read back by Zarr, and Zarr's arrays
read back by them; other layouts and partial chunks are left to Zarr."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

from storage.arrays import create_array
from storage.chunk_files import RowChunks


def files_of(folder) -> dict[str, bytes]:
    found = {}
    for base, _dirs, names in os.walk(folder):
        for name in names:
            with open(os.path.join(base, name), "rb") as handle:
                found[os.path.relpath(os.path.join(base, name), folder)] = handle.read()
    return found


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
@pytest.mark.parametrize("shape,rows", [((10, 3, 2, 2), 4), ((7,), 7), ((1,), 1),
                                        ((6, 5), 2)])
def test_written_chunk_files_are_the_ones_zarr_writes(tmp_path, dtype, shape, rows):
    values = (np.random.default_rng(0).standard_normal(shape) * 100).astype(dtype)
    root = zarr.open_group(str(tmp_path), mode="w")
    by_zarr = create_array(root, "by_zarr", shape, (rows,) + shape[1:], dtype)
    create_array(root, "as_files", shape, (rows,) + shape[1:], dtype)
    by_zarr[...] = values
    chunks = RowChunks.open(str(tmp_path / "as_files"))
    assert chunks is not None and chunks.rows == rows
    for start in range(0, shape[0], rows * 2):  # two writers' parts, in two calls
        assert chunks.write(start, values[start:start + rows * 2])
    assert files_of(tmp_path / "as_files") == files_of(tmp_path / "by_zarr")
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "as_files"))[...], values)


def test_reads_any_rows_of_a_zarr_array(tmp_path):
    values = np.arange(10 * 3, dtype="float32").reshape(10, 3)
    array = create_array(zarr.open_group(str(tmp_path), mode="w"), "a", (10, 3), (4, 3),
                         "float32")
    array[...] = values
    chunks = RowChunks.open(str(tmp_path / "a"))
    np.testing.assert_array_equal(chunks.read(), values)
    for start, stop in [(0, 10), (3, 9), (4, 8), (9, 10), (1, 2), (5, 5)]:
        np.testing.assert_array_equal(chunks.read(start, stop), values[start:stop])


def test_a_chunk_never_written_reads_as_the_fill_value_and_a_torn_one_raises(tmp_path):
    create_array(zarr.open_group(str(tmp_path), mode="w"), "a", (8, 2), (4, 2), "float32")
    chunks = RowChunks.open(str(tmp_path / "a"))
    assert chunks.write(4, np.ones((4, 2), "float32"))
    np.testing.assert_array_equal(chunks.read(), [[0, 0]] * 4 + [[1, 1]] * 4)
    with open(chunks.chunk_path(1), "r+b") as handle:
        handle.truncate(5)
    with pytest.raises(ValueError, match="holds 5 bytes, a chunk is 32"):
        chunks.read(4, 6)


def test_rows_that_split_a_chunk_are_left_to_zarr(tmp_path):
    create_array(zarr.open_group(str(tmp_path), mode="w"), "a", (8, 2), (4, 2), "float32")
    chunks = RowChunks.open(str(tmp_path / "a"))
    for start, rows in [(2, 4), (0, 3), (4, 1), (6, 2)]:
        assert not chunks.write(start, np.ones((rows, 2), "float32"))
    assert files_of(tmp_path / "a").keys() == {"zarr.json"}  # nothing written
    with pytest.raises(ValueError, match="rows of shape"):
        chunks.write(0, np.ones((4, 3), "float32"))


def test_other_layouts_and_missing_arrays_are_left_to_zarr(tmp_path):
    root = zarr.open_group(str(tmp_path), mode="w")
    root.create_array("compressed", shape=(8, 2), chunks=(4, 2), dtype="float32")
    root.create_array("by_column", shape=(8, 2), chunks=(8, 1), dtype="float32",
                      compressors=None)
    root.create_array("big_endian", shape=(8,), chunks=(4,), dtype=">f4", compressors=None,
                      serializer=zarr.codecs.BytesCodec(endian="big"))
    for name in ("compressed", "by_column", "big_endian", "missing"):
        assert RowChunks.open(str(tmp_path / name)) is None, name
