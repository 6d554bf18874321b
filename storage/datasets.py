"""Training datasets as Zarr v3 stores that Dask workers read batches from directly.

The master of a run only sends sample indices; every worker opens the dataset store
itself and reads the rows it needs (DESIGN.md, "Data flow"). That puts two demands on
the layout:

* Random rows must be cheap. Images are stored with one sample per inner chunk,
  grouped into shards of about ``SHARD_SAMPLES`` samples (Zarr v3 sharding), so a
  batch touches ~B small byte ranges and a few dozen files instead of 50 000 files or
  whole 12 MB chunks. Nothing is compressed: on this machine decompression costs
  more than the disk bytes it saves, and float images hardly compress anyway.
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

Stores are built in a temporary sibling directory and renamed into place at the end,
so a crashed build never leaves something that looks like a finished store.

Integrity: the build records a CRC-32C of every chunk file (a shard of images, the
labels) and checks that labels lie in [0, classes). `ensure_dataset`, which every
run calls to open its store, verifies all of them again (about 0.1 s per 100 MB
here, see docs/reliability.md), and workers range-check the labels they load, so a
damaged store stops a run with one line naming the array instead of training on
flipped bits or crashing in torch. ``python -m storage.datasets verify PATH`` checks
a store whole. Stores of format 1 (before checksums) are refused by readers and
rebuilt by `ensure_dataset` from their source.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import io
import json
import time
import logging
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from storage.checksums import ALGORITHM, chunk_files, crc32c, file_crc32c

log = logging.getLogger(__name__)

FORMAT_NAME = "cnn-dataset"
FORMAT_VERSION = 2  # 2: chunk checksums
SPLITS = ("train", "test")
SHARD_SAMPLES = 1000  # ~12 MB of float32 CIFAR images per shard file
# Skip Zarr's scan for all-fill-value chunks on write (it dominates the write time,
# DESIGN.md) and keep every chunk physically present, which the fast reader relies on.
ARRAY_CONFIG = {"write_empty_chunks": True}

CIFAR10_IMAGE_SHAPE = (3, 32, 32)
CIFAR10_CLASSES = 10
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_META = "batches.meta"


class DatasetError(Exception):
    """A dataset store or source is missing, malformed or of another format."""


class DatasetDamaged(DatasetError):
    """A store's bytes or labels are not what its build recorded."""


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


# ---------------------------------------------------------------------------------
# Opening stores


def _open_root(path: str) -> zarr.Group:
    """Open a store's root group read-only, turning Zarr's errors into DatasetError."""
    if not os.path.exists(path):
        raise DatasetError(f"dataset store not found: {path!r}")
    try:
        return zarr.open_group(path, mode="r")
    except (FileNotFoundError, ValueError, zarr.errors.BaseZarrError) as exc:
        raise DatasetError(f"{path!r} is not a Zarr group, so not a dataset store ({exc})") from exc


def _dataset_attrs(path: str) -> dict[str, Any]:
    """The root attributes of a dataset store, checked for our format and version."""
    attrs = _open_root(path).attrs.asdict()
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
    attrs = _dataset_attrs(path)
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
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{path!r}: dataset attributes are incomplete ({exc!r})") from exc


# ---------------------------------------------------------------------------------
# Reading batches


