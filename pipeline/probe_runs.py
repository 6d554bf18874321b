"""Calibration runs: the engine's own tasks, timed at chosen shard sizes.

A synthetic timing loop (:func:`pipeline.probe.time_shard`) underestimates
what a shard costs inside training by 15-30 % on this machine: a real task
runs once, on freshly allocated tensors (in a VM every new page faults
expensively), between other tasks' Zarr I/O and Dask's messaging.  So the
probe runs :class:`~pipeline.kernel_engine.KernelParallelEngine` itself for a
few steps per *plan* (which workers hold how many kernels of each layer) and
reads the receipts: per task its compute, read and write seconds and bytes,
and per step the master's dense head and I/O.  Shards need not cover a layer
(the uncovered channels stay zero), which lets a plan put small or large
shards on every worker at once.

Plans: the even split over the first ``P`` workers for ``P = 1..n`` (what
``single`` and ``kernel`` run), plus, where a step is cheap, small shards on
every worker and splits where one worker holds three quarters or all but the
minimum of each layer, so that a table of shard times spans the counts
another split may use.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import uuid
from typing import Any, Sequence

import numpy as np

from pipeline.placement import shard_ranges, split_even
from tasks.specs import ConvLayerSpec, NetworkSpec

__all__ = ["Plan", "plans_for", "run_plans", "probe_config"]

#: Rough single-thread conv rate, only to budget which plans are cheap enough.
_BUDGET_FLOPS = 100e9


@dataclasses.dataclass
class Plan:
    """Kernels per layer (rows) and worker (columns) of one calibration run."""

    counts: list[list[int]]

    @property
    def workers(self) -> int:
        return len(self.counts[0])


def _layer_s(layer: ConvLayerSpec, batch: int, kernels: int) -> float:
    macs = batch * layer.conv_height * layer.conv_width * kernels * layer.in_channels \
        * layer.kernel_size ** 2
    return 6 * macs / _BUDGET_FLOPS


def plan_seconds(network: NetworkSpec, batch: int, plan: Plan) -> float:
    """Rough seconds of one step of ``plan`` (its slowest worker)."""
    return max(sum(_layer_s(layer, batch, row[w]) for layer, row in zip(network.conv, plan.counts))
               for w in range(plan.workers))


def plans_for(network: NetworkSpec, batch: int, quanta: Sequence[int], n: int,
              budget_s: float = 1.0) -> list[Plan]:
    """Even splits over 1..n workers, then small and tilted shards if a step is cheap."""
    plans = []
    for p in range(1, n + 1):
        if all(math.ceil(layer.kernels / q) >= p for layer, q in zip(network.conv, quanta)):
            plans.append(Plan([split_even(layer.kernels, p, q)
                               for layer, q in zip(network.conv, quanta)]))
    small = Plan([[q] * n for q in quanta])
    if all(q * n <= layer.kernels for layer, q in zip(network.conv, quanta)) and \
            plan_seconds(network, batch, small) < budget_s:
        plans.append(small)
    if n >= 2:  # one worker holds most of each layer: where uneven splits land
        for fraction in (0.75, 1.0):
            tilted = _tilted(network, quanta, n, fraction)
            for rotation in range(min(n, 2)) if tilted else ():
                plan = Plan([row[-rotation:] + row[:-rotation] if rotation else row
                             for row in tilted])
                if plan_seconds(network, batch, plan) < budget_s and plan not in plans:
                    plans.append(plan)
    return plans


def _tilted(network: NetworkSpec, quanta: Sequence[int], n: int, fraction: float
            ) -> list[list[int]]:
    """Counts where the first worker holds ``fraction`` of each layer's quanta (at most
    all but one per other worker) and the others share the rest; [] if impossible."""
    rows = []
    for layer, q in zip(network.conv, quanta):
        units = layer.kernels // q
        big = min(max(1, int(fraction * units)), units - (n - 1))
        rest = units - big
        if big < 1 or rest < n - 1:
            return []
        rows.append([big * q] + [max(1, rest // (n - 1)) * q] * (n - 1))
    return rows


def probe_config(network: NetworkSpec, batch: int, dataset: str, output: str,
                 workspace: str | None = None) -> Any:
    """A run config for calibration runs of ``network`` (weights from a fresh seed)."""
    from pipeline.config import (ConvLayerConfig, DataConfig, NetworkConfig, RunConfig,
                                 TrainConfig, WorkspaceConfig)

    conv = [ConvLayerConfig(layer.kernels, layer.kernel_size, layer.padding, layer.pool)
            for layer in network.conv]
    return RunConfig(
        name=f"probe-{uuid.uuid4().hex[:6]}", strategy="kernel", placement="even",
        network=NetworkConfig(conv, list(network.hidden), network.classes, network.dtype),
        data=DataConfig(path=dataset), train=TrainConfig(steps=3, batch=batch, lr=1e-3),
        workspace=WorkspaceConfig(path=workspace), output=output, progress=False)


def run_plans(client: Any, slots: Sequence[Any], network: NetworkSpec, batch: int,
              quanta: Sequence[int], dataset: str, plans: Sequence[Plan],
              workspace_dir: str | None = None, steps: int | None = None) -> list[dict]:
    """Run every plan for a few steps; one record per plan (receipts and master times).

    Each record: ``plan`` (counts), ``receipts`` (dicts of the tasks of the measured
    steps: the first step is a warm-up) and ``master`` (per measured step, the
    engine's master times).  The probe's checkpoint and workspaces are removed.
    """
    from pipeline.kernel_engine import KernelParallelEngine, Placement
    from pipeline.train import prepare_checkpoints
    from storage.datasets import open_dataset_info
    from tasks.worker_state import configure_process

    import torch

    base = tempfile.mkdtemp(prefix="probe-", dir=_output_root(slots))
    workspace = (os.path.join(workspace_dir, f"probe-{uuid.uuid4().hex[:8]}.zarr")
                 if workspace_dir else None)
    config = probe_config(network, batch, dataset, base, workspace)
    samples = open_dataset_info(dataset).train_samples
    threads = torch.get_num_threads()
    configure_process(1)  # as run_training: the master's head must not fight the workers
    records = []
    try:
        prepare_checkpoints(config, network)
        for plan in plans:
            # a warm-up step, then two measured ones unless a step is long
            count = steps or (3 if plan_seconds(network, batch, plan) < 6.0 else 2)
            engine = KernelParallelEngine(client, config, network, list(slots[:plan.workers]),
                                          samples)
            engine.quanta = list(quanta)
            engine.placement = Placement("probe", [shard_ranges(layer, row)
                                                   for layer, row in enumerate(plan.counts)])
            receipts, masters = [], []
            try:
                engine.start(0)
                for step in range(count):
                    _, done, master = engine.step(step)
                    receipts += done
                    if step:
                        masters.append(master)
                receipts += engine.finish_pending()
            finally:
                engine.close()
                if workspace:
                    shutil.rmtree(workspace, ignore_errors=True)
            names = [s.name for s in slots[:plan.workers]]
            records.append({
                "plan": plan.counts, "workers": names,
                "receipts": [dataclasses.asdict(r) for r in receipts
                             if r.phase in ("forward", "backward") and r.step >= 1],
                "master": masters})
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(base, ignore_errors=True)
    return records


def _output_root(slots: Sequence[Any]) -> str | None:
    """Where the probe's checkpoint goes: a temporary directory if every worker is local."""
    from pipeline.cluster import all_local

    if all_local(list(slots)):
        return None
    root = os.path.join(os.getcwd(), "runs")
    os.makedirs(root, exist_ok=True)
    return root


def shard_timings(records: Sequence[dict]) -> dict[str, list[tuple[int, int, int, float, float]]]:
    """Per worker name: ``(layer, kernels, active, forward_s, backward_s)`` medians."""
    cells: dict[tuple[str, int, int, int], dict[str, list[float]]] = {}
    for record in records:
        active = len(record["workers"])
        for r in record["receipts"]:
            k = record["plan"][r["layer"]][r["shard"]]
            cell = cells.setdefault((r["worker"], r["layer"], k, active),
                                    {"forward": [], "backward": []})
            cell[r["phase"]].append(r["compute_s"])
    out: dict[str, list[tuple[int, int, int, float, float]]] = {}
    for (worker, layer, k, active), cell in sorted(cells.items()):
        if cell["forward"] and cell["backward"]:
            out.setdefault(worker, []).append((layer, k, active, float(np.median(cell["forward"])),
                                               float(np.median(cell["backward"]))))
    return out


def access_rows(records: Sequence[dict], network: NetworkSpec, quanta: Sequence[int]
                ) -> tuple[list[list[float]], list[float]]:
    """Workspace accesses of the receipts as ``[direction, ops, chunks, bytes, s]`` rows,
    and the dataset batch reads (seconds) of the first layer's forward tasks."""
    rows, dataset = [], []

    def chunks(channels: int, layer: int) -> int:
        return math.ceil(channels / quanta[layer])

    for record in records:
        plan = record["plan"]
        for r in record["receipts"]:
            l, k = r["layer"], plan[r["layer"]][r["shard"]]
            layer = network.conv[l]
            if r["phase"] == "forward":
                if l == 0:
                    dataset.append(r["read_s"])
                else:
                    rows.append([0, 1, chunks(layer.in_channels, l - 1), r["read_bytes"],
                                 r["read_s"]])
                rows.append([1, 1, chunks(k, l), r["write_bytes"], r["write_s"]])
            else:
                sources = 1 if l == len(network.conv) - 1 else len(plan[l + 1])
                rows.append([0, sources, sources * chunks(k, l), r["read_bytes"], r["read_s"]])
                if l > 0:
                    rows.append([1, 1, chunks(layer.in_channels, l - 1), r["write_bytes"],
                                 r["write_s"]])
    return rows, dataset


def master_rows(records: Sequence[dict], network: NetworkSpec, quanta: Sequence[int]
                ) -> tuple[list[list[float]], list[float], list[float]]:
    """The master's accesses (rows as :func:`access_rows`), dense-head seconds, and the
    rest of its time (the batch read for the labels)."""
    rows, dense, rest = [], [], []
    last = network.conv[-1]
    chunk_count = math.ceil(last.kernels / quanta[-1])
    for record in records:
        for m in record["master"]:
            half = m["master_bytes"] / 2
            rows.append([0, 1, chunk_count, half, m["master_read_s"]])
            rows.append([1, 1, chunk_count, half, m["master_write_s"]])
            dense.append(m["master_compute_s"])
            rest.append(max(m["master_s"] - m["master_compute_s"] - m["master_read_s"]
                            - m["master_write_s"], 0.0))
    return rows, dense, rest
