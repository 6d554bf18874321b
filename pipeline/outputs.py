"""A run owns its output directory for its lifetime.

Two runs into one directory used to mix their checkpoints, and a rerun silently
replaced some results and left others beside them. So a run holds the directory's
lock (`run.lock`, the same flock-based lock as a sweep store's, `storage.locks`)
from start to end: a second run is refused at once, naming the holder, and a lock
left by a killed run is taken over with a note. Under the lock, a directory that
already holds results is refused unless the run resumes them (`train.resume`) or
replaces them (`train.fresh`, `--fresh`), which removes them first.
"""

from __future__ import annotations

import glob
import os
import shutil
from contextlib import contextmanager
from typing import Callable, Iterator

from pipeline.config import RunConfig
from pipeline.schema import ConfigError
from storage.locks import LockBusy, OwnerLock
from storage.space import writing

LOCK_NAME = "run.lock"
#: What makes a directory hold an earlier run's results.
RESULTS = ("checkpoints.zarr", "record.zarr", "summary.json")
#: What a fresh run removes: the results and the rest of a run's files.
OUTPUTS = RESULTS + ("trace.json", "config.yaml", "record.zarr.partial", "record.zarr.old")


class OutputBusy(LockBusy):
    """Another run is writing the output directory."""


class OutputLock(OwnerLock):
    """The lock of one run output directory."""

    busy_error = OutputBusy

    def __init__(self, output_dir: str) -> None:
        super().__init__(os.path.join(output_dir, LOCK_NAME), f"output directory {output_dir}",
                         "another run")


def earlier_results(output_dir: str) -> list[str]:
    """The results of an earlier run found in `output_dir`."""
    return [name for name in RESULTS if os.path.lexists(os.path.join(output_dir, name))]


def clear_outputs(output_dir: str) -> None:
    """Remove a run's files from `output_dir` (the caller holds its lock)."""
    paths = [os.path.join(output_dir, name) for name in OUTPUTS]
    for path in paths + glob.glob(os.path.join(output_dir, "workspace-*.zarr")):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


@contextmanager
def owned_output(config: RunConfig, say: Callable[[str], None]) -> Iterator[None]:
    """Hold the run's output directory, refused (OutputBusy) if another run does and
    (ConfigError) if it holds results the config neither resumes nor replaces."""
    output_dir = config.output_dir
    lock = OutputLock(output_dir)
    with writing("output directory", output_dir):
        os.makedirs(output_dir, exist_ok=True)
        lock.acquire()
    try:
        note = lock.stale_note()
        if note:
            say(note)
        found = earlier_results(output_dir)
        if found and config.train.fresh:
            clear_outputs(output_dir)
        elif found and not config.train.resume:
            raise ConfigError(f"output: {output_dir} already holds an earlier run's results "
                              f"({', '.join(found)}); pass --fresh (train.fresh=true) to "
                              "replace them, train.resume=true to continue that run, or "
                              "choose another output")
        yield
    finally:
        lock.release()
