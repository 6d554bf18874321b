"""Checkpoints: every weight and optimizer buffer of a run, in Zarr.

Layout::

    checkpoints.zarr/
        sample_indices          (steps, B) int64: the samples of every step taken
        step/<N>/weights/<key>  e.g. "0.weight": the key of the equivalent nn.Sequential
        step/<N>/momentum/<key> SGD momentum buffers, same keys
        attempt/<A>/step/<N>/   checkpoint N as attempt A's workers write it (staged)

A checkpoint counts only once the master has marked it complete (group attribute
``complete``), after every shard wrote its slice: a run killed while writing one
leaves an incomplete step that `latest_complete_step` ignores. Marking it complete
also records a CRC-32C of every tensor (attribute ``checksums``), so that a resume
can tell a complete checkpoint damaged later (a truncated or bit-flipped chunk)
from a good one and fall back to the newest valid one (`latest_valid_step`).
Tensors are chunked along their first axis by `row_chunks[key]` rows, as the run's
layout asks (`Layout.checkpoint_chunks`: at a kernel split's boundaries, so that each
worker writes whole chunks of its own kernels; one chunk for a tensor one process
writes whole). Their chunk files are written and read as plain files
(storage/chunk_files.py): through Zarr's array machinery a chunk costs about 1.2 ms
of CPU.

Fencing: a distributed run's workers never write into ``step/<N>``. Each attempt
(one engine: the run's first, or one after a recovery or a join; `A` is its run
id) writes its checkpoints into its own staging area, ``attempt/<A>``, and the
client moves a checkpoint into ``step/<N>`` (one directory rename) only once every
worker's write of it succeeded, marking it complete first. An attempt that ended
(a worker was lost or stalled) is never committed, and its staging area is removed;
so a worker declared lost that wakes inside a write (a SIGSTOPped or partitioned
one, whose task threads go on where they stopped) can only land its rows in the
ended attempt's area, which no reader opens. `discard_attempts` removes such late
writes and counts them.
"""

from __future__ import annotations

import os
import shutil
import warnings

from collections.abc import Collection

import numpy as np
import zarr

from storage.arrays import ArrayLayout, create_array, create_arrays
from storage.chunk_files import RowChunks
from storage.checksums import ALGORITHM, crc32c

KINDS = ("weights", "momentum")
ATTEMPTS = "attempt"  # the group holding each attempt's staging area


def start_fresh(root_path: str, made_for: str, made_with: dict | None = None) -> None:
    """Replace any earlier checkpoints with an empty store for `made_for` (a text that
    identifies the network, so that a resume can refuse checkpoints of another) and
    `made_with` (the settings that give its steps their arithmetic: batch, SGD, data),
    so that a resume can refuse other settings too."""
    if os.path.exists(root_path):
        shutil.rmtree(root_path)
    attrs = zarr.open_group(root_path, mode="w").attrs
    attrs["made_for"] = made_for
    if made_with is not None:
        attrs["made_with"] = made_with


def made_for(root_path: str) -> str | None:
    """What `start_fresh` recorded the checkpoints were made for."""
    return zarr.open_group(root_path, mode="r").attrs.get("made_for")


def made_with(root_path: str) -> dict | None:
    """The settings `start_fresh` recorded (None: a store written before they were)."""
    return zarr.open_group(root_path, mode="r").attrs.get("made_with")


def step_group(step: int) -> str:
    return f"step/{step:07d}"


def create_checkpoint(root_path: str, step: int, shapes: dict[str, tuple[int, ...]],
                      row_chunks: dict[str, int], dtype: str) -> None:
    """Create the arrays of checkpoint `step` (overwriting an incomplete one)."""
    root = zarr.open_group(root_path, mode="a")
    group = root.require_group(step_group(step))
    group.attrs["complete"] = False
    layouts = {}
    for kind in KINDS:
        for key, shape in shapes.items():
            rows = row_chunks.get(key, shape[0])
            chunks = (max(1, min(rows, shape[0])),) + tuple(shape[1:])
            layouts[f"{kind}/{key}"] = ArrayLayout(tuple(shape), chunks, dtype)
    create_arrays(group, layouts)


