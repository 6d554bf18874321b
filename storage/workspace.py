"""The per-run activation/gradient workspace: the arrays that carry one step's data.

Layout (all arrays shaped for the run's fixed batch size B)::

    act/<l>          pooled output of conv layer l, (B, K_l, h_l, w_l)
    grad_top         dLoss/d act/<L-1>, written by the master's dense head
    partial/<l>/<d>  shard d's partial input gradient of layer l >= 1: shaped like act/<l-1>

Chunks span one quantum of channels (per layer) and everything else, so a shard whose
kernel range is aligned to its layer's quantum owns whole chunks: writers in different processes
never share a chunk (Zarr would lose writes otherwise). The master creates every
array before any task writes.
"""

from __future__ import annotations

import os
import shutil

import zarr

from storage.arrays import create_array, forget_cached

GRAD_TOP = "grad_top"


def act_path(layer: int) -> str:
    return f"act/{layer}"


def partial_path(layer: int, shard: int) -> str:
    return f"partial/{layer}/{shard}"


def create_workspace(path: str, batch: int, layer_shapes: list[tuple[int, int, int]],
                     shards_per_layer: list[int], quanta: list[int], dtype: str) -> None:
    """Create every array of the workspace, replacing any earlier run's.

    `layer_shapes[l]` is conv layer l's pooled output (channels, height, width);
    `shards_per_layer[l]` how many shards layer l is split into, `quanta[l]` its
    channel quantum.
    """
    root = zarr.open_group(path, mode="w")
    forget_cached()
    for layer, (channels, height, width) in enumerate(layer_shapes):
        chunks = (batch, min(quanta[layer], channels), height, width)
        create_array(root, act_path(layer), (batch, channels, height, width), chunks, dtype)
        if layer >= 1:
            below_channels, below_h, below_w = layer_shapes[layer - 1]
            below_chunks = (batch, min(quanta[layer - 1], below_channels), below_h, below_w)
            for shard in range(shards_per_layer[layer]):
                create_array(root, partial_path(layer, shard),
                             (batch, below_channels, below_h, below_w), below_chunks, dtype)
    channels, height, width = layer_shapes[-1]
    create_array(root, GRAD_TOP, (batch, channels, height, width),
                 (batch, min(quanta[-1], channels), height, width), dtype)


def default_workspace_path(output_dir: str, run_id: str, all_workers_local: bool) -> str:
    """Where a run's workspace goes when the config names none.

    Activations are rewritten every step, so the store's per-chunk cost matters: on
    this machine a chunk write cost about 2 ms on disk and 0.3 ms on /dev/shm. When
    every worker shares the master's host, the workspace goes to /dev/shm (RAM, and
    removed after the run); otherwise into the output directory, which must then be
    on a file system all hosts share (or set workspace.path to a shared URL).
    """
    shm = "/dev/shm"
    if all_workers_local and os.path.isdir(shm) and os.access(shm, os.W_OK):
        return os.path.join(shm, f"dask-cnn-{os.getuid()}", f"{run_id}.zarr")
    return os.path.join(output_dir, "workspace.zarr")


def remove_workspace(path: str) -> None:
    """Delete a local workspace (it holds only the last step's scratch data)."""
    if "://" not in path and os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