def read_batch(path: str, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Images (B, C, H, W) in the store dtype and int64 labels (B,) for `indices`.

    Rows come back in the order of `indices`, which may be unsorted and may repeat.
    Workers call this every step, so the opened arrays (and the labels, which are
    small) are cached per process; the cache key includes the identity of the
    store's metadata file, so a store rebuilt at the same path is reopened.
    """
    return _reader(path, split).read(indices)


def _reader(path: str, split: str) -> _SplitReader:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = os.path.abspath(path)
    try:
        stat = os.stat(os.path.join(root, "zarr.json"))
    except FileNotFoundError:
        _dataset_attrs(path)  # raises the precise error: missing, not Zarr, not ours
        raise DatasetError(f"{path!r} is not a Zarr v3 dataset store") from None
    return _split_reader(root, split, (stat.st_ino, stat.st_mtime_ns))


def read_labels(path: str, split: str, indices: np.ndarray) -> np.ndarray:
    """Only the int64 labels of `indices` (held in memory once read): what the dense
    head needs, without the images."""
    return _reader(path, split).read_labels(indices)


def clear_read_cache() -> None:
    """Forget this process's open stores (closing their files), e.g. after deleting one."""
    _split_reader.cache_clear()


@functools.lru_cache(maxsize=16)
def _split_reader(root: str, split: str, stamp: tuple[int, int]) -> _SplitReader:
    """One reader per (store, split, store identity) and process; see read_batch."""
    del stamp  # only part of the cache key
    return _SplitReader(root, split)


class _SplitReader:
    """The opened arrays of one split, with labels held in memory."""

    def __init__(self, root: str, split: str) -> None:
        attrs = _dataset_attrs(root)
        group = _open_root(root)
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
        _check_label_range(root, split, self.labels, int(attrs.get("classes", 0)))
        self.fast = _ShardRowReader.for_array(os.path.join(root, split, "images"), self.images)
        self.split = split

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = self._checked(indices)
        labels = self.labels[idx]
        if self.fast is not None:
            return self.fast.read(idx), labels
        return self.read_with_zarr(idx), labels

    def read_labels(self, indices: np.ndarray) -> np.ndarray:
        return self.labels[self._checked(indices)]

    def _checked(self, indices: np.ndarray) -> np.ndarray:
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


class _ShardRowReader:
    """Reads one sample's bytes straight out of a shard file with ``os.pread``.

    Zarr spends ~0.3 ms of event-loop overhead per inner chunk, i.e. ~40 ms for a
    128-sample batch; the bytes themselves take microseconds to copy from the page
    cache. For the exact layout this module writes (local files, sharding_indexed
    with an uncompressed little-endian inner chunk of one sample and the index at
    the end, checksummed with crc32c) we follow the Zarr v3 sharding spec directly:
    the index is (chunks_per_shard, 2) uint64 (offset, nbytes), read once per shard.
    Any other layout returns None from `for_array` and Zarr does the reading.
    """

    EXPECTED_INDEX_CODECS = [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "crc32c"},
    ]
    MISSING = 2**64 - 1  # spec: offset and nbytes of an absent inner chunk

    def __init__(self, array_dir: str, rows: int, shard_rows: int,
                 row_shape: tuple[int, ...], dtype: np.dtype, separator: str,
                 fill_value: Any) -> None:
        self.array_dir = array_dir
        self.rows = rows
        self.shard_rows = shard_rows
        self.row_shape = row_shape
        self.dtype = dtype
        self.row_nbytes = int(np.prod(row_shape)) * dtype.itemsize
        self.separator = separator
        self.fill_value = fill_value
        self._shards: dict[int, tuple[int, np.ndarray]] = {}  # shard -> (fd, index)
        self._lock = threading.Lock()
        # raw descriptors (pread needs no file object); closed when the reader goes
        weakref.finalize(self, _close_descriptors, self._shards)

    @classmethod
    def for_array(cls, array_dir: str, array: zarr.Array) -> _ShardRowReader | None:
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
        return cls(array_dir, int(array.shape[0]), int(shard_shape[0]), chunk_shape[1:], dtype,
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
        out = np.empty((idx.size, *self.row_shape), dtype=self.dtype)
        for position, row in enumerate(idx.tolist()):
            shard, inner = divmod(row, self.shard_rows)
            fd, index = self._shard(shard)
            offset, nbytes = int(index[inner, 0]), int(index[inner, 1])
            if offset == self.MISSING and nbytes == self.MISSING:
                out[position] = self.fill_value  # Zarr's meaning of an absent chunk
                continue
            data = os.pread(fd, nbytes, offset)
            if nbytes != self.row_nbytes or len(data) != self.row_nbytes:
                raise DatasetError(
                    f"dataset row {row} in {self.array_dir!r} has {len(data)} bytes, "
                    f"expected {self.row_nbytes}"
                )
            out[position] = np.frombuffer(data, dtype=self.dtype).reshape(self.row_shape)
        return out


def _close_descriptors(shards: dict[int, tuple[int, np.ndarray]]) -> None:
    for fd, _ in shards.values():
        try:
            os.close(fd)
        except OSError:
            pass
    shards.clear()


def _crc32c_ok(data: bytes, stored: bytes) -> bool:
    """Check a Zarr crc32c checksum (little-endian, after the data)."""
    return crc32c(data) == int.from_bytes(stored, "little")


# ---------------------------------------------------------------------------------
# Integrity

ARRAYS = tuple(f"{split}/{kind}" for split in SPLITS for kind in ("images", "labels"))


@dataclass(frozen=True)
class VerifyReport:
    """What `verify_dataset` checked."""

    arrays: int
    files: int
    bytes: int
    seconds: float


def _check_label_range(root: str, split: str, labels: np.ndarray, classes: int) -> None:
    """Labels outside [0, classes) would index past the dense head's outputs."""
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise DatasetDamaged(f"dataset store {root!r}: array {split}/labels holds labels from "
                             f"{labels.min()} to {labels.max()}, outside [0, {classes}) for its "
                             f"{classes} classes")


def _record_checksums(root: str) -> dict[str, Any]:
    """The `checksums` attribute of a freshly written store: every chunk file's CRC."""
    arrays = {}
    for name in ARRAYS:
        array_dir = os.path.join(root, *name.split("/"))
        arrays[name] = {f: list(file_crc32c(os.path.join(array_dir, *f.split("/"))))
                        for f in chunk_files(array_dir)}
    return {"algorithm": ALGORITHM, "arrays": arrays}


def verify_dataset(path: str) -> VerifyReport:
    """Check every chunk of a store against the checksums of its build, and its labels'
    range; DatasetDamaged (one line naming the array) at the first problem.

    Reads the whole store (about 0.1 s per 100 MB from the page cache here): cheap
    enough for every run to call on opening (`ensure_dataset` does).
    """
    started = time.perf_counter()
    attrs = _dataset_attrs(path)
    root = os.path.abspath(path)
    recorded = attrs.get("checksums") or {}
    if recorded.get("algorithm") != ALGORITHM or not isinstance(recorded.get("arrays"), dict):
        raise DatasetDamaged(f"dataset store {root!r} records no {ALGORITHM} checksums; "
                             "rebuild it (delete it and run again, or overwrite=True)")
    files, size = 0, 0
    rebuild = "the store was damaged or changed after it was built; delete it to rebuild it"
    for name in ARRAYS:
        expected = recorded["arrays"].get(name)
        array_dir = os.path.join(root, *name.split("/"))
        if not isinstance(expected, dict):
            raise DatasetDamaged(f"dataset store {root!r}: array {name} has no recorded "
                                 f"checksums; {rebuild}")
        present = chunk_files(array_dir) if os.path.isdir(array_dir) else []
        missing = sorted(set(expected) - set(present))
        extra = sorted(set(present) - set(expected))
        if missing or extra:
            what = f"chunk file {missing[0]} is missing" if missing else \
                f"chunk file {extra[0]} was not written by its build"
            raise DatasetDamaged(f"dataset store {root!r}: array {name}: {what}; {rebuild}")
        for chunk in present:
            value, nbytes = file_crc32c(os.path.join(array_dir, *chunk.split("/")))
            if [value, nbytes] != list(expected[chunk]):
                raise DatasetDamaged(f"dataset store {root!r}: array {name} fails its "
                                     f"{ALGORITHM} checksum (chunk {chunk}); {rebuild}")
            files, size = files + 1, size + nbytes
    group = _open_root(root)
    for split in SPLITS:
        _check_label_range(root, split, np.asarray(group[f"{split}/labels"][:]),
                           int(attrs["classes"]))
    return VerifyReport(len(ARRAYS), files, size, time.perf_counter() - started)


# ---------------------------------------------------------------------------------
# Writing stores


# A split is written from blocks: (start row, normalised images, labels), in order.
BlockSource = Callable[[], Iterator[tuple[int, np.ndarray, np.ndarray]]]


def _write_store(path: str, overwrite: bool, attrs: dict[str, Any],
                 image_shape: tuple[int, int, int], dtype: str,
                 splits: dict[str, tuple[int, BlockSource]]) -> DatasetInfo:
    """Write a complete store in a temporary sibling directory, then rename it in.

    `splits` maps a split name to its sample count and a block source whose blocks
    are aligned to SHARD_SAMPLES, so every write fills whole shards.
    """
    final = os.path.abspath(path)
    _check_target(final, overwrite)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    building = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.building-", dir=parent)
    try:
        root = zarr.create_group(store=building, zarr_format=3, overwrite=True,
                                 attributes=json.loads(json.dumps(attrs)))
        for split, (samples, blocks) in splits.items():
            group = root.create_group(split)
            shard = max(1, min(SHARD_SAMPLES, samples))
            images = group.create_array(
                "images", shape=(samples, *image_shape), dtype=dtype,
                chunks=(1, *image_shape), shards=(shard, *image_shape),
                compressors=None, fill_value=0, config=ARRAY_CONFIG,
            )
            labels = np.zeros(samples, dtype=np.int64)
            written = 0
            for start, block_images, block_labels in blocks():
                assert start == written and start % shard == 0, "blocks must fill whole shards"
                stop = start + len(block_images)
                images[start:stop] = block_images.astype(dtype, copy=False)
                labels[start:stop] = block_labels
                written = stop
            assert written == samples, f"{split}: wrote {written} of {samples} samples"
            _check_label_range(final, split, labels, int(attrs["classes"]))
            group.create_array("labels", data=labels, chunks=(max(1, samples),),
                               compressors=None, fill_value=0, config=ARRAY_CONFIG)
        root.attrs["checksums"] = _record_checksums(building)
        if os.path.lexists(final):
            _remove_store(final)
        os.rename(building, final)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return open_dataset_info(final)


def _check_target(final: str, overwrite: bool) -> None:
    """Refuse to replace something unless asked to, and never a non-dataset path."""
    if not os.path.lexists(final):
        return
    if not overwrite:
        raise DatasetError(f"{final!r} already exists; pass overwrite=True to rebuild it")
    if not _is_replaceable(final):
        raise DatasetError(
            f"refusing to overwrite {final!r}: it is not a dataset store (only stores this "
            "module wrote, or empty directories, are replaced)"
        )


def _is_replaceable(path: str) -> bool:
    """True for a store of ours (any version) or an empty directory."""
    if os.path.isdir(path) and not os.listdir(path):
        return True
    try:
        return _open_root(path).attrs.get("format") == FORMAT_NAME
    except DatasetError:
        return False


def _remove_store(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _base_attrs(name: str, source: str, classes: int, image_shape: tuple[int, int, int],
                train_samples: int, test_samples: int, dtype: str,
                mean: np.ndarray, std: np.ndarray, pixel_scale: float,
                build: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "name": name,
        "source": source,
        "classes": classes,
        "image_shape": list(image_shape),
        "train_samples": train_samples,
        "test_samples": test_samples,
        "dtype": dtype,
        # stored = (raw * pixel_scale - mean[c]) / std[c], stats from the train split
        "normalization": {
            "mean": [float(v) for v in mean],
            "std": [float(v) for v in std],
            "pixel_scale": pixel_scale,
        },
        "build": build,
    }


def _check_dtype(dtype: str) -> str:
    try:
        kind = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"unknown dtype {dtype!r}") from exc
    if kind.kind != "f":
        raise ValueError(f"images are stored as floats; dtype {dtype!r} is not a float type")
    return kind.name


def _check_counts(train_samples: int, test_samples: int) -> None:
    if train_samples < 1:
        raise ValueError(f"train_samples must be at least 1, got {train_samples}")
    if test_samples < 0:
        raise ValueError(f"test_samples must be >= 0, got {test_samples}")


def _safe_std(variance: np.ndarray) -> np.ndarray:
    """Per-channel std; a constant channel keeps std 1 so it normalises to zeros."""
    std = np.sqrt(np.maximum(variance, 0.0))
    return np.where(std > 1e-12, std, 1.0)


# ---------------------------------------------------------------------------------
# Synthetic data
#
# Each class is a fixed random smooth (low-frequency, periodic) colour pattern. Every
# image shows its class pattern shifted by a few pixels, maybe mirrored, with its own
# contrast and brightness, on top of a random smooth "clutter" field of another kind
# and per-pixel noise. No single pixel tells the class, but a small CNN learns the
# patterns in about a hundred SGD steps (see the module tests and the build report).

SYNTHETIC_GENERATOR_VERSION = 1
SYNTHETIC_MAX_FREQUENCY = 3  # cycles per image, for patterns and clutter
SYNTHETIC_MAX_SHIFT = 4  # pixels, each axis
SYNTHETIC_CONTRAST = (0.6, 1.4)
SYNTHETIC_BRIGHTNESS_STD = 0.5
SYNTHETIC_CLUTTER = 0.8  # clutter amplitude relative to the (unit-std) pattern
SYNTHETIC_NOISE = 1.5  # per-pixel noise std relative to the pattern
_SPLIT_CODES = {"train": 1, "test": 2}


class _SyntheticGenerator:
    """Deterministic synthetic images; blocks depend only on (seed, split, block)."""

    def __init__(self, seed: int, classes: int, image_shape: tuple[int, int, int]) -> None:
        self.seed = seed
        self.classes = classes
        self.image_shape = image_shape
        channels, height, width = image_shape
        fy = np.fft.fftfreq(height) * height
        fx = np.fft.rfftfreq(width) * width
        self.low_pass = (np.abs(fy)[:, None] <= SYNTHETIC_MAX_FREQUENCY) & (
            fx[None, :] <= SYNTHETIC_MAX_FREQUENCY)
        # phase ramps for integer shifts: multiplying by them rolls the image exactly
        self.fy, self.fx = fy, fx
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
        patterns = self._smooth_fields(rng, classes)
        self.pattern_spectra = np.fft.rfft2(patterns)

    def _smooth_fields(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` random low-frequency fields (count, C, H, W), each with unit std."""
        channels, height, width = self.image_shape
        # draw only the low-frequency coefficients: the rest of the spectrum is zero
        coefficients = rng.standard_normal((2, count, channels, int(self.low_pass.sum())))
        spectrum = np.zeros((count, channels, height, width // 2 + 1), dtype=complex)
        spectrum[..., self.low_pass] = coefficients[0] + 1j * coefficients[1]
        fields = np.fft.irfft2(spectrum, s=(height, width))
        fields -= fields.mean(axis=(1, 2, 3), keepdims=True)
        fields /= fields.std(axis=(1, 2, 3), keepdims=True) + 1e-12
        return fields

    def labels(self, split: str, samples: int) -> np.ndarray:
        """Balanced labels (counts differ by at most one), in a seeded random order."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, _SPLIT_CODES[split], 0]))
        return rng.permutation(np.arange(samples, dtype=np.int64) % self.classes)

    def block(self, split: str, block: int, labels: np.ndarray) -> np.ndarray:
        """Raw (unnormalised) float64 images for one block, given its labels."""
        rng = np.random.default_rng(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[split], 1, block]))
        count = len(labels)
        channels, height, width = self.image_shape
        shift_y, shift_x = rng.integers(-SYNTHETIC_MAX_SHIFT, SYNTHETIC_MAX_SHIFT + 1, (2, count))
        ramp = np.exp(-2j * np.pi * (shift_y[:, None, None] * self.fy[None, :, None] / height
                                     + shift_x[:, None, None] * self.fx[None, None, :] / width))
        shown = np.fft.irfft2(self.pattern_spectra[labels] * ramp[:, None], s=(height, width))
        mirror = rng.random(count) < 0.5
        shown[mirror] = shown[mirror][..., ::-1]
        contrast = rng.uniform(*SYNTHETIC_CONTRAST, count)[:, None, None, None]
        brightness = rng.normal(0.0, SYNTHETIC_BRIGHTNESS_STD, count)[:, None, None, None]
        clutter = SYNTHETIC_CLUTTER * self._smooth_fields(rng, count)
        noise = SYNTHETIC_NOISE * rng.standard_normal(shown.shape)
        return contrast * shown + brightness + clutter + noise


def create_synthetic_dataset(path: str, train_samples: int = 5000, test_samples: int = 1000,
                             image_shape: tuple[int, int, int] = (3, 32, 32), classes: int = 10,
                             seed: int = 0, dtype: str = "float32",
                             overwrite: bool = False) -> DatasetInfo:
    """Build a learnable, CIFAR-shaped synthetic dataset at `path`.

    The same arguments give the same bytes: every block of images is drawn from its
    own seed (seed, split, block), so nothing depends on how the build is chunked.
    """
    dtype = _check_dtype(dtype)
    _check_counts(train_samples, test_samples)
    if classes < 2:
        raise ValueError(f"classes must be at least 2, got {classes}")
    image_shape = tuple(int(v) for v in image_shape)  # type: ignore[assignment]
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise ValueError(f"image_shape must be (C, H, W) of positive sizes, got {image_shape}")
    _check_target(os.path.abspath(path), overwrite)  # fail before generating anything
    generator = _SyntheticGenerator(seed, classes, image_shape)
    counts = {"train": train_samples, "test": test_samples}
    labels = {split: generator.labels(split, n) for split, n in counts.items()}

    def raw_blocks(split: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        shard = max(1, min(SHARD_SAMPLES, counts[split]))
        for block, start in enumerate(range(0, counts[split], shard)):
            block_labels = labels[split][start:start + shard]
            yield start, generator.block(split, block, block_labels), block_labels

    # First pass: per-channel statistics of the raw train images (regenerated in the
    # second pass instead of being held: 50 000 images would be 1.2 GB of float64).
    total = np.zeros(image_shape[0])
    total_sq = np.zeros(image_shape[0])
    for _, images, _ in raw_blocks("train"):
        total += images.sum(axis=(0, 2, 3))
        total_sq += np.square(images).sum(axis=(0, 2, 3))
    values = train_samples * image_shape[1] * image_shape[2]
    mean = total / values
    std = _safe_std(total_sq / values - mean**2)

    def normalised(split: str) -> BlockSource:
        def blocks() -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
            for start, images, block_labels in raw_blocks(split):
                yield start, (images - mean[:, None, None]) / std[:, None, None], block_labels
        return blocks

    build = {"kind": "synthetic", "train_samples": train_samples, "test_samples": test_samples,
             "image_shape": list(image_shape), "classes": classes, "seed": seed, "dtype": dtype,
             "generator_version": SYNTHETIC_GENERATOR_VERSION}
    attrs = _base_attrs("synthetic", "synthetic", classes, image_shape, train_samples,
                        test_samples, dtype, mean, std, 1.0, build)
    return _write_store(path, overwrite, attrs, image_shape, dtype,
                        {split: (counts[split], normalised(split)) for split in SPLITS})


# ---------------------------------------------------------------------------------
# CIFAR-10


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles CIFAR-10 batches without running arbitrary code from the archive.

    The batches reference only numpy's array reconstruction (as ``numpy.core`` when
    written by old numpy) and, for Python 3 protocol-2 pickles, ``_codecs.encode``.
    """

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name} in a CIFAR-10 batch")
        if module == "numpy.core.multiarray":
            module = "numpy._core.multiarray"  # numpy 2 name; avoids the deprecation shim
        return super().find_class(module, name)


def _load_batch(raw: bytes, where: str) -> dict[bytes, Any]:
    try:
        batch = _NumpyOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # pickle raises many types on damaged input
        raise DatasetError(f"{where} is not a readable CIFAR-10 pickle ({exc!r})") from exc
    if not isinstance(batch, dict):
        raise DatasetError(
            f"{where} is not a CIFAR-10 batch (a {type(batch).__name__}, not a dict)")
    return batch


def _parse_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (n, 3, 32, 32) and int64 labels (n,) from one pickled batch."""
    batch = _load_batch(raw, where)
    data, labels = batch.get(b"data"), batch.get(b"labels")
    row = int(np.prod(CIFAR10_IMAGE_SHAPE))
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[1] == row):
        found = getattr(data, "dtype", type(data).__name__), getattr(data, "shape", "")
        raise DatasetError(f"{where}: b'data' must be a uint8 array (n, {row}), got {found}")
    try:
        label_array = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        label_array = np.empty(0)
    if label_array.shape != (data.shape[0],) or (
            label_array.size and (label_array.min() < 0 or label_array.max() >= CIFAR10_CLASSES)):
        raise DatasetError(f"{where}: b'labels' must be {data.shape[0]} ints in "
                           f"[0, {CIFAR10_CLASSES})")
    return data.reshape(-1, *CIFAR10_IMAGE_SHAPE), label_array


def _read_cifar_members(source: str) -> tuple[str, dict[str, bytes]]:
    """Locate CIFAR-10 and return (its resolved path, {member name: pickled bytes})."""
    wanted = (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH, CIFAR10_META)
    hint = f"expected {CIFAR10_ARCHIVE} or the extracted {CIFAR10_FOLDER} folder (or its parent)"
    if os.path.isdir(source):
        for folder in (source, os.path.join(source, CIFAR10_FOLDER)):
            if os.path.isfile(os.path.join(folder, CIFAR10_TRAIN_BATCHES[0])):
                members = {}
                for name in wanted:
                    member_path = os.path.join(folder, name)
                    if os.path.isfile(member_path):
                        with open(member_path, "rb") as handle:
                            members[name] = handle.read()
                return os.path.abspath(folder), members
        archive = os.path.join(source, CIFAR10_ARCHIVE)
        if not os.path.isfile(archive):
            raise DatasetError(f"no CIFAR-10 data in folder {source!r}: {hint}")
        source = archive
    if not os.path.isfile(source):
        raise DatasetError(f"CIFAR-10 source not found: {source!r} ({hint})")
    members = {}
    try:
        # Stream through the archive once: random access into a .gz re-decompresses.
        with tarfile.open(source, mode="r:*") as archive_file:
            for member in archive_file:
                name = os.path.basename(member.name)
                if member.isfile() and name in wanted and name not in members:
                    handle = archive_file.extractfile(member)
                    assert handle is not None
                    members[name] = handle.read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise DatasetError(f"cannot read CIFAR-10 archive {source!r}: damaged or not a "
                           f"tar archive ({exc})") from exc
    return os.path.abspath(source), members


def import_cifar10(source: str, path: str, dtype: str = "float32", overwrite: bool = False,
                   train_samples: int | None = None,
                   test_samples: int | None = None) -> DatasetInfo:
    """Convert CIFAR-10's python release into a normalised dataset store at `path`.

    `source` is ``cifar-10-python.tar.gz``, the extracted ``cifar-10-batches-py``
    folder or its parent; the archive is read in place, never extracted to disk.
    `train_samples` / `test_samples` keep the first N samples of each split (in the
    batches' order) when given. Stored values are ``(pixel / 255 - mean[c]) / std[c]``
    with the statistics of the kept train samples.
    """
    dtype = _check_dtype(dtype)
    _check_target(os.path.abspath(path), overwrite)
    resolved, members = _read_cifar_members(source)
    missing = [n for n in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH) if n not in members]
    if missing:
        raise DatasetError(f"CIFAR-10 source {resolved!r} lacks {', '.join(missing)}")

    def split_arrays(names: tuple[str, ...], keep: int | None, split: str):
        parts = [_parse_batch(members.pop(name), f"{resolved}:{name}") for name in names]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        if keep is not None:
            if not 0 <= keep <= len(images):
                raise DatasetError(f"{split}_samples={keep}, but {resolved!r} holds "
                                   f"{len(images)} {split} samples")
            images, labels = images[:keep], labels[:keep]
        return images, labels

    train = split_arrays(CIFAR10_TRAIN_BATCHES, train_samples, "train")
    test = split_arrays((CIFAR10_TEST_BATCH,), test_samples, "test")
    _check_counts(len(train[0]), len(test[0]))

    # Exact per-channel statistics from integer sums (Python ints: no overflow).
    pixels = train[0].shape[0] * train[0].shape[2] * train[0].shape[3]
    sums = [int(train[0][:, c].sum(dtype=np.int64)) for c in range(CIFAR10_IMAGE_SHAPE[0])]
    squares = [int(np.square(train[0][:, c], dtype=np.int64).sum())
               for c in range(CIFAR10_IMAGE_SHAPE[0])]
    mean = np.array([s / pixels / 255.0 for s in sums])
    variance = np.array([(pixels * q - s * s) / (pixels * pixels) / 255.0**2
                         for s, q in zip(sums, squares)])
    std = _safe_std(variance)

    def blocks_of(images: np.ndarray, labels: np.ndarray) -> BlockSource:
        def blocks() -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
            shard = max(1, min(SHARD_SAMPLES, len(images)))
            for start in range(0, len(images), shard):
                block = images[start:start + shard].astype(np.float64) / 255.0
                yield (start, (block - mean[:, None, None]) / std[:, None, None],
                       labels[start:start + shard])
        return blocks

    attrs = _base_attrs("cifar10", resolved, CIFAR10_CLASSES, CIFAR10_IMAGE_SHAPE,
                        len(train[0]), len(test[0]), dtype, mean, std, 1.0 / 255.0,
                        {"kind": "cifar10", "train_samples": train_samples,
                         "test_samples": test_samples, "dtype": dtype})
    names = _class_names(members.get(CIFAR10_META), f"{resolved}:{CIFAR10_META}")
    if names is not None:
        attrs["class_names"] = names
    return _write_store(path, overwrite, attrs, CIFAR10_IMAGE_SHAPE, dtype,
                        {"train": (len(train[0]), blocks_of(*train)),
                         "test": (len(test[0]), blocks_of(*test))})


def _class_names(raw: bytes | None, where: str) -> list[str] | None:
    """The label names from batches.meta, if present and well formed (informational)."""
    if raw is None:
        return None
    names = _load_batch(raw, where).get(b"label_names")
    if not isinstance(names, list) or len(names) != CIFAR10_CLASSES:
        return None
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names]


# ---------------------------------------------------------------------------------
# Convenience


# Keyword arguments a caller may pass for any source; CIFAR-10 has fixed values.
_SYNTHETIC_ONLY = ("seed", "image_shape", "classes")


def ensure_dataset(spec_source: str, path: str, **kwargs: Any) -> DatasetInfo:
    """Open the store at `path` if it was built from the same request, else build it.

    `spec_source` is ``"synthetic"`` (kwargs go to create_synthetic_dataset) or a path
    to CIFAR-10's archive or folder (kwargs go to import_cifar10; ``seed`` is
    ignored there and ``classes``/``image_shape`` must match CIFAR-10's). A store
    built from other arguments is rebuilt in place; a path holding anything other
    than a dataset store is never replaced. ``overwrite=True`` forces a rebuild.
    Call this once (on the master): concurrent builders of one path would race.
    """
    kwargs = dict(kwargs)
    overwrite = bool(kwargs.pop("overwrite", False))
    if spec_source == "synthetic":
        builder: Callable[..., DatasetInfo] = create_synthetic_dataset
        args: tuple[str, ...] = (path,)
    else:
        kwargs.pop("seed", None)
        if kwargs.pop("classes", CIFAR10_CLASSES) != CIFAR10_CLASSES or tuple(
                kwargs.pop("image_shape", CIFAR10_IMAGE_SHAPE)) != CIFAR10_IMAGE_SHAPE:
            raise ValueError(f"CIFAR-10 has {CIFAR10_CLASSES} classes of shape "
                             f"{CIFAR10_IMAGE_SHAPE}; got other classes/image_shape")
        builder, args = import_cifar10, (spec_source, path)
    try:
        bound = inspect.signature(builder).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"ensure_dataset({spec_source!r}): {exc}") from None
    bound.apply_defaults()
    wanted = _wanted_build(builder, bound.arguments)
    if not overwrite and os.path.lexists(path):
        try:
            attrs = _dataset_attrs(path)
        except DatasetError:
            attrs = None
        if attrs is not None and attrs.get("build") == wanted:
            verify_dataset(path)
            return open_dataset_info(path)
        log.info("dataset store %s was built from %s, wanted %s: rebuilding", path,
                 attrs.get("build") if attrs else "something else", wanted)
        overwrite = True  # _check_target still refuses anything that is not ours
    log.info("building dataset store %s from %s", path, spec_source)
    bound.arguments["overwrite"] = overwrite
    return builder(*bound.args, **bound.kwargs)


def _wanted_build(builder: Callable[..., DatasetInfo], arguments: dict[str, Any]) -> dict[str, Any]:
    """The 'build' attribute a store made from these arguments would carry."""
    if builder is create_synthetic_dataset:
        build = {"kind": "synthetic", "train_samples": arguments["train_samples"],
                 "test_samples": arguments["test_samples"],
                 "image_shape": list(arguments["image_shape"]), "classes": arguments["classes"],
                 "seed": arguments["seed"], "dtype": _check_dtype(arguments["dtype"]),
                 "generator_version": SYNTHETIC_GENERATOR_VERSION}
    else:
        build = {"kind": "cifar10", "train_samples": arguments["train_samples"],
                 "test_samples": arguments["test_samples"],
                 "dtype": _check_dtype(arguments["dtype"])}
    return json.loads(json.dumps(build))  # the form it takes after a round trip as attrs


# ---------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    """``python -m storage.datasets verify PATH``: check a store whole.

    Exit 0 if every chunk matches its checksum and the labels are in range, 1 if the
    store is damaged, 2 if PATH is not a dataset store of this format.
    """
    parser = argparse.ArgumentParser(prog="python -m storage.datasets",
                                     description="Check a dataset store against the "
                                                 "checksums recorded when it was built.")
    parser.add_argument("command", choices=["verify"])
    parser.add_argument("path", help="the dataset store (a directory)")
    args = parser.parse_args(argv)
    try:
        report = verify_dataset(args.path)
    except DatasetError as error:  # damaged: 1; not a store of this format: 2
        print(f"error: {error}", file=sys.stderr)
        return 1 if isinstance(error, DatasetDamaged) else 2
    print(f"{args.path}: ok ({report.arrays} arrays, {report.files} chunk files, "
          f"{report.bytes / 1e6:.1f} MB checked in {report.seconds:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
