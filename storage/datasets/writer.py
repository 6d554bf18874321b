"""Writing a dataset store: the one place that creates, shards and replaces stores.

The synthetic maker and the CIFAR-10 importer only produce normalised blocks of
images; this module lays them out in the format of `storage.datasets.store` and
decides the shard size, so both sources get the same layout and the same safety:

* Stores are built in a temporary sibling directory and renamed into place at the
  end, so a crashed build never leaves something that looks like a finished store.
* A path is only replaced when asked to, and only if it holds a store of ours (any
  version) or an empty directory: a typo in a config never deletes other data.
* One process at a time builds or replaces the store at a path (`build_lock`, an
  flock on ``.<name>.lock`` beside it, which `ensure_dataset` also holds while it
  decides and verifies): a second waits, then finds the store built. The lock's
  holder removes what builds killed before the rename left (``.<name>.building-*``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import zarr

from storage.datasets.integrity import check_label_range, record_checksums
from storage.datasets.store import (FORMAT_NAME, FORMAT_VERSION, DatasetError, DatasetInfo,
                                    SampleCountError, open_dataset_info, open_root)
from storage.locks import OwnerLock

SHARD_SAMPLES = 1000  # ~12 MB of float32 CIFAR images per shard file
# Skip Zarr's scan for all-fill-value chunks on write (it dominates the write time,
# docs/benchmarks.md) and keep every chunk physically present, which the fast reader relies on.
ARRAY_CONFIG = {"write_empty_chunks": True}

# A split is written from blocks: (start row, normalised images, labels), in order.
BlockSource = Callable[[], Iterator[tuple[int, np.ndarray, np.ndarray]]]


_held: set[tuple[int, str]] = set()  # (thread, store) whose build lock this process holds


@contextmanager
def build_lock(path: str, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the build lock of the store at `path` (again, if this thread holds it: a
    no-op), waiting for another process's build after one line to `say`. The holder
    removes half-built stores killed builds left beside it, saying so. A folder where
    no lock file can be made (read-only) is read without one."""
    final = os.path.abspath(path)
    key = (threading.get_ident(), final)
    if key in _held:
        yield
        return
    parent, name = os.path.split(final)
    lock = OwnerLock(os.path.join(parent, f".{name}.lock"), f"dataset store {final}",
                     "another build")
    try:
        lock.acquire(on_wait=say or (lambda line: None))
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        locked = False
    else:
        locked = True
    if not locked:
        yield
        return
    _held.add(key)
    try:
        for entry in sorted(os.listdir(parent)):
            if entry.startswith(f".{name}.building-"):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
                if say is not None:
                    say(f"note: removed {os.path.join(parent, entry)}, a dataset store "
                        "a killed build left half-written")
        yield
    finally:
        _held.discard(key)
        lock.release()


def shard_rows(samples: int) -> int:
    """Samples per shard of a split of `samples`: the size every block must have
    (the last one may be shorter), so every write fills whole shards."""
    return max(1, min(SHARD_SAMPLES, samples))


def write_store(path: str, overwrite: bool, attrs: dict[str, Any],
                image_shape: tuple[int, int, int], dtype: str,
                splits: dict[str, tuple[int, BlockSource]]) -> DatasetInfo:
    """Write a complete store in a temporary sibling directory, then rename it in.

    `splits` maps a split name to its sample count and a block source whose blocks
    are aligned to `shard_rows`, so every write fills whole shards.
    """
    final = os.path.abspath(path)
    check_target(final, overwrite)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    with build_lock(final):
        return _write_store(final, overwrite, attrs, image_shape, dtype, splits)


def _write_store(final: str, overwrite: bool, attrs: dict[str, Any],
                 image_shape: tuple[int, int, int], dtype: str,
                 splits: dict[str, tuple[int, BlockSource]]) -> DatasetInfo:
    """`write_store` under the path's build lock."""
    check_target(final, overwrite)  # again: another build may have made it meanwhile
    building = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.building-",
                                dir=os.path.dirname(final))
    try:
        root = zarr.create_group(store=building, zarr_format=3, overwrite=True,
                                 attributes=json.loads(json.dumps(attrs)))
        for split, (samples, blocks) in splits.items():
            group = root.create_group(split)
            shard = shard_rows(samples)
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
            check_label_range(final, split, labels, int(attrs["classes"]))
            group.create_array("labels", data=labels, chunks=(max(1, samples),),
                               compressors=None, fill_value=0, config=ARRAY_CONFIG)
        root.attrs["checksums"] = record_checksums(building)
        if os.path.lexists(final):
            _remove_store(final)
        os.rename(building, final)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return open_dataset_info(final)


