"""A full disk, said plainly: which store's disk is full, wherever it filled.

Python's ``OSError(28, 'No space left on device')`` from a Zarr chunk write names
no path (Zarr writes a temporary file and renames it), and on a worker it reaches
the user as Dask's "Compute Failed" block. So every place that writes a store
wraps its writes in `writing(store, path)`, which turns that error into a
`NoSpace` naming the store (the workspace, the checkpoint store, the output
directory, the dataset store, a sweep's results store) and its path; a `NoSpace` raised on a worker
reaches the client whole (it pickles), and the entry points print it in one line
with what was kept. Zarr's local store replaces a file only once it is written
whole, so a write refused for space leaves what was there before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from typing import Iterator

#: errno values that mean "the disk (or the user's quota on it) is full".
FULL = (errno.ENOSPC, errno.EDQUOT)


class NoSpace(OSError):
    """A write to `store` at `path` was refused: its disk (or quota) is full."""

    def __init__(self, store: str, path: str, detail: str = "") -> None:
        self.store, self.path, self.detail = store, path, detail or free_text(path)
        super().__init__(errno.ENOSPC, f"no space left on the disk holding the {store} "
                         f"{path}{f' ({self.detail})' if self.detail else ''}")

    def __reduce__(self) -> tuple:
        # OSError pickles as (type, (errno, strerror)), which this __init__ does not take
        return (type(self), (self.store, self.path, self.detail))

    def __str__(self) -> str:
        return self.strerror or ""


def is_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a full disk."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL:
            return True
        current = current.__cause__ or current.__context__
    return False


def free_text(path: str) -> str:
    """``"12 KiB free of 3.0 MiB"`` for the file system holding `path` ("" if unknown)."""
    folder = os.path.abspath(path)
    while folder and not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return ""
    return f"{size_text(usage.free)} free of {size_text(usage.total)}"


def size_text(count: int) -> str:
    """A byte count as people read it: 0 B, 512 B, 12 KiB, 3.0 MiB, 1.5 GiB."""
    value, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"


@contextlib.contextmanager
def writing(store: str, path: str) -> Iterator[None]:
    """Turn a full disk met inside the block into `NoSpace(store, path)`; a `NoSpace`
    raised inside (a nested, more precise `writing`) passes unchanged."""
    try:
        yield
    except NoSpace:
        raise
    except Exception as error:  # Zarr may wrap the OSError; `is_full` looks through
        if not is_full(error):
            raise
        raise NoSpace(store, path) from error


def replace_file(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all: into a temporary file beside it,
    then renamed over it, so a full disk leaves the old file (or none), never half."""
    temporary = f"{path}.{uuid.uuid4().hex[:8]}.partial"
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
