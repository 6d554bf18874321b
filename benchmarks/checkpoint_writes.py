"""A checkpoint's write and check, through Zarr's array API against chunk files.

``python -m benchmarks.checkpoint_writes [--network resnet50] [--image-size 64]
[--repeats 3] [--dir /tmp]``

A checkpoint is every tensor of a network, weights and momentum, in Zarr arrays
(storage/checkpoints.py): made, written, then each tensor read back for its
checksum. This times the whole of that on `--network`'s tensors (seeded initial
weights) two ways, in turn, `--repeats` times each, in fresh folders under `--dir`:

- ``zarr``: every write and read through Zarr's array API (``array[a:b] = rows``,
  ``array[...]``), as checkpoints were written before storage/chunk_files.py;
- ``files``: `storage.checkpoints` as runs use it (chunk files as files).

and for each of three chunkings: ``quanta`` (every channel quantum a chunk, as
kernel checkpoints were chunked before their split decided it), ``split/2`` (an
even kernel split over two workers: two chunks a conv tensor, `KernelLayout.
checkpoint_chunks`) and ``whole`` (a chunk a tensor: the step-0 weights, a replica's
trunk). It prints each time's median and range, the chunk files, and the ratio of
the medians, files over zarr, per chunking. The disk's page cache is left as it is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable

import numpy as np
import zarr

from pipeline.config.run_config import auto_channel_quanta
from storage import checkpoints
from storage.checksums import crc32c
from tasks.layout import layout_from_counts
from tasks.network import checkpoint_row_chunks, checkpoint_shapes, initial_state
from tasks.zoo import build_preset

WRITERS = ("zarr", "files")


def through_zarr(path: str, step: int, state: dict[str, np.ndarray]) -> None:
    """Write every tensor and read it back for its checksum through Zarr's arrays."""
    group = zarr.open_group(path, mode="r+", path=checkpoints.step_group(step))
    for kind in checkpoints.KINDS:
        for key, value in state.items():
            group[f"{kind}/{key}"][0:value.shape[0]] = value
    sums = {f"{kind}/{key}": crc32c(group[f"{kind}/{key}"][...])
            for kind in checkpoints.KINDS for key in state}
    group.attrs.update({"checksums": sums, "complete": True})


def as_files(path: str, step: int, state: dict[str, np.ndarray]) -> None:
    """Write every tensor as runs do, then mark the checkpoint complete."""
    for kind in checkpoints.KINDS:
        for key, value in state.items():
            checkpoints.write_slice(path, step, kind, key, 0, value)
    checkpoints.mark_complete(path, step, {"step": step})


def time_checkpoint(root: str, state: dict[str, np.ndarray], shapes: dict, chunks: dict,
                    dtype: str, write: Callable) -> tuple[float, int]:
    """Seconds to make, write and check one checkpoint in a fresh folder; its files."""
    path = tempfile.mkdtemp(dir=root)
    try:
        zarr.open_group(path, mode="w")
        started = time.perf_counter()
        checkpoints.create_checkpoint(path, 0, shapes, chunks, dtype)
        write(path, 0, state)
        seconds = time.perf_counter() - started
        files = sum(len(names) for _, _, names in os.walk(path))
        return seconds, files
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--network", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args(argv)

    network = build_preset(args.network, (3, args.image_size, args.image_size), 1000,
                           "float32")
    state = initial_state(network, seed=0)
    shapes = checkpoint_shapes(network)
    quanta = checkpoint_row_chunks(network, auto_channel_quanta(network))
    halves = [[c.kernels // 2, c.kernels - c.kernels // 2] for c in network.conv]
    split = layout_from_counts(["w0", "w1"], halves, 0)
    chunkings = {"quanta": quanta, "split/2": split.checkpoint_chunks(network, quanta),
                 "whole": {}}
    megabytes = 2 * sum(v.nbytes for v in state.values()) / 1e6
    print(f"{args.network} at {args.image_size}x{args.image_size}: {len(state)} tensors, "
          f"{megabytes:.0f} MB (weights and momentum), {args.repeats} repeats, in "
          f"{args.dir}")
    writers = {"zarr": through_zarr, "files": as_files}
    for name, chunks in chunkings.items():
        times: dict[str, list[float]] = {w: [] for w in WRITERS}
        files = 0
        for repeat in range(args.repeats):
            order = WRITERS if repeat % 2 == 0 else WRITERS[::-1]
            for writer in order:
                seconds, files = time_checkpoint(args.dir, state, shapes, chunks,
                                                 network.dtype, writers[writer])
                times[writer].append(seconds)
        medians = {w: statistics.median(t) for w, t in times.items()}
        spans = "; ".join(f"{w} {medians[w]:.2f} s ({min(times[w]):.2f}-{max(times[w]):.2f})"
                          for w in WRITERS)
        print(f"{name:>8}: {files} files; {spans}; files/zarr "
              f"{medians['files'] / medians['zarr']:.3f}")


if __name__ == "__main__":
    main()
