"""The batch reader: the rows of a split by sample index, as workers read them each step.

The master of a run only sends sample indices; every worker opens the store itself
and reads the rows it needs (docs/design.md, "One step"). Workers call `read_batch` or
`read_labels` every step, so the opened arrays (and the labels, which are small) are
cached per process, and the images come through `ShardRowReader` where the layout
allows it: Zarr's own reading costs ~40 ms a batch in overhead alone.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from storage.datasets.integrity import check_label_range
from storage.datasets.shard_reader import ShardRowReader
from storage.datasets.store import (SPLITS, DatasetChanged, DatasetError, content_identity,
                                    dataset_attrs, open_root)


def read_batch(path: str, split: str, indices: np.ndarray,
               identity: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Images (B, C, H, W) in the store dtype and int64 labels (B,) for `indices`.

    Rows come back in the order of `indices`, which may be unsorted and may repeat.
    Workers call this every step, so the opened arrays (and the labels, which are
    small) are cached per process; the cache key includes the identity of the
    store's metadata file, so a store rebuilt at the same path is reopened. With
    `identity` (a run's: `DatasetInfo.identity`), a store that holds other images
    (rebuilt by another run at the same path while this one reads it) is refused with
    DatasetChanged instead of read: one run never mixes two stores' images.
    """
    return _reader(path, split, identity).read(indices)


def read_labels(path: str, split: str, indices: np.ndarray, identity: str = "") -> np.ndarray:
    """Only the int64 labels of `indices` (held in memory once read): what the dense
    head needs, without the images; `identity` as for `read_batch`."""
    return _reader(path, split, identity).read_labels(indices)


def clear_read_cache() -> None:
    """Forget this process's open stores (closing their files), e.g. after deleting one."""
    _split_reader.cache_clear()


def _reader(path: str, split: str, identity: str = "") -> _SplitReader:
    """The cached reader of one split, keyed by the store's current identity; with
    `identity`, DatasetChanged if the store holds other images."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = os.path.abspath(path)
    try:
        stat = os.stat(os.path.join(root, "zarr.json"))
        reader = _split_reader(root, split, (stat.st_ino, stat.st_mtime_ns))
    except (OSError, DatasetError) as error:
        if identity:  # the store this run started on is gone, or half rebuilt
            raise DatasetChanged(
                f"dataset store {root} was removed or is being rebuilt while this run read "
                "it (by another run at the same data.path, or by hand); the run stops rather "
                "than train on another store's images: give each run its own data.path"
            ) from None
        if not isinstance(error, FileNotFoundError):
            raise
        dataset_attrs(path)  # raises the precise error: missing, not Zarr, not ours
        raise DatasetError(f"{path!r} is not a Zarr v3 dataset store") from None
    if identity and reader.identity != identity:
        raise DatasetChanged(
            f"dataset store {root} was rebuilt with other images while this run read it (by "
            "another run at the same data.path, from other data or a changed source); the "
            "run stops rather than train on both: give each run its own data.path")
    return reader


@functools.lru_cache(maxsize=16)
def _split_reader(root: str, split: str, stamp: tuple[int, int]) -> _SplitReader:
    """One reader per (store, split, store identity) and process; see read_batch."""
    del stamp  # only part of the cache key
    return _SplitReader(root, split)


class _SplitReader:
    """The opened arrays of one split, with labels held in memory."""

    def __init__(self, root: str, split: str) -> None:
        attrs = dataset_attrs(root)
        self.identity = content_identity(attrs)
        group = open_root(root)
        try:
            self.images = group[f"{split}/images"]
            labels = group[f"{split}/labels"]
        except KeyError as exc:
            raise DatasetError(f"{root!r}: dataset store lacks the array {exc}") from exc
        self.labels = np.asarray(labels[:], dtype=np.int64)  # 8 bytes a sample: keep it
        self.rows = int(self.images.shape[0])
        if self.labels.shape != (self.rows,) or self.rows != attrs.get(f"{split}_samples"):
            raise DatasetError(
                f"{root!r}: {split} images {self.images.shape}, labels {self.labels.shape} "
                f"and attributes ({attrs.get(f'{split}_samples')} samples) disagree"
            )
        check_label_range(root, split, self.labels, int(attrs.get("classes", 0)))
        self.fast = ShardRowReader.for_array(os.path.join(root, split, "images"), self.images)
        self.split = split

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Images and labels of `indices`, through the shard reader where it applies."""
        idx = self._checked(indices)
        labels = self.labels[idx]
        if self.fast is not None:
            return self.fast.read(idx), labels
        return self.read_with_zarr(idx), labels

    def read_labels(self, indices: np.ndarray) -> np.ndarray:
        """Labels of `indices`, from memory."""
        return self.labels[self._checked(indices)]

    def _checked(self, indices: np.ndarray) -> np.ndarray:
        """`indices` as a 1-D integer array within the split; a clear error otherwise."""
        idx = np.asarray(indices)
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
        if idx.size == 0:
            idx = idx.astype(np.int64)
        elif idx.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.rows):
            raise IndexError(
                f"{self.split} indices must lie in [0, {self.rows}); got min {idx.min()}, "
                f"max {idx.max()}"
            )
        return idx

    def read_with_zarr(self, idx: np.ndarray) -> np.ndarray:
        """Portable path: Zarr's orthogonal selection on sorted unique rows, reordered."""
        unique, inverse = np.unique(idx, return_inverse=True)
        return np.ascontiguousarray(self.images.oindex[unique][inverse])