def check_target(final: str, overwrite: bool) -> None:
    """Refuse to replace something unless asked to, and never a non-dataset path."""
    if not os.path.lexists(final):
        return
    if not overwrite:
        raise DatasetError(f"{final!r} already exists; pass overwrite=True to rebuild it")
    if not is_replaceable(final):
        raise DatasetError(
            f"refusing to overwrite {final!r}: {why_not_replaceable(final)} (only stores this "
            "module wrote, or empty directories, are replaced)"
        )


def why_not_replaceable(path: str) -> str:
    """Why `path` cannot be told a dataset store of ours: a Zarr store whose root
    metadata (zarr.json) is damaged is said so, with what to do, not as something else."""
    metadata = os.path.join(path, "zarr.json")
    if os.path.isdir(path) and os.path.isfile(metadata):
        try:
            with open(metadata, "rb") as file:
                json.load(file)
        except (OSError, ValueError):
            return ("its root metadata (zarr.json) is damaged, so it cannot be told a dataset "
                    "store; if it is one, delete it (rm -r) and the run builds it again")
    return "it is not a dataset store"


def is_replaceable(path: str) -> bool:
    """True for a store of ours (any version) or an empty directory."""
    if os.path.isdir(path) and not os.listdir(path):
        return True
    try:
        return open_root(path).attrs.get("format") == FORMAT_NAME
    except DatasetError:
        return False


def _remove_store(path: str) -> None:
    """Delete the old store (or the empty directory, or a link to either) being replaced."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def base_attrs(name: str, source: str, classes: int, image_shape: tuple[int, int, int],
               train_samples: int, test_samples: int, dtype: str,
               mean: np.ndarray, std: np.ndarray, pixel_scale: float,
               build: dict[str, Any]) -> dict[str, Any]:
    """The root attributes every store carries (`store.open_dataset_info` reads them)."""
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


def check_dtype(dtype: str) -> str:
    """The canonical name of a float dtype: images are stored as the network's floats."""
    try:
        kind = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"unknown dtype {dtype!r}") from exc
    if kind.kind != "f":
        raise ValueError(f"images are stored as floats; dtype {dtype!r} is not a float type")
    return kind.name


def check_counts(train_samples: int, test_samples: int) -> None:
    """A store needs train samples to normalise by; an empty test split is allowed."""
    if train_samples < 1:
        raise ValueError(f"train_samples must be at least 1, got {train_samples}")
    if test_samples < 0:
        raise ValueError(f"test_samples must be >= 0, got {test_samples}")


def keep_first(available: int, keep: int | None, split: str, source: str) -> int:
    """How many samples of a split a cap keeps: all (None) or the first `keep`."""
    if keep is None:
        return available
    if not 0 <= keep <= available:
        raise SampleCountError(split, keep, f"{available} {split} samples", source)
    return keep


def pixel_statistics(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of uint8 images (N, C, H, W) scaled to [0, 1], exact:
    from integer sums (Python ints, so no overflow), whatever the number of images."""
    pixels = images.shape[0] * images.shape[2] * images.shape[3]
    sums = [int(images[:, c].sum(dtype=np.int64)) for c in range(images.shape[1])]
    squares = [int(np.square(images[:, c], dtype=np.int64).sum())
               for c in range(images.shape[1])]
    mean = np.array([s / pixels / 255.0 for s in sums])
    variance = np.array([(pixels * q - s * s) / (pixels * pixels) / 255.0**2
                         for s, q in zip(sums, squares)])
    return mean, safe_std(variance)


def normalised_pixels(images: np.ndarray, labels: np.ndarray, mean: np.ndarray,
                      std: np.ndarray) -> BlockSource:
    """Blocks of uint8 images as stored: ``(pixel / 255 - mean[c]) / std[c]``, a shard
    at a time (float64 arithmetic, cast to the store's dtype by the writer)."""
    def blocks() -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        shard = shard_rows(len(images))
        for start in range(0, len(images), shard):
            block = images[start:start + shard].astype(np.float64) / 255.0
            yield (start, (block - mean[:, None, None]) / std[:, None, None],
                   labels[start:start + shard])
    return blocks


def safe_std(variance: np.ndarray) -> np.ndarray:
    """Per-channel std; a constant channel keeps std 1 so it normalises to zeros."""
    std = np.sqrt(np.maximum(variance, 0.0))
    return np.where(std > 1e-12, std, 1.0)
