"""Checkpoints: every weight and optimizer buffer of a run, in Zarr.

Layout::

    checkpoints.zarr/
        sample_indices          (steps, B) int64: the samples of every step taken
        step/<N>/weights/<key>  e.g. "0.weight": the key of the equivalent nn.Sequential
        step/<N>/momentum/<key> SGD momentum buffers, same keys

A checkpoint counts only once the master has marked it complete (group attribute
``complete``), after every shard wrote its slice: a run killed while writing one
leaves an incomplete step that `latest_complete_step` ignores. Marking it complete
also records a CRC-32C of every tensor (attribute ``checksums``), so that a resume
can tell a complete checkpoint damaged later (a truncated or bit-flipped chunk)
from a good one and fall back to the newest valid one (`latest_valid_step`).
Tensors are chunked along their first axis by `row_chunks[key]` rows (conv tensors
by their layer's channel quantum), so that each worker writes whole chunks of its
own kernels.
"""

from __future__ import annotations

import os
import shutil

from collections.abc import Collection

import numpy as np
import zarr

from storage.arrays import create_array
from storage.checksums import ALGORITHM, crc32c

KINDS = ("weights", "momentum")


def start_fresh(root_path: str, made_for: str) -> None:
    """Replace any earlier checkpoints with an empty store for `made_for` (a text that
    identifies the network, so that a resume can refuse checkpoints of another)."""
    if os.path.exists(root_path):
        shutil.rmtree(root_path)
    zarr.open_group(root_path, mode="w").attrs["made_for"] = made_for


def made_for(root_path: str) -> str | None:
    """What `start_fresh` recorded the checkpoints were made for."""
    return zarr.open_group(root_path, mode="r").attrs.get("made_for")


def step_group(step: int) -> str:
    return f"step/{step:07d}"


def create_checkpoint(root_path: str, step: int, shapes: dict[str, tuple[int, ...]],
                      row_chunks: dict[str, int], dtype: str) -> None:
    """Create the arrays of checkpoint `step` (overwriting an incomplete one)."""
    root = zarr.open_group(root_path, mode="a")
    group = root.require_group(step_group(step))
    group.attrs["complete"] = False
    for kind in KINDS:
        for key, shape in shapes.items():
            rows = row_chunks.get(key, shape[0])
            chunks = (max(1, min(rows, shape[0])),) + tuple(shape[1:])
            create_array(group, f"{kind}/{key}", tuple(shape), chunks, dtype)


def write_slice(root_path: str, step: int, kind: str, key: str, start: int,
                data: np.ndarray) -> None:
    """Write rows [start, start+len(data)) of one tensor (a shard's kernels)."""
    array = zarr.open_array(root_path, path=f"{step_group(step)}/{kind}/{key}", mode="r+")
    array[start:start + data.shape[0]] = data


def mark_complete(root_path: str, step: int, meta: dict) -> None:
    """Make checkpoint `step` count, recording its tensors' checksums (the client
    calls this once every worker has written its rows)."""
    group = zarr.open_group(root_path, mode="r+", path=step_group(step))
    sums = {name: crc32c(array[...]) for name, array in _tensors(group)}
    group.attrs.update({**meta, "checksums": {"algorithm": ALGORITHM, "tensors": sums},
                        "complete": True})


def _tensors(group: zarr.Group) -> list[tuple[str, zarr.Array]]:
    """(kind/key, array) of every tensor of a checkpoint group."""
    return [(f"{kind}/{name}", array) for kind in KINDS if kind in group
            for name, array in group[kind].arrays()]


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
            if expected.pop(name, None) != crc32c(array[...]):
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
    return {name: array[...] for name, array in group.arrays() if keys is None or name in keys}


def read_slice(root_path: str, step: int, kind: str, key: str, start: int,
               stop: int) -> np.ndarray:
    array = zarr.open_array(root_path, path=f"{step_group(step)}/{kind}/{key}", mode="r")
    return array[start:stop]


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
