"""Keeping probes as JSON files, and measuring one where none is fresh.

A probe costs seconds for the small network and a minute or two for the paper's,
so `cached_probe` keeps them keyed by everything that changes the figures: the
client's machine (host name, CPU model, usable cores, torch's instruction set, GPU
models: tasks/machine.py), torch version, network shapes, batch, per-layer channel
quanta, dtype, the worker set (names, threads, emulated speeds, resource tag, and
each worker's machine as it says it where that is not the client's),
workspace location and dataset; a reference probe also by the kind of SGD it steps
(keys.py). The cache directory is ``$CNN_PROBE_CACHE`` or
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

import json
import math
import os
import time
import uuid
from dataclasses import asdict
from typing import Any, Callable, Sequence, TypeVar

from dask.utils import parse_timedelta

from pipeline.cluster.workers import ClusterWorker, all_local
from pipeline.config.schema import ConfigError
from pipeline.probe.cluster import probe_cluster
from pipeline.probe.keys import master_key, probe_key, worker_identity, workspace_location
from pipeline.probe.machine import worker_identities
from pipeline.probe.reference import DEFAULT_OPTIMIZER, probe_master
from pipeline.probe.results import (PROBE_VERSION, ClusterProbe, MasterProbe,
                                    cluster_probe_from_dict)
from pipeline.probe.samples import MAX_SAMPLES, merge_master_samples, merge_samples
from pipeline.probe.timings import ShardTiming
from tasks.specs import NetworkSpec, OptimizerSpec


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
                 output_root: str | None = None, sample: bool = False,
                 batch_norm: str = "sync") -> ClusterProbe:
    """:func:`probe_cluster`, reusing a JSON file of an earlier identical probe.

    ``sample=True`` measures one more sample however fresh the cached probe is, and
    returns (and caches) the median of every figure over the samples taken within
    `probe_max_age`, the newest `MAX_SAMPLES` of them (samples.py: why a sweep spreads
    its probes over its repeats). Any other measurement (nothing fresh cached, its file
    deleted, or ``refresh=True``) starts anew and forgets the samples before it."""
    where = workspace_location(all_local(list(offered)), workspace_dir)
    machines = worker_identities(client, offered)  # each worker says its own
    key = probe_key(network, batch, quanta, worker_identity(offered, machines), where, dataset,
                    links, batch_norm)
    if cache and not refresh and not sample:
        cached = find_cached_probe(key)
        if cached is not None:
            return cached
    result = probe_cluster(client, offered, network, batch, quanta, workspace_dir, dataset,
                           links, output_root, batch_norm, machines)
    if not cache:
        return result
    kept = cached_samples(key) if sample and not refresh else []
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
                    alone: Callable[[], P | None]) -> list[P]:
    """The samples cached for `key`, oldest first, those `load` takes; without a samples
    file (a cache from before samples were kept), the cached probe (`alone()`) as its
    one sample."""
    data = _load(_samples_path(kind, key))
    if data is None:
        probe = alone()
        return [probe] if probe is not None and not probe.samples_created else []
    found = [load(d) for d in data if isinstance(d, dict)]
    return [p for p in found if p is not None]


def cached_samples(key: str) -> list[ClusterProbe]:
    """The samples of the cluster probe `key`, oldest first: those of this probe
    version (a probe cached without its samples file is its own one sample)."""
    return _stored_samples(CLUSTER, key, _cluster_probe,
                           lambda: find_cached_probe(key, any_age=True))


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
        cached = _cached_master(key)
        if cached is not None and (not measure or fresh_enough(cached.created)):
            return cached
    if not measure:
        return None
    result = probe_master(network, batch, threads, dataset=dataset, optimizer=optimizer)
    result.key = key
    if not cache:
        return result
    kept = cached_master_samples(key) if sample and not refresh else []
    return _keep_sample(MASTER, key, kept, result, merge_master_samples)


def cached_master_samples(key: str) -> list[MasterProbe]:
    """The samples of the master probe `key`, oldest first (as `cached_samples`)."""
    return _stored_samples(MASTER, key, lambda d: _master_probe(d, key),
                           lambda: _cached_master(key))


def _cached_master(key: str) -> MasterProbe | None:
    """The master probe cached as `key` (any age), or None."""
    return _master_probe(_load(_probe_path(MASTER, key)) or {}, key)


def _master_probe(data: dict[str, Any], key: str) -> MasterProbe | None:
    """A cached master probe, or None where it is not of `key` (the key holds the probe
    version)."""
    if data.get("key") != key:
        return None
    return MasterProbe(**{**data, "timings": [ShardTiming(**t) for t in data["timings"]]})
