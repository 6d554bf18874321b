"""How much memory each worker of a run may use, as placement needs to know it.

- an embedded worker: its config's `memory_limit` (cluster.workers entries);
- an external `dask worker`: the `--memory-limit` it was started with, as the
  scheduler reports it (Dask's default, "auto", is the host's memory shared among
  its workers; `0` means none), times the share Dask lets it hold before it pauses
  the worker or its nanny restarts it (80 % by default: pipeline/cluster/worker_limits.py);
- a GPU worker: its device's total memory (asked on the worker), or its
  `memory_limit` where that is lower;
- otherwise unlimited (`math.inf`).

The embedded cluster does not hand the limit to Dask's nanny: a nanny pauses a worker
at 80 % of it and kills it at 95 %, which for a training run means a stalled or lost
shard in the middle of a step. The limit is a capacity that placement keeps to,
before the run; what a run holds is predicted, not policed.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import dask

import torch
from distributed import Client

from pipeline.cluster.workers import ClusterWorker, scheduler_address
from pipeline.config.cluster_config import ClusterConfig
from pipeline.placement.memory_fit import MemoryRefused
from pipeline.cluster.worker_limits import ASK_WORKERS_S, MemoryRule, memory_rule, memory_rules


def gpu_total_memory(device: str) -> int:
    """Total memory of a CUDA device of this process (bytes); run on the worker."""
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def worker_capacities(client: Client, config: ClusterConfig,
                      workers: list[ClusterWorker]) -> list[float]:
    """Each worker's memory capacity in bytes (`math.inf`: none known)."""
    embedded = scheduler_address(config) is None
    limits = {w.name: w.memory_bytes() for w in config.worker_list()} if embedded else {}
    gpus = {}
    for worker in workers:
        if worker.device.startswith("cuda"):
            try:
                total = client.run(gpu_total_memory, worker.device, workers=[worker.address],
                                   callback_timeout=ASK_WORKERS_S)
            except (OSError, TimeoutError):  # frozen: unknown (the stall watch finds it)
                continue
            gpus[worker.name] = float(next(iter(total.values())))
    reported = client.scheduler_info().get("workers", {})
    ours = {w.address: reported[w.address] for w in workers if w.address in reported}
    rules = {} if embedded else memory_rules(client, ours)
    return capacities_from(workers, limits, reported, gpus, rules)


def capacities_from(workers: list[ClusterWorker], limits: dict[str, float | None],
                    reported: dict[str, dict], gpus: dict[str, float],
                    rules: dict[str, MemoryRule] | None = None) -> list[float]:
    """The capacities (pure): a configured limit (`limits`, by name: the embedded
    cluster's config) wins; else the limit the scheduler reports for the worker's
    address (`reported`, its `memory_limit`; 0 or none: no limit) times the share
    Dask lets the worker hold (`rules`, by address); a GPU's total (`gpus`, by name)
    caps either."""
    capacities = []
    for worker in workers:
        capacity = limits.get(worker.name)
        if capacity is None and worker.name not in limits:
            limit = reported.get(worker.address, {}).get("memory_limit") or 0
            rule = (rules or {}).get(worker.address)
            capacity = float(limit) * (rule.fraction if rule else 1.0) if limit else None
        gpu = gpus.get(worker.name)
        if gpu is not None:
            capacity = gpu if capacity is None else min(capacity, gpu)
        capacities.append(math.inf if capacity is None else float(capacity))
    return capacities


@contextlib.contextmanager
def capacities_explained(config: ClusterConfig) -> Iterator[None]:
    """Add to a `MemoryRefused` raised in the block, on a cluster the user started,
    that a worker's capacity is the share of its limit Dask lets it hold (its "has"
    figure is below the `--memory-limit` it was given)."""
    try:
        yield
    except MemoryRefused as refused:
        if scheduler_address(config) is None:
            raise
        rule = memory_rule(dask.config.get("distributed.worker.memory.pause", False),
                           dask.config.get("distributed.worker.memory.terminate", False),
                           True)
        raise MemoryRefused(f"{refused} (a dask worker you started has what Dask lets it "
                            f"hold of its --memory-limit: {rule.describe()})", refused.needed,
                            refused.available) from None
