"""Probing a cluster: calibration runs of the engine, hops and rates, as one probe.

`probe_cluster` measures every constant of the cost model on the workers offered
(pipeline/probe/runs.py, rounds.py and readings.py for the runs, client_share.py for
the client's share of the cores, hops.py, replica_rates.py) and returns them as a
`ClusterProbe` (results.py) named by its cache key (keys.py). Keeping probes is
cache.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any, Iterator, Sequence

from distributed.comm import get_address_host

from pipeline.cluster.startup import usable_cores
from pipeline.cluster.workers import ClusterWorker, all_local, scheduler_in_process
from pipeline.costmodel.contention import cores_filled
from pipeline.probe.client_cpu import client_cpu_fit
from pipeline.probe.client_share import SHARE_BELOW_S, median_share
from pipeline.probe.hops import probe_hops
from pipeline.probe.keys import probe_key, worker_identity, workspace_location
from pipeline.probe.machine import machine_identity, worker_identities
from pipeline.probe.dask_readings import check_s, step_gap_s, sync_s, task_gap_s
from pipeline.probe.readings import (access_spreads, dataset_read_s, dense_s,
                                     relative_spreads, shard_timings, store_fit,
                                     trunk_timings)
from pipeline.probe.replica_rates import probe_memory_rates, probe_replica_heads
from pipeline.probe.results import (ClusterProbe, DaskProbe, MasterProbe, StoreProbe,
                                    WorkerProbe)
from pipeline.probe.rounds import calibrate
from pipeline.probe.runs import (Plan, ProbePlan, ReplicaPlan, plan_seconds, plans_for,
                                 replica_plan)
from storage.datasets import create_synthetic_dataset
from tasks.specs import NetworkSpec


def alike_workers(offered: Sequence[ClusterWorker]) -> list[list[str]]:
    """Names of workers that are the same hardware as far as the probe can tell: the
    same host, tag, device, torch threads and emulated speed (as
    `pipeline.placement.calibrate.alike_groups` groups them for a split)."""
    groups: dict[tuple, list[str]] = {}
    for w in offered:
        key = (get_address_host(w.address), w.resource, w.device, w.threads, w.emulated_speed)
        groups.setdefault(key, []).append(w.name)
    return list(groups.values())


@contextlib.contextmanager
def _dataset_for(network: NetworkSpec, batch: int, dataset: str | None) -> Iterator[str]:
    """The dataset to calibrate on: the run's, or a small synthetic one of its shape."""
    if dataset:
        yield dataset
        return
    first = network.conv[0]
    folder = tempfile.mkdtemp(prefix="probe-data-")
    try:
        path = os.path.join(folder, "synthetic.zarr")
        create_synthetic_dataset(path, train_samples=max(4 * batch, 256), test_samples=16,
                                 image_shape=(first.in_channels, first.in_height, first.in_width),
                                 classes=network.classes, dtype=network.dtype)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def probe_cluster(client: Any, offered: Sequence[ClusterWorker], network: NetworkSpec, batch: int,
                  quanta: Sequence[int], workspace_dir: str | None = None,
                  dataset: str | None = None, links: str = "",
                  output_root: str | None = None, batch_norm: str = "sync",
                  machines: dict[str, str] | None = None) -> ClusterProbe:
    """Calibration runs of the engine on ``offered`` in rounds, sizes timed again
    where the rounds disagree (pipeline/probe/runs.py, rounds.py, readings.py), hops,
    and what a replica runs beyond its trunk: its update (each worker's memory rate)
    and its dense head on its rows (replica_rates.py). The data replica plan runs
    only beside the hybrid one: its step is read as an adjustment of the trunk
    (`readings.trunk_timings`).

    ``links`` names the shaped links the workers sit behind ("" for none; a cache-key
    part: the store's figures are measured across them), ``output_root`` where the
    calibration runs' checkpoints go (a directory the workers reach: over a link, one
    that is mounted on their side), ``batch_norm`` the replicas' (``train.batch_norm``)
    in the replica plan, whose trunk is the runs' replicas', ``machines`` each worker's
    machine by name (asked of the workers where not given: pipeline/probe/machine.py)."""
    started = time.perf_counter()
    if machines is None:
        machines = worker_identities(client, offered)
    plans: list[Plan] = list(plans_for(network, batch, quanta, len(offered)))
    replicas = replica_plan(network, batch, len(offered), batch_norm)
    data_replicas = replica_plan(network, batch, len(offered), batch_norm, whole=True)
    plans += [plan for plan in (replicas, data_replicas) if plan is not None and replicas]
    shared = share_plans(plans, offered, network, batch) if scheduler_in_process(client) \
        else []
    with _dataset_for(network, batch, dataset) as path:
        runs, again, shares = calibrate(client, offered, network, batch, path, plans,
                                        workspace_dir, output_root, shared, batch_norm)
    ran = time.perf_counter()
    round_trip, hop = probe_hops(client, offered)
    memory = probe_memory_rates(client, offered, network)
    heads = probe_replica_heads(client, offered, network, replicas.shares) if replicas else {}
    timings, spreads = shard_timings(runs), relative_spreads(runs)
    trunks = {name: replace(trunk, dense_s=heads.get(name))
              for name, trunk in trunk_timings(runs, alike_workers(offered)).items()}
    workers = [WorkerProbe(s.name, s.address, s.threads, s.emulated_speed,
                           timings.get(s.name, []), trunks.get(s.name), spreads.get(s.name, {}),
                           memory.get(s.name), machines.get(s.name, ""))
               for s in offered]
    fits = {kind: store_fit(runs, kind) for kind in ("read", "write")}
    (read_latency, read_bw), (write_latency, write_bw) = fits["read"], fits["write"]
    store = StoreProbe(workspace_dir or "engine default", read_latency, read_bw, write_latency,
                       write_bw, dataset_read_s(runs), access_spreads(runs, fits))
    per_task, rate = client_cpu_fit([reading for run in runs for reading in run.task_cpu])
    dask = DaskProbe(task_gap_s(runs), sync_s(runs), hop, round_trip, per_task, rate,
                     scheduler_in_process(client), usable_cores(), median_share(shares),
                     shares, check_s(runs), step_gap_s(runs))
    dense = dense_s(runs)
    master = MasterProbe(1, batch, dense.value, created=time.time(), dense_low_s=dense.low,
                         dense_high_s=dense.high)
    where = workspace_location(all_local(list(offered)), workspace_dir)
    key = probe_key(network, batch, quanta, worker_identity(offered, machines), where, dataset,
                    links, batch_norm)
    plain = json.loads(json.dumps(asdict(network)))  # as it comes back from the cache
    done = time.perf_counter()
    return ClusterProbe(key, time.time(), machine_identity(), plain, batch, list(quanta),
                        workers, store, dask, master, done - started,
                        {"runs": ran - started, "hops and memory": done - ran,
                         "timed_again": again})


def share_plans(plans: Sequence[Plan], offered: Sequence[ClusterWorker], network: NetworkSpec,
                batch: int) -> list[Plan]:
    """The plans the client's share of the cores is measured on: the even kernel plan
    and the replica plan over every worker, of less than `SHARE_BELOW_S` a step (the
    client's milliseconds are lost in a longer one), where the workers' threads fill
    the cores this process may run on (elsewhere the client has a core of its own and
    the share is never used); none for one worker."""
    threads = [w.threads for w in offered]
    if len(offered) < 2 or not cores_filled(threads, usable_cores()):
        return []
    even = [p for p in plans if isinstance(p, ProbePlan) and p.workers == len(offered)][:1]
    trunks = [p for p in plans if isinstance(p, ReplicaPlan) and not p.whole]
    return [p for p in even + trunks
            if plan_seconds(network, batch, p) < SHARE_BELOW_S]