def write_slice(root_path: str, step: int, kind: str, key: str, start: int,
                data: np.ndarray) -> None:
    """Write rows [start, start+len(data)) of one tensor (a shard's kernels)."""
    path = f"{step_group(step)}/{kind}/{key}"
    chunks = RowChunks.open(os.path.join(root_path, *path.split("/")))
    if chunks is None or not chunks.write(start, data):
        zarr.open_array(root_path, path=path, mode="r+")[start:start + data.shape[0]] = data


def mark_complete(root_path: str, step: int, meta: dict, attempt: str | None = None) -> None:
    """Make checkpoint `step` count, recording its tensors' checksums (the client
    calls this once every worker has written its rows). With `attempt`, the
    checkpoint is the one `stage_checkpoint` made: marked in the staging area, then
    moved into ``step/<N>`` by one rename (replacing an older copy of that step,
    which can only be an incomplete or damaged one: a run never goes past a
    complete checkpoint it could restore)."""
    staged = root_path if attempt is None else staging_root(root_path, attempt)
    group = zarr.open_group(staged, mode="r+", path=step_group(step))
    sums = {name: crc32c(_whole(array)) for name, array in _tensors(group)}
    group.attrs.update({**meta, "checksums": {"algorithm": ALGORITHM, "tensors": sums},
                        "complete": True})
    if attempt is None:
        return
    zarr.open_group(root_path, mode="a").require_group("step")
    source, target = (os.path.join(base, *step_group(step).split("/"))
                      for base in (staged, root_path))
    if os.path.exists(target):
        replaced = os.path.join(staged, f"replaced-{step}")
        os.rename(target, replaced)
        os.rename(source, target)
        shutil.rmtree(replaced)
    else:
        os.rename(source, target)


def staging_root(root_path: str, attempt: str) -> str:
    """Where attempt `attempt` writes its checkpoints (a Zarr group: writers pass it
    as their `root_path`)."""
    return os.path.join(root_path, ATTEMPTS, attempt)


def store_of(path: str) -> str:
    """The checkpoint store a writer's root belongs to (itself, or the store holding
    an attempt's staging area): what a message about the store names."""
    parent = os.path.dirname(os.path.normpath(path))
    store = os.path.dirname(parent)
    staged = os.path.basename(parent) == ATTEMPTS and store.endswith(".zarr")
    return store if staged else path


def stage_checkpoint(root_path: str, attempt: str, step: int,
                     shapes: dict[str, tuple[int, ...]], row_chunks: dict[str, int],
                     dtype: str) -> str:
    """Create checkpoint `step`'s arrays in `attempt`'s staging area; returns the root
    its writers use. `mark_complete(..., attempt=attempt)` commits it."""
    zarr.open_group(root_path, mode="a").require_group(f"{ATTEMPTS}/{attempt}")
    staged = staging_root(root_path, attempt)
    create_checkpoint(staged, step, shapes, row_chunks, dtype)
    return staged


def end_attempt(root_path: str, attempt: str) -> None:
    """Remove `attempt`'s staging area (its run closed: what is there was never
    committed). A write that lands later makes folders there again, which
    `discard_attempts` finds."""
    shutil.rmtree(staging_root(root_path, attempt), ignore_errors=True)


def discard_attempts(root_path: str, keep: str | None = None) -> dict[str, int]:
    """Remove every attempt's staging area but `keep`'s; returns, for each removed
    one that held files, how many (writes that landed after its attempt ended,
    when `end_attempt` had removed it: they never reached a checkpoint)."""
    base = os.path.join(root_path, ATTEMPTS)
    found: dict[str, int] = {}
    for attempt in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        folder = os.path.join(base, attempt)
        if attempt == keep or not os.path.isdir(folder):
            continue
        files = sum(len(names) for _, _, names in os.walk(folder))
        if files:
            found[attempt] = files
        shutil.rmtree(folder, ignore_errors=True)
    return found


def _tensors(group: zarr.Group) -> list[tuple[str, zarr.Array]]:
    """(kind/key, array) of every tensor of a checkpoint group."""
    return [(f"{kind}/{name}", array) for kind in KINDS if kind in group
            for name, array in group[kind].arrays()]


