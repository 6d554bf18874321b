"""The CIFAR-10 importer: CIFAR-10's python release into a normalised dataset store.

The release is a tar.gz of pickled dicts. Unpickling runs whatever globals a pickle
names, so a tampered archive could run code: `_NumpyOnlyUnpickler` resolves only the
few numpy globals the real batches use. The archive is read in place, in one
streaming pass, and never extracted to disk.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
import zlib
from typing import Any

import numpy as np

from storage.datasets.store import DatasetError, DatasetInfo
from storage.datasets.writer import (base_attrs, check_counts, check_dtype, check_target,
                                     keep_first, normalised_pixels, pixel_statistics,
                                     write_store)

CIFAR10_IMAGE_SHAPE = (3, 32, 32)
CIFAR10_CLASSES = 10
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_META = "batches.meta"


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles CIFAR-10 batches without running arbitrary code from the archive.

    The batches reference only numpy's array reconstruction (as ``numpy.core`` when
    written by old numpy; protocol 5's ``_frombuffer``) and, for Python 3 protocol-2
    pickles, ``_codecs.encode`` and, for an empty bytes value, ``bytes()`` with no
    argument (`_empty_bytes`: any argument is refused, so that no small file asks
    for a huge allocation).
    """

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }
    EMPTY_BYTES = {("__builtin__", "bytes"), ("builtins", "bytes")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.EMPTY_BYTES:
            return _empty_bytes
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name} in a CIFAR-10 batch")
        if module.startswith("numpy.core."):
            module = module.replace("numpy.core.", "numpy._core.", 1)  # numpy 2's name; no shim
        return super().find_class(module, name)


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()`, as a protocol-2 pickle writes an empty bytes value; any argument is
    refused (``bytes(10**12)`` would allocate a terabyte)."""
    if args:
        raise pickle.UnpicklingError("bytes() with arguments in a CIFAR-10 batch")
    return b""


def _load_batch(raw: bytes, where: str) -> dict[bytes, Any]:
    """One pickled batch as a dict, through the safe unpickler; DatasetError if damaged."""
    try:
        batch = _NumpyOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # pickle raises many types on damaged input
        raise DatasetError(f"{where} is not a readable CIFAR-10 pickle ({exc!r})") from exc
    if not isinstance(batch, dict):
        raise DatasetError(
            f"{where} is not a CIFAR-10 batch (a {type(batch).__name__}, not a dict)")
    # CIFAR-10's own keys are bytes (Python 2's str); a variant pickled again by
    # Python 3 may have str keys: the same batch
    return {key.encode() if isinstance(key, str) else key: value
            for key, value in batch.items()}


def _parse_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (n, 3, 32, 32) and int64 labels (n,) from one pickled batch."""
    batch = _load_batch(raw, where)
    data, labels = batch.get(b"data"), batch.get(b"labels")
    row = int(np.prod(CIFAR10_IMAGE_SHAPE))
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[1] == row):
        found = ("no such key" if data is None else
                 (getattr(data, "dtype", type(data).__name__), getattr(data, "shape", "")))
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


def is_cifar10_folder(folder: str) -> bool:
    """Whether a folder holds CIFAR-10: its extracted batches (in it or in its
    ``cifar-10-batches-py``) or its archive."""
    return os.path.isfile(os.path.join(folder, CIFAR10_ARCHIVE)) or any(
        os.path.isfile(os.path.join(place, CIFAR10_TRAIN_BATCHES[0]))
        for place in (folder, os.path.join(folder, CIFAR10_FOLDER)))


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


def _class_names(raw: bytes | None, where: str) -> list[str] | None:
    """The label names from batches.meta, if present and well formed (informational)."""
    if raw is None:
        return None
    names = _load_batch(raw, where).get(b"label_names")
    if not isinstance(names, list) or len(names) != CIFAR10_CLASSES:
        return None
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names]


def cifar10_fingerprint(source: str) -> str:
    """A digest of the files CIFAR-10 may be read from at `source` (the archive, or
    the batches of an extracted folder): their paths, sizes and modification times.
    Another archive of the same name (a variant in CIFAR-10's format) differs."""
    folder = os.path.abspath(source)
    if os.path.isfile(folder):
        places = [folder]
    else:
        names = (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH, CIFAR10_META)
        places = [os.path.join(folder, CIFAR10_ARCHIVE)] + [
            os.path.join(place, name) for place in (folder, os.path.join(folder, CIFAR10_FOLDER))
            for name in names]
    digest = hashlib.sha256()
    for place in places:
        if os.path.isfile(place):
            status = os.stat(place)
            digest.update(f"{place}\0{status.st_size}\0{status.st_mtime_ns}\n".encode(
                "utf-8", "surrogateescape"))
    return digest.hexdigest()


def cifar10_build(source: str, train_samples: int | None, test_samples: int | None,
                  dtype: str, fingerprint: str) -> dict[str, Any]:
    """The 'build' attribute of a CIFAR-10 store: what `ensure_dataset` compares to
    decide whether a store at a path was made from the same request (the same files:
    `cifar10_fingerprint`)."""
    return {"kind": "cifar10", "source": os.path.abspath(source), "files": fingerprint,
            "train_samples": train_samples, "test_samples": test_samples, "dtype": dtype}


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
    dtype = check_dtype(dtype)
    check_target(os.path.abspath(path), overwrite)
    fingerprint = cifar10_fingerprint(source)  # before reading: a later change rebuilds
    resolved, members = _read_cifar_members(source)
    missing = [n for n in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH) if n not in members]
    if missing:
        raise DatasetError(f"CIFAR-10 source {resolved!r} lacks {', '.join(missing)}")

    def split_arrays(names: tuple[str, ...], keep: int | None,
                     split: str) -> tuple[np.ndarray, np.ndarray]:
        parts = [_parse_batch(members.pop(name), f"{resolved}:{name}") for name in names]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        kept = keep_first(len(images), keep, split, resolved)
        return images[:kept], labels[:kept]

    train = split_arrays(CIFAR10_TRAIN_BATCHES, train_samples, "train")
    test = split_arrays((CIFAR10_TEST_BATCH,), test_samples, "test")
    check_counts(len(train[0]), len(test[0]))

    mean, std = pixel_statistics(train[0])
    attrs = base_attrs("cifar10", resolved, CIFAR10_CLASSES, CIFAR10_IMAGE_SHAPE,
                       len(train[0]), len(test[0]), dtype, mean, std, 1.0 / 255.0,
                       cifar10_build(source, train_samples, test_samples, dtype,
                                     fingerprint))
    names = _class_names(members.get(CIFAR10_META), f"{resolved}:{CIFAR10_META}")
    if names is not None:
        attrs["class_names"] = names
    return write_store(path, overwrite, attrs, CIFAR10_IMAGE_SHAPE, dtype,
                       {"train": (len(train[0]), normalised_pixels(*train, mean, std)),
                        "test": (len(test[0]), normalised_pixels(*test, mean, std))})
