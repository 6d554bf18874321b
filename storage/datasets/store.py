"""The dataset store format: what a store on disk looks like, and opening one.

Every other module of this package writes or reads this layout, so it is written
down once, here, with the checks that tell a store of this format from anything
else at a path (a missing path, a plain Zarr group, a store of an older version).

The master of a run only sends sample indices; every worker opens the dataset store
itself and reads the rows it needs (docs/design.md, "One step"). That puts two demands on
the layout:

* Random rows must be cheap. Images are stored with one sample per inner chunk,
  grouped into shards of about ``SHARD_SAMPLES`` samples (Zarr v3 sharding, see
  `storage.datasets.writer`), so a batch touches ~B small byte ranges and a few dozen
  files instead of 50 000 files or whole 12 MB chunks. Nothing is compressed: on
  this machine decompression costs more than the disk bytes it saves, and float
  images hardly compress anyway.
* Workers must not redo preprocessing every step. Images are stored already
  normalised (per-channel mean/std of the train split) in the network's dtype:
  exactly the tensor the first conv layer consumes.

Layout of a store (a directory)::

    zarr.json               group; attrs: format, format_version, the DatasetInfo
                            fields, normalization {mean, std, pixel_scale}, build,
                            checksums {algorithm, arrays: {array: {chunk file:
                            [crc32c, bytes]}}}
    train/images            (N, C, H, W) float, chunks (1, C, H, W), shards (S, C, H, W)
    train/labels            (N,) int64
    test/images, test/labels

Stores of format 1 (before checksums) are refused by readers and rebuilt by
`ensure_dataset` from their source.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import zarr

FORMAT_NAME = "cnn-dataset"
FORMAT_VERSION = 2  # 2: chunk checksums
SPLITS = ("train", "test")
ARRAYS = tuple(f"{split}/{kind}" for split in SPLITS for kind in ("images", "labels"))


class DatasetError(Exception):
    """A dataset store or source is missing, malformed or of another format."""


class DatasetDamaged(DatasetError):
    """A store's bytes or labels are not what its build recorded."""


class SampleCountError(DatasetError):
    """A split's sample count asks for more images than the source holds: `split`
    ("train" or "test"), the count `asked`, and what the source `holds` (as words)."""

    def __init__(self, split: str, asked: int, holds: str, source: str) -> None:
        super().__init__(f"{split}_samples={asked}, but {source!r} holds {holds}")
        self.split, self.asked, self.holds = split, asked, holds


class DatasetChanged(DatasetError):
    """The store at a path holds other images than those a run started on (rebuilt in
    its place while the run read it)."""


@dataclass(frozen=True)
class DatasetInfo:
    """What a store holds, read from its group attributes (no array data touched)."""

    path: str
    name: str
    classes: int
    image_shape: tuple[int, int, int]  # (C, H, W)
    train_samples: int
    test_samples: int
    dtype: str
    source: str
    #: What the store holds, as a digest of its chunks' checksums (`content_identity`):
    #: equal for stores of the same bytes, whatever their path or when they were built.
    identity: str = field(default="", compare=False)


def content_identity(attrs: dict[str, Any]) -> str:
    """A digest of a store's recorded chunk checksums (its 'checksums' attribute): two
    stores with the same images, labels and normalisation have the same one, and a
    store rebuilt from a changed source (an image added, removed or replaced) another."""
    arrays = (attrs.get("checksums") or {}).get("arrays") or {}
    text = json.dumps(arrays, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def open_root(path: str) -> zarr.Group:
    """Open a store's root group read-only, turning Zarr's errors into DatasetError."""
    if not os.path.exists(path):
        raise DatasetError(f"dataset store not found: {path!r}")
    try:
        return zarr.open_group(path, mode="r")
    except (FileNotFoundError, ValueError, zarr.errors.BaseZarrError) as exc:
        raise DatasetError(f"{path!r} is not a Zarr group, so not a dataset store ({exc})") from exc


def dataset_attrs(path: str) -> dict[str, Any]:
    """The root attributes of a dataset store, checked for our format and version."""
    attrs = open_root(path).attrs.asdict()
    if attrs.get("format") != FORMAT_NAME:
        raise DatasetError(
            f"{path!r} is a Zarr group but not a dataset store (attribute 'format' is "
            f"{attrs.get('format')!r}, expected {FORMAT_NAME!r})"
        )
    if attrs.get("format_version") != FORMAT_VERSION:
        raise DatasetError(
            f"{path!r} has dataset format version {attrs.get('format_version')!r}; this code "
            f"reads version {FORMAT_VERSION}: rebuild it (overwrite=True)"
        )
    return attrs


def open_dataset_info(path: str) -> DatasetInfo:
    """Describe the store at `path`; DatasetError if it is missing or not a dataset store."""
    attrs = dataset_attrs(path)
    try:
        return DatasetInfo(
            path=os.path.abspath(path),
            name=str(attrs["name"]),
            classes=int(attrs["classes"]),
            image_shape=tuple(int(v) for v in attrs["image_shape"]),  # type: ignore[arg-type]
            train_samples=int(attrs["train_samples"]),
            test_samples=int(attrs["test_samples"]),
            dtype=str(attrs["dtype"]),
            source=str(attrs["source"]),
            identity=content_identity(attrs),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{path!r}: dataset attributes are incomplete ({exc!r})") from exc
