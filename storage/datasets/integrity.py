"""Integrity of a dataset store: recording chunk checksums at build, checking them later.

A damaged store must stop a run with one line naming the array instead of training
on flipped bits or crashing in torch. So the build records a CRC-32C of every chunk
file (a shard of images, the labels) and checks that labels lie in [0, classes).
`ensure_dataset`, which every run calls to open its store, verifies all of them
again (about 0.1 s per 100 MB here, see docs/reliability.md), and workers
range-check the labels they load. ``python -m storage.datasets verify PATH`` checks a
store whole.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage.checksums import ALGORITHM, chunk_files, file_crc32c
from storage.datasets.store import ARRAYS, SPLITS, DatasetDamaged, dataset_attrs, open_root


@dataclass(frozen=True)
class VerifyReport:
    """What `verify_dataset` checked."""

    arrays: int
    files: int
    bytes: int
    seconds: float


def check_label_range(root: str, split: str, labels: np.ndarray, classes: int) -> None:
    """Labels outside [0, classes) would index past the dense head's outputs."""
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise DatasetDamaged(f"dataset store {root!r}: array {split}/labels holds labels from "
                             f"{labels.min()} to {labels.max()}, outside [0, {classes}) for its "
                             f"{classes} classes")


def record_checksums(root: str) -> dict[str, Any]:
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
    attrs = dataset_attrs(path)
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
    group = open_root(root)
    for split in SPLITS:
        check_label_range(root, split, np.asarray(group[f"{split}/labels"][:]),
                          int(attrs["classes"]))
    return VerifyReport(len(ARRAYS), files, size, time.perf_counter() - started)
