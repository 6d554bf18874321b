"""Probing a cluster for the cost model, and keeping probes as JSON files.

A probe costs seconds for the small network and a minute or two for the paper's,
so `cached_probe` keeps them keyed by everything that changes the figures: the
machine (host name, CPU model, usable cores, torch's instruction set, GPU models:
pipeline/probe/machine.py), torch version, network shapes, batch, per-layer channel
quanta, dtype, the worker set (names, threads, emulated speeds, resource tag),
workspace location and dataset; a reference probe also by the kind of SGD it steps
(`optimizer_key`). The cache directory is ``$CNN_PROBE_CACHE`` or
``~/.cache/dask-cnn/probes``; delete a file (or pass ``refresh=True``) to measure
again, e.g. after the machine's load changed. A probe older than
``$CNN_PROBE_MAX_AGE`` (`probe_max_age`) is measured again where it can be; only
measuring nothing takes an older one.

A probe may stand for several samples (``sample=True``, what a sweep asks at each
repeat): ``<kind>-<key>.samples.json`` keeps each as measured, and
``<kind>-<key>.json`` the median of every figure over them (samples.py), which is
what predictions read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, replace
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from dask.utils import parse_timedelta
from distributed.comm import get_address_host

from pipeline.cluster.workers import ClusterWorker, all_local, scheduler_in_process
from pipeline.config.run_config import RunConfig
from pipeline.config.schema import ConfigError
from pipeline.costmodel.contention import cores_filled
from pipeline.probe.hops import probe_hops
from pipeline.probe.replica_rates import probe_memory_rates, probe_replica_heads
from pipeline.probe.machine import machine_identity
from pipeline.probe.reference import DEFAULT_OPTIMIZER, probe_master
from pipeline.probe.results import (PROBE_VERSION, ClusterProbe, DaskProbe, MasterProbe, StoreProbe,
                                    WorkerProbe, cluster_probe_from_dict)
from pipeline.probe.timings import ShardTiming
from pipeline.probe.readings import (access_spreads, client_cpu_fit, dataset_read_s, dense_s,
                                     relative_spreads, shard_timings, store_fit, sync_s,
                                     task_gap_s, trunk_timings)
from pipeline.probe.rounds import calibrate
from pipeline.probe.samples import MAX_SAMPLES, merge_master_samples, merge_samples
from pipeline.probe.client_share import SHARE_BELOW_S, median_share
from pipeline.probe.runs import (Plan, ProbePlan, ReplicaPlan, plan_seconds, plans_for,
                                 replica_plan)
from pipeline.cluster.startup import usable_cores
from storage.datasets import create_synthetic_dataset
from storage.private import default_workspace_root
from tasks.specs import NetworkSpec, OptimizerSpec


def probe_key(network: NetworkSpec, batch: int, quanta: Sequence[int], workers: Sequence[Any],
              workspace: str, dataset: str | None, extra: str = "") -> str:
    """Cache key: everything that changes the probe's figures (see the module doc)."""
    identity = {"version": PROBE_VERSION, "machine": machine_identity(),
                "network": asdict(network), "batch": batch, "quanta": list(quanta),
                "workers": [list(w) for w in workers], "workspace": workspace,
                "dataset": os.path.abspath(dataset) if dataset else None, "extra": extra,
                "torch": torch.__version__}
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def links_key(rates: dict[str, str] | None) -> str:
    """The shaped links of the workers (``cluster.link_rates()``) as a cache-key part,
    "" for none: a probe measured across links holds for those links only."""
    return "" if rates is None else json.dumps({"link_rates": rates}, sort_keys=True)


#: How long a cached probe stands for its machine, where ``$CNN_PROBE_MAX_AGE`` does
#: not say: a machine's speed drifts (a shared VM's neighbours come and go). Here the
#: README's quick sweep read 10-12 % slow from a probe days old, two probes of one
#: cluster 40 minutes apart predicted 4-8 % apart, and probes 20 minutes old (taken
#: right after a test run) read 9-22 % slow. A probe costs seconds to a couple of
#: minutes; a sweep's points, more.
DEFAULT_MAX_AGE_S = 3600.0


def probe_max_age() -> float:
    """Seconds a cached probe is reused for: ``$CNN_PROBE_MAX_AGE`` (``90``, ``30m``,
    ``6h``, ``2d``; ``inf`` reuses it for ever, ``0`` never), default
    `DEFAULT_MAX_AGE_S`. A value that is none of these is a `ConfigError`."""
    text = os.environ.get("CNN_PROBE_MAX_AGE", "").strip()
    if not text:
        return DEFAULT_MAX_AGE_S
    if text.lower() in ("inf", "never"):
        return math.inf
    try:
        seconds = float(parse_timedelta(text))
    except (KeyError, ValueError, TypeError):
        seconds = -1.0
    if not seconds >= 0:
        raise ConfigError(f"CNN_PROBE_MAX_AGE={text!r}: expected a duration such as 90, 30m, "
                          "6h or 2d, or inf")
    return seconds


