"""Checkpoints: every weight and optimizer buffer of a run, in Zarr.

Layout::

    checkpoints.zarr/
        sample_indices          (steps, B) int64: the samples of every step taken
        step/<N>/weights/<key>  e.g. "0.weight": the key of the equivalent nn.Sequential
        step/<N>/momentum/<key> SGD momentum buffers, same keys

A checkpoint counts only once the master has marked it complete (group attribute
``complete``), after every shard wrote its slice: a run killed while writing one
leaves an incomplete step that `latest_complete_step` ignores.
Tensors are chunked along their first axis by `row_chunks[key]` rows (conv tensors
by their layer's channel quantum), so that each worker writes whole chunks of its
own kernels.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import zarr

from storage.arrays import create_array

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
    group = zarr.open_group(root_path, mode="r+", path=step_group(step))
    group.attrs.update({**meta, "complete": True})


def latest_complete_step(root_path: str) -> int | None:
    """The newest checkpoint every writer finished, or None."""
    try:
        root = zarr.open_group(root_path, mode="r")
    except FileNotFoundError:
        return None
    if "step" not in root:
        return None
    steps = [int(name) for name, group in root["step"].groups()
             if group.attrs.get("complete")]
    return max(steps) if steps else None


def read_tensors(root_path: str, step: int, kind: str = "weights") -> dict[str, np.ndarray]:
    """All tensors of one kind of a checkpoint, keyed like a torch state_dict."""
    group = zarr.open_group(root_path, mode="r", path=f"{step_group(step)}/{kind}")
    return {name: array[...] for name, array in group.arrays()}


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