def _rows(root_path: str, path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows [start, stop) of the array at `path` in the store at `root_path`, its
    chunk files read as files where their layout allows (storage/chunk_files.py)."""
    chunks = RowChunks.open(os.path.join(root_path, *path.split("/")))
    if chunks is not None:
        return chunks.read(start, stop)
    return zarr.open_array(root_path, path=path, mode="r")[start:stop]


def _whole(array: zarr.Array) -> np.ndarray:
    """Every value of an array of a checkpoint store, its metadata as Zarr read it."""
    root = getattr(array.store, "root", None)  # a local store's folder
    chunks = None if root is None else RowChunks.of(
        os.path.join(str(root), *array.path.split("/")), array.metadata)
    return array[...] if chunks is None else chunks.read()


def damage(root_path: str, step: int) -> str | None:
    """Why complete checkpoint `step` cannot be trusted (a tensor unreadable or not
    matching its checksum), or None if it is whole. Reads every tensor."""
    try:
        group = zarr.open_group(root_path, mode="r", path=step_group(step))
        recorded = group.attrs.get("checksums")
        if not isinstance(recorded, dict) or recorded.get("algorithm") != ALGORITHM:
            return "it records no checksums"
        expected = dict(recorded.get("tensors", {}))
        for name, array in _tensors(group):
            if expected.pop(name, None) != crc32c(_whole(array)):
                return f"tensor {name} does not match its checksum"
        if expected:
            return f"tensor {sorted(expected)[0]} is missing"
    except Exception as error:  # noqa: BLE001 - a torn chunk fails in many ways in Zarr
        return f"it cannot be read ({type(error).__name__}: {' '.join(str(error).split())})"
    return None


def latest_valid_step(root_path: str) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest complete checkpoint whose tensors match their checksums, and the
    newer complete ones passed over, each with its damage (newest first)."""
    passed: list[tuple[int, str]] = []
    for step in sorted(complete_steps(root_path), reverse=True):
        problem = damage(root_path, step)
        if problem is None:
            return step, passed
        passed.append((step, problem))
    return None, passed


def complete_steps(root_path: str) -> list[int]:
    """The checkpoints every writer finished, oldest first (not checked for damage)."""
    try:
        root = zarr.open_group(root_path, mode="r")
    except FileNotFoundError:
        return []
    if "step" not in root:
        return []
    with warnings.catch_warnings():
        # read while a run writes (a resume, or someone watching a run): Zarr writes
        # each metadata file as NAME.<hex>.partial and renames it into place, and a
        # new step's folder exists a moment before its zarr.json; a listing that meets
        # either warns that it is no Zarr component, which is true and harmless: a
        # checkpoint counts only once marked complete
        warnings.filterwarnings("ignore", message=r"Object at \S+ is not recognized")
        return sorted(int(name) for name, group in root["step"].groups()
                      if group.attrs.get("complete"))


def latest_complete_step(root_path: str) -> int | None:
    """The newest checkpoint every writer finished, or None."""
    steps = complete_steps(root_path)
    return max(steps) if steps else None


def read_tensors(root_path: str, step: int, kind: str = "weights",
                 keys: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The tensors of one kind of a checkpoint, keyed like a torch state_dict: all of
    them, or only `keys` (a worker that needs a few reads no others)."""
    group = zarr.open_group(root_path, mode="r", path=f"{step_group(step)}/{kind}")
    return {name: _whole(array) for name, array in group.arrays()
            if keys is None or name in keys}


def read_slice(root_path: str, step: int, kind: str, key: str, start: int,
               stop: int) -> np.ndarray:
    return _rows(root_path, f"{step_group(step)}/{kind}/{key}", start, stop)


def write_sample_indices(root_path: str, first_step: int, indices: np.ndarray,
                         total_steps: int) -> None:
    """Record the sample indices of steps first_step.. (one row per step)."""
    root = zarr.open_group(root_path, mode="a")
    batch = indices.shape[1]
    if "sample_indices" not in root or root["sample_indices"].shape[1] != batch:
        create_array(root, "sample_indices", (total_steps, batch), (64, batch), "int64")
    elif root["sample_indices"].shape[0] < total_steps:  # a resumed run asked for more
        root["sample_indices"].resize((total_steps, batch))
    root["sample_indices"][first_step:first_step + len(indices)] = indices


def read_sample_indices(root_path: str) -> np.ndarray:
    return zarr.open_array(root_path, path="sample_indices", mode="r")[...]