def fresh_enough(created: float, now: float | None = None) -> bool:
    """Whether a probe made at ``created`` (epoch seconds) is young enough to reuse."""
    return (time.time() if now is None else now) - created <= probe_max_age()


def cache_dir() -> str:
    """Where probes are kept: ``$CNN_PROBE_CACHE`` or ``~/.cache/dask-cnn/probes``."""
    return os.environ.get("CNN_PROBE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "dask-cnn", "probes")


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


def worker_identity(offered: Sequence[ClusterWorker]) -> list[tuple]:
    """What identifies a worker set for the cache."""
    return [(s.name, s.threads, s.emulated_speed, s.resource) for s in offered]


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
                  output_root: str | None = None) -> ClusterProbe:
    """Calibration runs of the engine on ``offered`` in rounds, sizes timed again
    where the rounds disagree (pipeline/probe/runs.py, rounds.py, readings.py), hops,
    and what a replica runs beyond its trunk: its update (each worker's memory rate)
    and its dense head on its rows (replica_rates.py).

    ``links`` names the shaped links the workers sit behind ("" for none; a cache-key
    part: the store's figures are measured across them), ``output_root`` where the
    calibration runs' checkpoints go (a directory the workers reach: over a link, one
    that is mounted on their side)."""
    started = time.perf_counter()
    plans: list[Plan] = list(plans_for(network, batch, quanta, len(offered)))
    replicas = replica_plan(network, batch, len(offered))
    plans += [replicas] if replicas else []
    shared = share_plans(plans, offered, network, batch) if scheduler_in_process(client) \
        else []
    with _dataset_for(network, batch, dataset) as path:
        runs, again, shares = calibrate(client, offered, network, batch, path, plans,
                                        workspace_dir, output_root, shared)
    ran = time.perf_counter()
    round_trip, hop = probe_hops(client, offered)
    memory = probe_memory_rates(client, offered, network)
    heads = probe_replica_heads(client, offered, network, replicas.shares) if replicas else {}
    timings, spreads = shard_timings(runs), relative_spreads(runs)
    trunks = {name: replace(trunk, dense_s=heads.get(name))
              for name, trunk in trunk_timings(runs, alike_workers(offered)).items()}
    workers = [WorkerProbe(s.name, s.address, s.threads, s.emulated_speed,
                           timings.get(s.name, []), trunks.get(s.name), spreads.get(s.name, {}),
                           memory.get(s.name))
               for s in offered]
    fits = {kind: store_fit(runs, kind) for kind in ("read", "write")}
    (read_latency, read_bw), (write_latency, write_bw) = fits["read"], fits["write"]
    store = StoreProbe(workspace_dir or "engine default", read_latency, read_bw, write_latency,
                       write_bw, dataset_read_s(runs), access_spreads(runs, fits))
    per_task, rate = client_cpu_fit(runs)
    dask = DaskProbe(task_gap_s(runs), sync_s(runs), hop, round_trip, per_task, rate,
                     scheduler_in_process(client), usable_cores(), median_share(shares),
                     shares)
    dense = dense_s(runs)
    master = MasterProbe(1, batch, dense.value, created=time.time(), dense_low_s=dense.low,
                         dense_high_s=dense.high)
    where = workspace_location(all_local(list(offered)), workspace_dir)
    key = probe_key(network, batch, quanta, worker_identity(offered), where, dataset, links)
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
    return [p for p in even + [p for p in plans if isinstance(p, ReplicaPlan)]
            if plan_seconds(network, batch, p) < SHARE_BELOW_S]


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _save(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{uuid.uuid4().hex[:6]}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
    os.replace(temporary, path)


def cached_probe(client: Any, offered: Sequence[ClusterWorker], network: NetworkSpec, batch: int,
                 quanta: Sequence[int], workspace_dir: str | None = None,
                 dataset: str | None = None, refresh: bool = False,
                 cache: bool = True, links: str = "",
                 output_root: str | None = None, sample: bool = False) -> ClusterProbe:
    """:func:`probe_cluster`, reusing a JSON file of an earlier identical probe.

    ``sample=True`` measures one more sample however fresh the cached probe is, and
    returns (and caches) the median of every figure over the samples taken within
    `probe_max_age`, the newest `MAX_SAMPLES` of them (samples.py: why a sweep spreads
    its probes over its repeats). ``refresh=True`` measures afresh and forgets the
    samples before it."""
    where = workspace_location(all_local(list(offered)), workspace_dir)
    key = probe_key(network, batch, quanta, worker_identity(offered), where, dataset, links)
    if cache and not refresh and not sample:
        cached = find_cached_probe(key)
        if cached is not None:
            return cached
    result = probe_cluster(client, offered, network, batch, quanta, workspace_dir, dataset,
                           links, output_root)
    if not cache:
        return result
    kept = [] if refresh else cached_samples(key)
    return _keep_sample(CLUSTER, key, kept, result, merge_samples)


#: The cache's two kinds of probe: of a cluster, and of this process (`reference`).
CLUSTER, MASTER = "cluster", "master"


def _probe_path(kind: str, key: str) -> str:
    """The probe predictions are made from (its samples' medians)."""
    return os.path.join(cache_dir(), f"{kind}-{key}.json")


def _samples_path(kind: str, key: str) -> str:
    """The samples behind `_probe_path`'s probe, each as it was measured."""
    return os.path.join(cache_dir(), f"{kind}-{key}.samples.json")


P = TypeVar("P", ClusterProbe, MasterProbe)


def _keep_sample(kind: str, key: str, kept: list[P], result: P,
                 merge: Callable[[Sequence[P]], P]) -> P:
    """Cache `result` as the newest sample beside those `kept` that are fresh enough (at
    most `MAX_SAMPLES` in all), and their merge as the probe; returns the merge."""
    samples = ([p for p in kept if fresh_enough(p.created)] + [result])[-MAX_SAMPLES:]
    _save(_samples_path(kind, key), [asdict(p) for p in samples])
    merged = merge(samples)
    _save(_probe_path(kind, key), asdict(merged))
    return merged


def _stored_samples(kind: str, key: str, load: Callable[[dict[str, Any]], P | None],
                    alone: P | None) -> list[P]:
    """The samples cached for `key`, oldest first, those `load` takes; without a samples
    file (a cache from before samples were kept), the probe `alone` as its one sample."""
    data = _load(_samples_path(kind, key))
    if data is None:
        return [alone] if alone is not None and not alone.samples_created else []
    found = [load(d) for d in data if isinstance(d, dict)]
    return [p for p in found if p is not None]


def cached_samples(key: str) -> list[ClusterProbe]:
    """The samples of the cluster probe `key`, oldest first: those of this probe
    version (a probe cached without its samples file is its own one sample)."""
    return _stored_samples(CLUSTER, key, _cluster_probe, find_cached_probe(key, any_age=True))


def _cluster_probe(data: dict[str, Any]) -> ClusterProbe | None:
    """A cached cluster probe, or None where it is of another probe version."""
    return cluster_probe_from_dict(data) if data.get("version") == PROBE_VERSION else None


def find_cached_probe(key: str, any_age: bool = False) -> ClusterProbe | None:
    """A cached cluster probe by key, or None; one older than `probe_max_age` only with
    ``any_age`` (where nothing may be measured instead)."""
    data = _load(_probe_path(CLUSTER, key))
    if data is None or (not any_age and not fresh_enough(data.get("created", 0.0))):
        return None
    return _cluster_probe(data)


def optimizer_key(optimizer: OptimizerSpec) -> str:
    """What of an SGD changes a step's time, as a cache-key part ("" for the defaults
    the probes step with): whether it keeps momentum, decays weights, looks ahead."""
    kind = optimizer.kind
    return "" if kind == DEFAULT_OPTIMIZER.kind else json.dumps({"sgd": kind})


def cached_master_probe(network: NetworkSpec, batch: int, threads: int,
                        dataset: str | None = None, refresh: bool = False,
                        cache: bool = True, measure: bool = True,
                        optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
                        sample: bool = False) -> MasterProbe | None:
    """:func:`probe_master` for ``strategy: reference``, reusing an earlier identical probe
    (one per kind of SGD: `optimizer_key`).

    ``measure=False``: only the cache, at any age (``None`` if it has no such probe).
    ``sample=True``: one more sample, the probe the median of the recent ones (as
    `cached_probe`'s).
    """
    key = master_key(network, batch, threads, dataset, optimizer)
    if cache and not refresh and not (sample and measure):
        cached = _master_probe(_load(_probe_path(MASTER, key)) or {}, key)
        if cached is not None and (not measure or fresh_enough(cached.created)):
            return cached
    if not measure:
        return None
    result = probe_master(network, batch, threads, dataset=dataset, optimizer=optimizer)
    result.key = key
    if not cache:
        return result
    kept = [] if refresh else cached_master_samples(key)
    return _keep_sample(MASTER, key, kept, result, merge_master_samples)


def master_key(network: NetworkSpec, batch: int, threads: int, dataset: str | None,
               optimizer: OptimizerSpec) -> str:
    """The cache key of a probe of this process training `network` (`reference`)."""
    return probe_key(network, batch, [], [("master", threads)], "none", dataset,
                     optimizer_key(optimizer))


def cached_master_samples(key: str) -> list[MasterProbe]:
    """The samples of the master probe `key`, oldest first (as `cached_samples`)."""
    alone = _master_probe(_load(_probe_path(MASTER, key)) or {}, key)
    return _stored_samples(MASTER, key, lambda d: _master_probe(d, key), alone)


def _master_probe(data: dict[str, Any], key: str) -> MasterProbe | None:
    """A cached master probe, or None where it is not of `key` (the key holds the probe
    version)."""
    if data.get("key") != key:
        return None
    return MasterProbe(**{**data, "timings": [ShardTiming(**t) for t in data["timings"]]})
