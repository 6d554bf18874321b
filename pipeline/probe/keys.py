"""What identifies a probe: its cache key and the parts a key is made of.

A probe's figures hold for one client machine and the workers' machines
(pipeline/probe/machine.py), torch version, network, batch, channel quanta, worker
set, workspace location, dataset and links,
and, for a network with batch norm, the replicas' batch norm (``train.batch_norm``: the
replica plan's trunk exchanges statistics under ``sync`` and not under ``local``);
a probe of this process for ``strategy: reference`` also for its threads and kind of
SGD. `probe_key` hashes them; the rest turn a config or a worker set into parts of it.
Apart from the cache (cache.py) because the measurement (cluster.py) names its probe
by the same key.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from typing import Any, Mapping, Sequence

import torch

from pipeline.cluster.workers import ClusterWorker
from pipeline.config.run_config import RunConfig
from pipeline.probe.machine import machine_identity
from pipeline.probe.reference import DEFAULT_OPTIMIZER
from pipeline.probe.results import PROBE_VERSION
from storage.private import default_workspace_root
from tasks.specs import NetworkSpec, OptimizerSpec


def probe_key(network: NetworkSpec, batch: int, quanta: Sequence[int], workers: Sequence[Any],
              workspace: str, dataset: str | None, extra: str = "",
              batch_norm: str = "sync") -> str:
    """Cache key: everything that changes the probe's figures (see the module doc)."""
    identity = {"version": PROBE_VERSION, "machine": machine_identity(),
                "network": asdict(network), "batch": batch, "quanta": list(quanta),
                "workers": [list(w) for w in workers], "workspace": workspace,
                "dataset": os.path.abspath(dataset) if dataset else None, "extra": extra,
                "torch": torch.__version__}
    if batch_norm != "sync" and any(layer.batch_norm for layer in network.conv):
        identity["batch_norm"] = batch_norm  # (a sync probe keeps the key it had)
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def links_key(rates: dict[str, str] | None) -> str:
    """The shaped links of the workers (``cluster.link_rates()``) as a cache-key part,
    "" for none: a probe measured across links holds for those links only."""
    return "" if rates is None else json.dumps({"link_rates": rates}, sort_keys=True)


def probe_workspace_dir(config: RunConfig) -> str | None:
    """Where a probe of `config`'s cluster puts its calibration runs' workspaces: the
    folder the run's own goes in (pipeline/engine/step_engine.py, `workspace_path`), so that the
    probe times the store the run will use. ``workspace.path`` if set; for workers
    behind shaped links, the client's shared-memory folder, which they mount over
    their links as their runs do (their probes once used the output directory on
    disk, where an sftp access took about twice as long); otherwise None (the engine
    chooses, as for a run)."""
    if config.workspace.path:
        return config.workspace.folder()
    if config.cluster.link_rates() is not None:
        return default_workspace_root()
    return None


def workspace_location(all_workers_local: bool, workspace_dir: str | None = None) -> str:
    """The kind of place the engine's workspace goes (a cache-key part)."""
    if workspace_dir:
        return os.path.abspath(workspace_dir)
    shm = all_workers_local and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    return "shm" if shm else "output"


def worker_identity(offered: Sequence[ClusterWorker],
                    machines: Mapping[str, str] | None = None) -> list[tuple]:
    """What identifies a worker set for the cache: each worker's name, threads,
    emulated speed and tag, and its machine as it said it (`machines` by name:
    pipeline/probe/machine.py, `worker_machines`) where that is not the client's, which
    the key holds already. A worker on the client's machine (every embedded worker,
    whose set is known before its cluster starts) or whose machine is not known keeps
    the part it had before workers were asked; another machine under the same name
    (another partition's node, a worker pinned to fewer cores) makes another key."""
    here = machine_identity()
    rows = []
    for s in offered:
        row: tuple = (s.name, s.threads, s.emulated_speed, s.resource)
        machine = (machines or {}).get(s.name, here)
        rows.append(row if machine == here else row + (machine,))
    return rows


def optimizer_key(optimizer: OptimizerSpec) -> str:
    """What of an SGD changes a step's time, as a cache-key part ("" for the defaults
    the probes step with): whether it keeps momentum, decays weights, looks ahead."""
    kind = optimizer.kind
    return "" if kind == DEFAULT_OPTIMIZER.kind else json.dumps({"sgd": kind})


def master_key(network: NetworkSpec, batch: int, threads: int, dataset: str | None,
               optimizer: OptimizerSpec) -> str:
    """The cache key of a probe of this process training `network` (`reference`)."""
    return probe_key(network, batch, [], [("master", threads)], "none", dataset,
                     optimizer_key(optimizer))
